"""The hook-based per-example gradient engine (fast path with a generic fallback).

The engine attaches to a model and observes an ordinary training step::

    engine = PerExampleGradientEngine(model, loss_reduction="mean")
    loss = F.cross_entropy(model(x), y)          # reduction "mean", as declared
    loss.backward()                              # or engine.backward(loss), see below
    norms = engine.squared_norms()               # {name: ‖g_i‖² of shape (B,)}
    factors = clip_factors(norms)                # per-example f_i, one (B,) tensor or per name
    engine.write_clipped_sum(factors)            # p.grad = Σ_i f_i g_i for every parameter
    optimizer.step()

with g_i the gradient of example i's loss ℓ_i, where the batch loss is Σ_i ℓ_i
(``loss_reduction="sum"``) or (1/B) Σ_i ℓ_i (``"mean"``; the engine undoes the 1/B).

How: the model is split into *units*. A module whose exact type has a registered grad sampler
(:mod:`~dpledger.adapters.torch.registry`) is a unit for its parameters; a module of another type
that owns trainable parameters directly is a *generic* unit for all the parameters of its subtree.
During the forward each unit's call stores its inputs (autograd keeps most of them anyway) and
hooks the autograd node that produced its output; during the backward that hook stores the
gradient with respect to the output (taken before any later in-place operation). After the
backward, squared norms come from the samplers' ghost-norm functions (Li et al. 2022) or from
materialised per-example gradients, whichever is cheaper for the layer's shapes, and the clipped
sum is formed from the same stored tensors and the factors (book-keeping, Bu et al. 2023): no
second backward pass. Generic units compute their per-example gradients with ``torch.func``
(``vmap`` of the module's vector-Jacobian product over the stored inputs and output gradients).

A parameter used by two units (tied weights) or a unit called several times in one forward gets
its per-example gradient as the sum of the materialised per-example gradients of every use, so
its norm is exact. A parameter whose gradient comes from outside the forward of its unit (a child
module's weight used directly by its parent) cannot be seen by the hooks: the engine refuses it
when the parameter receives gradient without any observed use, and on the first ``check_steps``
steps it compares its Σ_i g_i with autograd's batch gradient.

``loss_reduction`` is a declaration the gradients cannot confirm (a mean loss and a sum loss
differ by a constant factor that every gradient shares). A wrong declaration scales every g_i by
B or 1/B: the clipped contributions are still bounded by the clip norm, so the privacy bound
holds, but clipping then acts at a different effective norm.

The one case that can be told is a loss that is the direct output of a PyTorch loss which saves
its reduction (``cross_entropy``, ``nll_loss``, ``mse_loss``, ``binary_cross_entropy``,
``binary_cross_entropy_with_logits``, ``huber_loss``, ``smooth_l1_loss``):
:meth:`PerExampleGradientEngine.backward` reads that reduction on the first step and warns
(:class:`~dpledger.adapters.torch.errors.LossReductionWarning`) when it contradicts the
declaration over more than one record and more than one term. Any other loss (a ``.sum()``, a
``.mean()``, a rescaled loss, a weighted mean) is not judged: the same gradients come from a
correct declaration, so no check on the gradients is free of false alarms.
A plain ``loss.backward()`` never shows the engine the loss.

``engine.backward(loss)`` can replace ``loss.backward()``: it asks autograd only for the
gradients with respect to the units' outputs (``torch.autograd.grad`` on their gradient edges),
which skips computing the batch gradient of every weight that the clipped sum replaces anyway.
On checking steps it runs the ordinary backward.

BatchNorm with batch statistics is refused at construction and at every forward
(:class:`~dpledger.adapters.torch.errors.RecordMixingModuleError`); frozen BatchNorm (evaluation
mode, running statistics) is a per-example affine map and is supported, trainable or not.

A *step* is one forward of the model with gradients enabled and the backward after it: each such
forward of the model (the module the engine was attached to) drops what was stored for the
previous step. Forwards under ``torch.no_grad()`` store nothing and keep the step. Records are
along dimension 0 of the model's inputs and of every unit's inputs and outputs, except where a
unit's grad sampler declares the record dimension of each output (``output_record_dims``, e.g.
recurrent layers with ``batch_first=False``): the engine then stores those output gradients with
their records moved to dimension 0, and the sampler reads its inputs in their own layout.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from dpledger.adapters.torch import layer_rules as _builtin_layer_rules  # noqa: F401  (registers)
from dpledger.adapters.torch.errors import (
    EngineStateError,
    LossReductionWarning,
    RecordMixingModuleError,
    UnsupportedModuleError,
    UnsupportedParameterUseError,
)
from dpledger.adapters.torch.factors import expand_factors
from dpledger.adapters.torch.functional_gradients import (
    clipped_sum_of,
    module_per_example_gradients,
    squared_norms_of,
)
from dpledger.adapters.torch.layer_rules.normalization import (
    batch_norm_refusal_message,
    uses_batch_statistics,
)
from dpledger.adapters.torch.module_checks import check_module_configuration
from dpledger.adapters.torch.registry import GradSampler, get_cross_term, get_grad_sampler
from dpledger.errors import DPLedgerError, InvalidParameterError
from dpledger.mechanisms.clipping import rounding_clip_margin

__all__ = ["LossReduction", "PerExampleGradientEngine", "Strategy"]

logger = logging.getLogger(__name__)

_REDUCTIONS = {1: "mean", 2: "sum"}
"""PyTorch's reduction codes (``torch.nn._reduction``) as saved on loss autograd nodes."""


def _loss_reduction_of(loss: torch.Tensor) -> tuple[str, str, int] | None:
    """(node name, reduction, number of terms) when ``loss`` is the direct output of a PyTorch
    loss that saves its reduction; None otherwise (nothing is claimed about other losses).

    A weighted ``nll_loss`` / ``cross_entropy`` (a mean that divides by the weights' sum) and
    one with ignored targets (fewer terms than targets) are not claimed either.
    """
    node = getattr(loss, "grad_fn", None)
    code = getattr(node, "_saved_reduction", None)
    if not isinstance(code, int) or code not in _REDUCTIONS:
        return None
    if getattr(node, "_saved_weight", None) is not None:
        return None
    terms = getattr(node, "_saved_target", None)
    ignored = getattr(node, "_saved_ignore_index", None)
    if isinstance(terms, torch.Tensor) and ignored is not None and bool((terms == ignored).any()):
        return None
    if terms is None:
        terms = getattr(node, "_saved_self", None)
    if not isinstance(terms, torch.Tensor):
        return None
    return type(node).__name__, _REDUCTIONS[code], terms.numel()


LossReduction = Literal["mean", "sum"]
Strategy = Literal["auto", "ghost", "per_example", "generic"]
_STRATEGIES = ("auto", "ghost", "per_example", "generic")


class _Capture:
    """One observed forward call of a unit and the gradients with respect to its outputs."""

    __slots__ = ("args", "edges", "grads", "kwargs", "out_indices", "record_dims", "rng_state")

    def __init__(
        self,
        args: tuple,
        kwargs: dict,
        out_indices: list[int],
        record_dims: list[int] | None = None,
        rng_state: Any = None,
    ) -> None:
        self.args = args
        self.kwargs = kwargs
        self.out_indices = out_indices
        # None: one output tensor, records along dim 0. Otherwise the record dimension of each
        # hooked output; its gradient is stored with the records moved to dimension 0.
        self.record_dims = record_dims
        self.rng_state = rng_state
        self.edges: list[Any] = []
        self.grads: list[torch.Tensor | None] = [None] * len(out_indices)

    @property
    def has_grad(self) -> bool:
        return any(g is not None for g in self.grads)

    def store(self, k: int, grad: torch.Tensor | None) -> None:
        if grad is None:
            return
        if self.record_dims is not None and self.record_dims[k] != 0:
            grad = grad.movedim(self.record_dims[k], 0)
        self.grads[k] = grad if self.grads[k] is None else self.grads[k] + grad

    def release(self) -> None:
        """Drop the stored tensors and edges.

        The autograd node of the unit's output holds a hook that refers to this capture, and
        the capture's edges refer to that node: a cycle through a C++ object that Python's
        garbage collector cannot see through, which would keep the engine, the model and
        everything they refer to alive forever. Emptying the capture breaks it.
        """
        self.args = ()
        self.kwargs = {}
        self.rng_state = None
        self.edges = []
        self.grads = [None] * len(self.out_indices)

    def output_grads(self) -> list[tuple[int, torch.Tensor]]:
        return [(i, g) for i, g in zip(self.out_indices, self.grads, strict=True) if g is not None]


@dataclass
class _Unit:
    name: str
    module: nn.Module
    sampler: GradSampler | None
    local_to_global: dict[str, str]
    captures: list[_Capture] = field(default_factory=list)
    # A generic unit's subtree's trainable parameters (local name -> global name), and the
    # nearest generic unit above this one, which differentiates this unit's parameters in a
    # step in which this unit was not called (its parent used them directly).
    subtree: dict[str, str] = field(default_factory=dict)
    adopter: _Unit | None = None
    rng_state: Any = None  # the random-number state at the start of its last forward call

    @property
    def label(self) -> str:
        return f"{self.name or '<model>'} ({type(self.module).__name__})"


@dataclass
class _StepState:
    batch_size: int
    scale: float
    norms: dict[str, torch.Tensor]
    ghost: list[tuple[_Unit, _Capture]]
    per_example: dict[str, torch.Tensor]
    grad_eps: float  # machine epsilon of the least precise output gradient (autocast)


class PerExampleGradientEngine:
    """Per-example squared gradient norms and clipped sums from an ordinary forward and backward.

    Args:
        model: the model (the module whose forward starts a step). Create the engine after
            freezing parameters (``requires_grad=False``): only the parameters trainable at
            construction are handled.
        loss_reduction: how the loss the caller differentiates combines the per-example losses:
            "sum" (Σ_i ℓ_i) or "mean" ((1/B) Σ_i ℓ_i, e.g. ``F.cross_entropy``'s default).
        strategy: "auto" (each registered layer picks ghost norms or materialised per-example
            gradients by cost), "ghost" (the fast path wherever a sampler has one),
            "per_example" (registered samplers materialise), or "generic" (every module through
            ``torch.func``, no registered sampler used).
        check_steps: on this many first steps with a non-empty batch and an ordinary backward,
            compare Σ_i g_i with autograd's batch gradient and raise
            :class:`UnsupportedParameterUseError` on a mismatch (a parameter used outside its
            module's forward, a regulariser in the loss). 0 disables the check.
        generic_chunk_size: examples per ``vmap`` chunk in generic units; None for all.

    Raises:
        RecordMixingModuleError: BatchNorm that uses batch statistics.
        UnsupportedModuleError: a module option that mixes records (``scale_grad_by_freq``), or
            a configuration a grad sampler refuses (its ``check_fn``: e.g. an LSTM with
            ``proj_size``); a sampler's refusal of a forward's inputs (a ``PackedSequence``) is
            raised by that forward, before anything is recorded.
        InvalidParameterError: a bad argument.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        loss_reduction: LossReduction,
        strategy: Strategy = "auto",
        check_steps: int = 1,
        generic_chunk_size: int | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise InvalidParameterError("model", model, "a torch.nn.Module")
        if loss_reduction not in ("mean", "sum"):
            raise InvalidParameterError(
                "loss_reduction",
                loss_reduction,
                "'mean' (loss = average of per-example losses) or 'sum' (their sum)",
            )
        if strategy not in _STRATEGIES:
            raise InvalidParameterError("strategy", strategy, f"one of {_STRATEGIES}")
        if isinstance(check_steps, bool) or not isinstance(check_steps, int) or check_steps < 0:
            raise InvalidParameterError("check_steps", check_steps, "an integer >= 0")
        if generic_chunk_size is not None and (
            isinstance(generic_chunk_size, bool)
            or not isinstance(generic_chunk_size, int)
            or generic_chunk_size < 1
        ):
            raise InvalidParameterError(
                "generic_chunk_size", generic_chunk_size, "an integer >= 1, or None"
            )
        check_module_configuration(model)

        self._model = model
        self._loss_reduction = loss_reduction
        self._strategy = strategy
        self._checks_remaining = check_steps
        self._reduction_checked = False
        self._generic_chunk_size = generic_chunk_size
        self._params: dict[str, nn.Parameter] = {
            n: p for n, p in model.named_parameters() if p.requires_grad
        }
        self._name_of: dict[int, str] = {id(p): n for n, p in self._params.items()}
        self._device_types = sorted({p.device.type for p in self._params.values()} | {"cpu"})
        self._units: list[_Unit] = []
        self._discover(model, "", set(), None)
        for unit in self._units:
            _check_unit(unit, None)
        self._owners: dict[str, int] = dict.fromkeys(self._params, 0)
        for unit in self._units:
            for g in unit.local_to_global.values():
                self._owners[g] += 1

        self._recomputing = False
        self._direct_backward = False
        self._stale = False
        self._state_batch = 0
        self._input_records: set[int] = set()
        self._state: _StepState | None = None
        self._grad_seen: set[str] = set()
        self._autograd_grads: dict[str, torch.Tensor] = {}
        self._handles: list[Any] = []
        self._handles.append(
            model.register_forward_pre_hook(self._on_model_forward, with_kwargs=True)
        )
        self._cuda_devices = sorted(
            {p.device.index or 0 for p in self._params.values() if p.device.type == "cuda"}
        )
        for unit in self._units:
            if unit.sampler is None:
                self._handles.append(
                    unit.module.register_forward_pre_hook(
                        functools.partial(self._on_generic_call, unit)
                    )
                )
            self._handles.append(
                unit.module.register_forward_hook(
                    functools.partial(self._on_unit_forward, unit), with_kwargs=True
                )
            )
        for unit in self._units:
            if unit.sampler is not None and unit.sampler.check_fn is not None:
                self._handles.append(
                    unit.module.register_forward_pre_hook(
                        functools.partial(self._on_unit_pre_forward, unit), with_kwargs=True
                    )
                )
        for name, module in model.named_modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                self._handles.append(
                    module.register_forward_pre_hook(functools.partial(_refuse_batch_stats, name))
                )
        for name, p in self._params.items():
            self._handles.append(p.register_hook(functools.partial(self._on_param_grad, name)))

        generic = [u.label for u in self._units if u.sampler is None]
        if generic and strategy != "generic":
            logger.warning(
                "no grad sampler is registered for %d module(s); their per-example gradients "
                "use the generic torch.func path (slower, materialised): %s",
                len(generic),
                ", ".join(generic),
            )

    # ------------------------------------------------------------------ structure

    def _discover(
        self, module: nn.Module, prefix: str, seen: set[int], adopter: _Unit | None
    ) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        if not any(p.requires_grad for p in module.parameters()):
            return
        sampler = None if self._strategy == "generic" else get_grad_sampler(type(module))
        if sampler is not None and sampler.applies_fn is not None:
            sampler = sampler if sampler.applies_fn(module) else None
        trainable = {
            n: self._name_of[id(p)] for n, p in module.named_parameters() if p.requires_grad
        }
        direct = {
            n: trainable[n]
            for n, p in module.named_parameters(recurse=False)
            if p.requires_grad and n in trainable
        }
        name = prefix.rstrip(".")
        if sampler is not None or (direct and self._strategy == "generic"):
            self._units.append(
                _Unit(name, module, sampler, trainable, subtree=trainable, adopter=adopter)
            )
            return
        if direct:
            # A generic unit for this module's own parameters only: its children keep their
            # own (registered, fast) units. A child that this module does not call but whose
            # parameters it uses directly (nn.MultiheadAttention's out_proj) is differentiated
            # with this module instead, in every step in which the child is not called.
            adopter = _Unit(name, module, None, direct, subtree=trainable, adopter=adopter)
            self._units.append(adopter)
        for child_name, child in module.named_children():
            self._discover(child, f"{prefix}{child_name}.", seen, adopter)

    @property
    def model(self) -> nn.Module:
        """The model the engine is attached to."""
        return self._model

    @property
    def loss_reduction(self) -> LossReduction:
        """The declared reduction of the loss over the batch."""
        return self._loss_reduction

    @property
    def parameter_names(self) -> tuple[str, ...]:
        """Trainable parameter names, in ``model.named_parameters()`` order (tied: first name)."""
        return tuple(self._params)

    @property
    def generic_modules(self) -> tuple[str, ...]:
        """Names of the modules whose per-example gradients use the generic path."""
        return tuple(u.name for u in self._units if u.sampler is None)

    @property
    def has_gradients(self) -> bool:
        """True when a backward delivered gradients since the last forward or :meth:`clear`.

        That is, a step is waiting for its per-example quantities to be used (an empty batch
        counts: its output gradients have zero records).
        """
        if self._grad_seen:
            return True
        return any(c.has_grad for u in self._units for c in u.captures)

    @property
    def recomputing(self) -> bool:
        """True while the engine itself runs a module's forward (generic per-example path)."""
        return self._recomputing

    def remove(self) -> None:
        """Detach every hook from the model and drop what the engine stored."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.clear()

    def __enter__(self) -> PerExampleGradientEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def clear(self) -> None:
        """Drop the stored activations, gradients and results of the current step."""
        for unit in self._units:
            for c in unit.captures:
                c.release()
            unit.captures.clear()
        if self._state is not None:
            for _, c in self._state.ghost:
                c.release()
        self._state = None
        self._stale = False
        self._input_records = set()
        self._grad_seen.clear()
        self._autograd_grads.clear()

    # ------------------------------------------------------------------ hooks

    def _on_model_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._recomputing or not torch.is_grad_enabled():
            return
        self.clear()
        leaves, _ = tree_flatten((args, kwargs))
        self._input_records = {
            t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0
        }

    def _on_unit_pre_forward(
        self, unit: _Unit, module: nn.Module, args: tuple, kwargs: dict
    ) -> None:
        if self._recomputing or not torch.is_grad_enabled():
            return
        if kwargs:
            args = _bound_arguments(module, args, kwargs)
        _check_unit(unit, args)

    def _on_generic_call(self, unit: _Unit, module: nn.Module, args: tuple) -> None:
        if self._recomputing or not torch.is_grad_enabled():
            return
        unit.rng_state = (
            torch.get_rng_state(),
            {d: torch.cuda.get_rng_state(d) for d in self._cuda_devices},
        )

    def _broadcast_batch(self, inputs: Any, outputs: list, indices: list[int]) -> int | None:
        """B when a unit's output is one row that the model broadcasts over its B records.

        That is: the model's inputs have B > 1 records (and maybe also inputs of one row, such
        as position ids of shape (1, T)), none of the unit's inputs has B rows, and every
        output that needs a gradient has one row (HF's position embeddings of shape (1, T, d)).
        """
        batch = self._input_records - {1}
        if len(batch) != 1:
            return None
        (b,) = batch
        if any(outputs[i].dim() == 0 or outputs[i].shape[0] != 1 for i in indices):
            return None
        leaves, _ = tree_flatten(inputs)
        if any(isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] != 1 for t in leaves):
            return None
        return b

    def _on_unit_forward(
        self, unit: _Unit, module: nn.Module, args: tuple, kwargs: dict, output: Any
    ) -> Any:
        if self._recomputing or not torch.is_grad_enabled():
            return None
        leaves, spec = tree_flatten(output)
        indices = [
            i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if not indices:
            return None
        record_dims = None
        replaced = None
        broadcast = self._broadcast_batch((args, kwargs), leaves, indices)
        if broadcast is not None:
            # The output is shared by every record through broadcasting, and record i's
            # gradient of this unit is the gradient with respect to its own copy: hand the
            # model a view expanded to the B records (the same values wherever it broadcasts)
            # so that the gradient arrives per record; the inputs of one row are expanded
            # alike for the unit's grad sampler.
            leaves = list(leaves)
            for i in indices:
                leaves[i] = leaves[i].expand(broadcast, *leaves[i].shape[1:])
            replaced = tree_unflatten(leaves, spec)
            output = replaced
            if unit.sampler is not None:
                args, kwargs = tree_map_only(
                    torch.Tensor,
                    lambda t: t.expand(broadcast, *t.shape[1:]) if t.dim() > 0 else t,
                    (args, kwargs),
                )
        if unit.sampler is not None:
            if unit.sampler.output_record_dims is not None:
                dims = unit.sampler.output_record_dims(module, args)
                record_dims = [dims[i] for i in indices]
            elif not isinstance(output, torch.Tensor):
                raise UnsupportedModuleError(
                    f"the grad sampler of {unit.label} needs a single tensor output, got "
                    f"{type(output).__name__}; register the type with output_record_dims, or "
                    "unregister it to use the generic path"
                )
            if kwargs:
                args, kwargs = _bound_arguments(module, args, kwargs), {}
        capture = _Capture(args, kwargs, indices, record_dims, unit.rng_state)
        unit.rng_state = None
        for k, i in enumerate(indices):
            t = leaves[i]
            if t.grad_fn is None:  # the output is a leaf tensor (e.g. a parameter returned)
                t.register_hook(functools.partial(self._on_output_grad, capture, k))
            else:
                t.grad_fn.register_prehook(
                    functools.partial(self._on_node_grads, capture, k, t.output_nr)
                )
            capture.edges.append(get_gradient_edge(t))
        unit.captures.append(capture)
        self._mark_changed()
        return replaced

    def _mark_changed(self) -> None:
        if self._state is not None:
            self._stale = True

    def _on_node_grads(self, capture: _Capture, k: int, output_nr: int, grads: tuple) -> None:
        self._on_output_grad(capture, k, grads[output_nr])

    def _on_output_grad(self, capture: _Capture, k: int, grad: torch.Tensor | None) -> None:
        if grad is not None and not self._direct_backward:
            capture.store(k, grad)
            self._mark_changed()

    def _on_param_grad(self, name: str, grad: torch.Tensor) -> None:
        self._grad_seen.add(name)
        if self._checks_remaining > 0:
            prev = self._autograd_grads.get(name)
            self._autograd_grads[name] = grad if prev is None else prev + grad
        self._mark_changed()

    # ------------------------------------------------------------------ backward

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` to the units' outputs only (a cheaper ``loss.backward()``).

        Parameters' ``.grad`` is left untouched (call :meth:`write_clipped_sum`). On the first
        ``check_steps`` steps the ordinary ``loss.backward()`` runs instead, so that the
        consistency check has autograd's batch gradient.
        """
        if not isinstance(loss, torch.Tensor):
            raise InvalidParameterError("loss", type(loss).__name__, "a scalar torch.Tensor")
        found = None if self._reduction_checked else _loss_reduction_of(loss)
        self._reduction_checked = True
        if self._checks_remaining > 0:
            loss.backward()
        else:
            self._backward_to_outputs(loss)
        if found is not None:
            self._check_reduction(*found)

    def _check_reduction(self, node: str, reduction: str, elements: int) -> None:
        """Warn when a built-in loss's reduction contradicts ``loss_reduction`` (first step).

        Sound: the loss *is* that node's output, so its reduction is a fact, and mean and sum
        differ exactly when the batch has more than one record and the loss more than one term.
        """
        if reduction == self._loss_reduction or elements < 2:
            return
        try:
            batch = self._batch_size()
        except EngineStateError:  # reported by the step that needs the batch
            return
        if batch < 2:
            return
        warnings.warn(
            LossReductionWarning(
                f"the loss was computed with reduction={reduction!r} ({node}, over {elements} "
                f"terms, a batch of {batch} records) but loss_reduction="
                f"{self._loss_reduction!r} was declared: every per-example gradient is scaled by "
                f"{'B' if reduction == 'sum' else '1/B'} = "
                f"{batch if reduction == 'sum' else f'1/{batch}'} before clipping, so clipping "
                f"acts at another effective norm (privacy still holds); declare "
                f"loss_reduction={reduction!r} or compute the loss with "
                f"reduction={self._loss_reduction!r}",
                declared=self._loss_reduction,
                found=reduction,
                loss_function=node,
            ),
            stacklevel=3,
        )

    def _backward_to_outputs(self, loss: torch.Tensor) -> None:
        """The gradients of ``loss`` with respect to the units' outputs only (no ``.grad``)."""
        pending = [
            (c, k)
            for u in self._units
            for c in u.captures
            for k in range(len(c.edges))
            if c.grads[k] is None
        ]
        if not pending:
            raise EngineStateError(
                "nothing to backpropagate to: run the model's forward with gradients enabled "
                "before engine.backward(loss)"
            )
        # The node pre-hooks of units whose outputs lie between the loss and other units' outputs
        # fire during this call as well; the gradients are taken from its return value instead.
        self._direct_backward = True
        try:
            grads = torch.autograd.grad(loss, [c.edges[k] for c, k in pending], allow_unused=True)
        finally:
            self._direct_backward = False
        for (c, k), g in zip(pending, grads, strict=True):
            self._on_output_grad(c, k, g)

    # ------------------------------------------------------------------ step results

    def _batch_size(self) -> int:
        batch = None
        for unit in self._units:
            for c in unit.captures:
                for g in c.grads:
                    if g is None:
                        continue
                    b = g.shape[0] if g.dim() > 0 else -1
                    if batch is None:
                        batch = b
                    elif b != batch:
                        raise EngineStateError(
                            f"{unit.label} has an output gradient with {b} records along "
                            f"dimension 0 where other modules have {batch}; the engine needs "
                            "the records along dimension 0 of every module's input and output"
                        )
        if batch is None:
            if any(u.captures for u in self._units):
                raise EngineStateError(
                    "no gradient reached the model's parameters yet: call loss.backward() (or "
                    "engine.backward(loss)) after the forward"
                )
            raise EngineStateError(
                "no forward of the model with gradients enabled since the last step"
            )
        if batch < 0:
            raise EngineStateError("a module output is a scalar: records must be along dim 0")
        if self._input_records and batch not in self._input_records:
            # Every unit sees the same leading size, but no input of the model has it (e.g.
            # a (B, T, d) input transposed to (T, B, d)): its positions would be clipped as
            # records, and one record would contribute several clipped gradients.
            raise EngineStateError(
                f"the modules' inputs and outputs have {batch} entries along dimension 0 but "
                f"the model's inputs have {sorted(self._input_records)}; the engine needs the "
                "records along dimension 0 of every module's input and output"
            )
        return batch

    def _adoptions(self) -> dict[int, dict[str, str]]:
        """The parameters each generic unit differentiates for units not called in this step.

        A unit that was not called in the step but lies inside a generic unit that was has its
        parameters used (if at all) directly by an enclosing module: the nearest enclosing
        generic unit that was called differentiates them with its own. Returns, per adopting
        unit (by id), its local names of those parameters mapped to their global names.
        """
        called = {id(u) for u in self._units if any(c.has_grad for c in u.captures)}
        out: dict[int, dict[str, str]] = {}
        for unit in self._units:
            if id(unit) in called:
                continue
            adopter = unit.adopter
            while adopter is not None and id(adopter) not in called:
                adopter = adopter.adopter
            if adopter is None:
                continue
            local_of = {g: n for n, g in adopter.subtree.items()}
            out.setdefault(id(adopter), {}).update(
                {local_of[g]: g for g in unit.local_to_global.values()}
            )
        return out

    def _tied_pairs(self) -> list[tuple[_Unit, _Unit, list[tuple[str, str, str]]]]:
        """Pairs of units sharing parameters that keep the fast path through a cross term.

        Both units were called once in this step with a fast path, every parameter either
        shares it shares with the other one only, and a cross term is registered for their
        types (:func:`~dpledger.adapters.torch.registry.register_cross_term`). Returns each pair
        with its shared parameters as (local name in the first, in the second, global name).
        """
        if self._strategy in ("per_example", "generic"):
            return []
        owners: dict[str, list[_Unit]] = {}
        for unit in self._units:
            for g in unit.local_to_global.values():
                if self._owners[g] > 1:
                    owners.setdefault(g, []).append(unit)
        pairs: dict[tuple[int, int], tuple[_Unit, _Unit, list[tuple[str, str, str]]]] = {}
        refused: set[tuple[int, int]] = set()
        for g, units in owners.items():
            if len(units) != 2:
                for u in units:
                    refused.update((id(u), id(v)) for v in units)
                continue
            a, b = units
            key = (id(a), id(b))
            local_a = {v: n for n, v in a.local_to_global.items()}[g]
            local_b = {v: n for n, v in b.local_to_global.items()}[g]
            pairs.setdefault(key, (a, b, []))[2].append((local_a, local_b, g))
        out = []
        partner: dict[int, int] = {}
        for key, (a, b, shared) in pairs.items():
            if key in refused or id(a) in partner or id(b) in partner:
                continue
            if not all(self._can_tie(u) for u in (a, b)):
                continue
            if get_cross_term(type(a.module), type(b.module)) is None:
                continue
            partner[id(a)], partner[id(b)] = id(b), id(a)
            out.append((a, b, shared))
        # A unit sharing parameters with a third unit as well is not tied at all.
        return [
            (a, b, shared)
            for a, b, shared in out
            if all(
                {id(o) for o in owners[g]} <= {id(a), id(b)}
                for u in (a, b)
                for g in u.local_to_global.values()
                if g in owners
            )
        ]

    def _can_tie(self, unit: _Unit) -> bool:
        captures = [c for c in unit.captures if c.has_grad]
        sampler = unit.sampler
        return (
            len(captures) == 1
            and sampler is not None
            and sampler.has_fast_path
            and _takes(sampler, captures[0])
            and captures[0].record_dims is None
        )

    def _unit_per_example(
        self, unit: _Unit, capture: _Capture, names: Mapping[str, str] | None = None
    ) -> dict[str, torch.Tensor]:
        """Per-example gradients of ``names`` (local -> global; default the unit's own)."""
        names = unit.local_to_global if names is None else names
        sampler = unit.sampler
        if sampler is not None and sampler.per_example_fn is not None and _takes(sampler, capture):
            out = sampler.per_example_fn(unit.module, *_aligned(capture))
        else:
            self._recomputing = True
            try:
                out = module_per_example_gradients(
                    unit.module,
                    capture.args,
                    capture.kwargs,
                    capture.output_grads(),
                    batch_size=self._state_batch,
                    chunk_size=self._generic_chunk_size,
                    names=tuple(names),
                    rng_state=capture.rng_state,
                )
            except DPLedgerError:
                raise
            except Exception as exc:
                raise UnsupportedModuleError(
                    f"the per-example gradients of module '{unit.name}' "
                    f"({type(unit.module).__name__}) could not be computed on the generic path, "
                    f"which runs its forward on one record at a time (torch.func.vmap): "
                    f"{type(exc).__name__}: {exc}. A forward that needs the other records of "
                    "the batch (batch statistics such as F.batch_norm(..., training=True), "
                    "attention or pooling over dimension 0) mixes records and cannot be "
                    "trained with per-example clipping; compute its statistics per record"
                ) from exc
            finally:
                self._recomputing = False
        return self._checked(unit, out, "per-example gradient", names)

    def _checked(
        self,
        unit: _Unit,
        out: Mapping[str, torch.Tensor],
        what: str,
        names: Mapping[str, str] | None = None,
    ) -> dict:
        names = unit.local_to_global if names is None else names
        missing = [n for n in names if n not in out]
        if missing:
            raise UnsupportedModuleError(
                f"the grad sampler of {unit.label} returned no {what} for {missing}"
            )
        return {n: out[n] for n in names}

    def _use_fast_path(self, unit: _Unit, capture: _Capture) -> bool:
        sampler = unit.sampler
        if sampler is None or not sampler.has_fast_path or not _takes(sampler, capture):
            return False
        if self._strategy == "per_example" and sampler.per_example_fn is not None:
            return False
        if self._strategy == "ghost" or sampler.per_example_fn is None:
            return True
        if sampler.prefer_per_example is None:
            return True
        return not sampler.prefer_per_example(unit.module, *_aligned(capture))

    def _exact(self) -> contextlib.ExitStack:
        """No autograd recording and no autocast for the engine's own computations."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad())
        for device_type in self._device_types:
            stack.enter_context(torch.autocast(device_type, enabled=False))
        return stack

    def _finalize(self) -> _StepState:
        with self._exact():
            return self._finalize_step()

    def _finalize_step(self) -> _StepState:
        if self._stale:
            raise EngineStateError(
                "the model ran forward or backward again after this step's per-example "
                "quantities were computed; start the next step with a forward of the model "
                "(or call engine.clear())"
            )
        if self._state is not None:
            return self._state
        batch = self._batch_size()
        self._state_batch = batch
        scale = float(batch) if (self._loss_reduction == "mean" and batch > 0) else 1.0
        grad_eps = max(
            (
                torch.finfo(g.dtype).eps
                for u in self._units
                for c in u.captures
                for g in c.grads
                if g is not None and g.is_floating_point()
            ),
            default=0.0,
        )
        norms: dict[str, torch.Tensor] = {}
        ghost: list[tuple[_Unit, _Capture]] = []
        per_example: dict[str, torch.Tensor] = {}

        adopted = self._adoptions()
        tied = self._tied_pairs()
        tied_units = {id(u) for pair in tied for u in pair[:2]}
        tied_parts: dict[str, list[torch.Tensor]] = {}
        used: set[str] = set()
        for unit in self._units:
            captures = [c for c in unit.captures if c.has_grad]
            if not captures:
                continue
            names = {**unit.local_to_global, **adopted.get(id(unit), {})}
            used.update(names.values())
            shared = any(self._owners[g] > 1 for g in unit.local_to_global.values())
            if id(unit) in tied_units or (
                len(captures) == 1 and not shared and self._use_fast_path(unit, captures[0])
            ):
                c = captures[0]
                assert unit.sampler is not None and unit.sampler.norm_fn is not None
                local = self._checked(unit, unit.sampler.norm_fn(unit.module, *_aligned(c)), "norm")
                for n, v in local.items():
                    g = unit.local_to_global[n]
                    if self._owners[g] > 1:
                        tied_parts.setdefault(g, []).append(v)
                    else:
                        norms[g] = v
                ghost.append((unit, c))
                continue
            for c in captures:
                for n, g in self._unit_per_example(unit, c, names).items():
                    key = names[n]
                    per_example[key] = g if key not in per_example else per_example[key] + g
            for c in captures:  # the materialised gradients replace the stored tensors
                c.release()
            unit.captures.clear()

        unseen = sorted(self._grad_seen - used)
        if unseen:
            raise UnsupportedParameterUseError(
                f"parameter(s) {self._owned(unseen)} received gradient in the backward but were "
                "not used in "
                "the forward of a module the engine observed (e.g. a child's weight used "
                "directly by its parent's forward, or a model that is not the one the engine "
                "was attached to). Use the parameter only through its module's forward, or "
                "register a grad sampler for the parent module type."
            )
        for a, b, shared_names in tied:
            ca, cb = a.captures[0], b.captures[0]
            cross_term = get_cross_term(type(a.module), type(b.module))
            assert cross_term is not None
            for local_a, local_b, g in shared_names:
                cross = cross_term(
                    a.module, *_aligned(ca), local_a, b.module, *_aligned(cb), local_b
                )
                parts = [v.to(torch.float64) for v in tied_parts.pop(g)]
                own = parts[0] + parts[1]
                # ‖g_a + g_b‖² = ‖g_a‖² + ‖g_b‖² + 2⟨g_a, g_b⟩. Rounding in the two norms is
                # relative to them, not to the (possibly much smaller) total: add the margin
                # of their dtype, relative to them, so that the total is never understated.
                margin = rounding_clip_margin(torch.finfo(_tied_dtype(ca, cb)).eps)
                norms[g] = (own + 2.0 * cross.to(own.device) + margin * own).clamp_min(0.0)
        norms.update(squared_norms_of(per_example))
        for n, p in self._params.items():
            if n not in norms:
                norms[n] = p.new_zeros(batch)
        if scale != 1.0:
            norms = {n: v * (scale * scale) for n, v in norms.items()}
        self._state = _StepState(
            batch_size=batch,
            scale=scale,
            norms={n: norms[n] for n in self._params},
            ghost=ghost,
            per_example=per_example,
            grad_eps=grad_eps,
        )
        if self._checks_remaining > 0 and batch > 0 and self._grad_seen:
            self._consistency_check(self._state)
            self._checks_remaining -= 1
        return self._state

    def _consistency_check(self, state: _StepState) -> None:
        """Raise unless Σ_i g_i equals autograd's batch gradient (times B for a mean loss)."""
        ones = torch.ones(state.batch_size)  # moved to each layer's device and dtype
        with torch.no_grad():
            ours = self._clipped_sum(state, dict.fromkeys(self._params, ones))
            # Rounding in a sum of B terms is relative to the terms (Σ_i ‖g_i‖), not to the
            # result; a parameter whose true gradient vanishes (a key bias under softmax) keeps
            # only rounding noise, so an absolute floor relative to the whole gradient is added.
            device = next(iter(state.norms.values())).device
            total = torch.zeros(state.batch_size, device=device)
            for v in state.norms.values():
                total += v.float().to(device)
            whole = float(total.clamp_min(0).sqrt().sum())
            bad = []
            for n, p in self._params.items():
                ref = self._autograd_grads.get(n)
                ref = torch.zeros_like(p) if ref is None else ref * state.scale
                o = ours[n].to(dtype=ref.dtype)
                rtol = max(1e-3, 10 * torch.finfo(ref.dtype).eps, 10 * state.grad_eps)
                size = float(state.norms[n].clamp_min(0).sqrt().sum()) + float(ref.norm())
                tol = rtol * size + 1e-4 * rtol * whole + 1e-30
                diff = float((o - ref).norm())
                if diff > tol:
                    bad.append(
                        f"{self._owned([n])[0]} (|difference|={diff:.3g}, "
                        f"|autograd|={float(ref.norm()):.3g})"
                    )
        if bad:
            raise UnsupportedParameterUseError(
                "the sum of per-example gradients differs from autograd's batch gradient for "
                f"{', '.join(bad)}. These parameters receive gradient from computations outside "
                "the forward of the module that owns them (a tied weight used directly by a "
                "parent module, a regulariser added to the loss, or a loss that is not a sum or "
                "mean of per-example terms). Use each parameter only through its module's "
                "forward and put weight decay in the optimizer."
            )

    def _owned(self, names: list[str]) -> list[str]:
        """Each parameter name with the module that owns it, for error messages."""
        out = []
        for n in names:
            owner_name, _, _ = n.rpartition(".")
            try:
                owner = self._model.get_submodule(owner_name)
            except AttributeError:
                out.append(n)
                continue
            out.append(f"{n} of module '{owner_name}' ({type(owner).__name__})")
        return out

    @property
    def batch_size(self) -> int:
        """B, the number of records in the current step (after the backward)."""
        return self._finalize().batch_size

    def squared_norms(self) -> dict[str, torch.Tensor]:
        """‖g_i‖² of every trainable parameter: ``{name: tensor of shape (B,)}``.

        g_i is the gradient of example i's own loss ℓ_i (the 1/B of a mean loss undone). Tied
        parameters get the norm of the sum of their per-use gradients. Parameters the step did
        not use get zeros.

        Raises:
            EngineStateError: no forward with gradients, or no backward after it.
            UnsupportedParameterUseError: see the class docstring.
        """
        return dict(self._finalize().norms)

    def _clipped_sum(
        self, state: _StepState, factors: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for unit, c in state.ghost:
            args, g = _aligned(c)
            ref = g if isinstance(g, torch.Tensor) else next(t for t in g if t is not None)
            assert unit.sampler is not None and unit.sampler.clipped_sum_fn is not None
            local = {
                n: factors[gname].to(device=ref.device, dtype=ref.dtype) * state.scale
                for n, gname in unit.local_to_global.items()
            }
            res = self._checked(
                unit, unit.sampler.clipped_sum_fn(unit.module, args, g, local), "clipped sum"
            )
            for n, v in res.items():
                g = unit.local_to_global[n]
                out[g] = out[g] + v if g in out else v  # tied: the sum over both layers
        if state.per_example:
            scaled = {
                n: factors[n].to(device=g.device, dtype=g.dtype) * state.scale
                for n, g in state.per_example.items()
            }
            out.update(clipped_sum_of(state.per_example, scaled))
        return {n: out[n] if n in out else torch.zeros_like(p) for n, p in self._params.items()}

    def clipped_sum(
        self, factors: torch.Tensor | Mapping[str | tuple[str, ...], torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Σ_i f_i g_i for every trainable parameter, ``{name: tensor of the parameter's shape}``.

        Args:
            factors: one tensor of shape (B,) for all parameters, or a mapping from parameter
                names, or tuples of names for a group sharing one factor, to (B,) tensors that
                covers every name of :attr:`parameter_names` once (see
                :func:`~dpledger.adapters.torch.factors.expand_factors`).
        """
        state = self._finalize()
        expanded = expand_factors(factors, names=self.parameter_names, batch_size=state.batch_size)
        with self._exact():
            return self._clipped_sum(state, expanded)

    def write_clipped_sum(
        self, factors: torch.Tensor | Mapping[str | tuple[str, ...], torch.Tensor]
    ) -> None:
        """Set every trainable parameter's ``.grad`` to Σ_i f_i g_i (replacing its content)."""
        for n, s in self.clipped_sum(factors).items():
            p = self._params[n]
            p.grad = s.to(dtype=p.dtype)

    def per_example_gradients(self) -> dict[str, torch.Tensor]:
        """The per-example gradients g_i, ``{name: (B, *shape)}`` (materialises every layer)."""
        state = self._finalize()
        out: dict[str, torch.Tensor] = {}
        with self._exact():
            for unit, c in state.ghost:
                for n, g in self._unit_per_example(unit, c).items():
                    key = unit.local_to_global[n]
                    out[key] = out[key] + g if key in out else g  # tied: both layers' sum
        out.update(state.per_example)
        result = {}
        for n, p in self._params.items():
            g = out.get(n)
            if g is None:
                g = p.new_zeros((state.batch_size, *p.shape))
            result[n] = g * state.scale if state.scale != 1.0 else g
        return result


def _tied_dtype(*captures: _Capture) -> torch.dtype:
    """The computation dtype of the per-example norms of these captures (at least float32)."""
    dtype = torch.float32
    for c in captures:
        for g in c.grads:
            if g is not None and g.is_floating_point():
                dtype = torch.promote_types(dtype, g.dtype)
    return dtype


def _takes(sampler: GradSampler, capture: _Capture) -> bool:
    """Whether the sampler can take the capture's output gradients (else: generic path)."""
    if capture.record_dims is not None:
        return capture.has_grad
    return len(capture.grads) == 1 and capture.grads[0] is not None


def _bound_arguments(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """A call's arguments as one positional tuple in ``forward``'s order, defaults filled in.

    Keyword arguments are placed where their parameter stands and every parameter not given
    takes its default, so that a grad sampler reads an argument at the same position whichever
    way the model passed it (``mha(x, x, x, attn_mask=m)`` would otherwise put the mask where
    ``key_padding_mask`` stands).
    """
    bound = inspect.signature(module.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    return tuple(bound.arguments.values())


def _check_unit(unit: _Unit, args: tuple | None) -> None:
    """Run the sampler's check_fn (configuration, or the inputs of a forward); name the unit."""
    if unit.sampler is None or unit.sampler.check_fn is None:
        return
    try:
        unit.sampler.check_fn(unit.module, args)
    except UnsupportedModuleError as exc:
        raise UnsupportedModuleError(f"module {unit.label}: {exc}") from exc


def _aligned(capture: _Capture) -> tuple[tuple, Any]:
    """A registered unit's activations and output gradient in one floating dtype, ≥ float32.

    Under autocast a layer's input and its output gradient can differ in precision (float32 in,
    bfloat16 out), and sums of many squares lose most of their digits in 16-bit arithmetic, so
    both are promoted to the wider of their types and float32 for the per-example computations.
    For a sampler with ``output_record_dims`` the gradient is a tuple, one entry per output
    (None where it received none), all in the widest of their types.
    """
    several = capture.record_dims is not None
    grads = capture.grads if several else capture.grads[:1]
    assert any(g is not None for g in grads)
    args = capture.args
    x = args[0] if args else None
    dtype = torch.float32
    for g in grads:
        if g is not None:
            dtype = torch.promote_types(dtype, g.dtype)
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        dtype = torch.promote_types(dtype, x.dtype)
        if x.dtype != dtype:
            args = (x.to(dtype), *args[1:])
    out = tuple(None if g is None else g.to(dtype) for g in grads)
    return args, (out if several else out[0])


def _refuse_batch_stats(name: str, module: nn.Module, args: tuple) -> None:
    if uses_batch_statistics(module):
        raise RecordMixingModuleError(batch_norm_refusal_message(module, name or None))
