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

How: the model is split into *units*. A module whose exact type has a registered layer rule
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
its reduction (``cross_entropy``, ``nll_loss``, ``mse_loss``, …): on the first step, whether the
loss was handed to :meth:`PerExampleGradientEngine.backward` or differentiated by a plain
``loss.backward()``, the engine reads that reduction and warns
(:class:`~dpledger.errors.LossReductionWarning`) when it contradicts the
declaration (:mod:`~dpledger.adapters.torch.loss_reduction` says how, and when it claims
nothing). Any other loss (a ``.sum()``, a ``.mean()``, a rescaled loss) is not judged.

``engine.backward(loss)`` can replace ``loss.backward()``: it asks autograd only for the
gradients with respect to the units' outputs (``torch.autograd.grad`` on their gradient edges),
which skips computing the batch gradient of every weight that the clipped sum replaces anyway.
On checking steps it runs the ordinary backward.

BatchNorm with batch statistics is refused at construction and at every forward
(:class:`~dpledger.errors.RecordMixingLayerError`); frozen BatchNorm (evaluation
mode, running statistics) is a per-example affine map and is supported, trainable or not.

A *step* is one forward of the model with gradients enabled and the backward after it: each such
forward of the model (the module the engine was attached to) drops what was stored for the
previous step. Forwards under ``torch.no_grad()`` store nothing and keep the step. Records are
along dimension 0 of the model's inputs and of every unit's inputs and outputs, except where a
unit's layer rule declares the record dimension of each output (``output_record_dims``, e.g.
recurrent layers with ``batch_first=False``): the engine then stores those output gradients with
their records moved to dimension 0, and the sampler reads its inputs in their own layout.

The engine is split along what it does (it inherits each part):
:mod:`~dpledger.adapters.torch.engine_state` (a unit, a forward call's capture, the step's
results), :mod:`~dpledger.adapters.torch.capture_hooks` (the forward and backward hooks),
:mod:`~dpledger.adapters.torch.step_finalisation` (the batch, each unit's norms or per-example
gradients, the tied norms, the consistency check, the clipped sum) and
:mod:`~dpledger.adapters.torch.loss_reduction` (the first step's check of the loss's
reduction). This module holds the construction, the discovery of the units, the backward to the
units' outputs and the public results.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import nn

from dpledger.adapters.torch import layer_rules as _builtin_layer_rules  # noqa: F401  (registers)
from dpledger.adapters.torch.capture_hooks import CaptureHooks
from dpledger.adapters.torch.engine_state import (
    _check_unit,
    _outside_use_error,
    _StepState,
    _Unit,
)
from dpledger.adapters.torch.factors import expand_factors
from dpledger.adapters.torch.loss_reduction import LossReductionCheck, _loss_reduction_of
from dpledger.adapters.torch.module_checks import check_module_configuration
from dpledger.adapters.torch.registry import layer_rule
from dpledger.adapters.torch.step_finalisation import StepFinalisation
from dpledger.errors import EngineStateError, InvalidParameterError

__all__ = ["LossReduction", "PerExampleGradientEngine", "Strategy"]

logger = logging.getLogger(__name__)

LossReduction = Literal["mean", "sum"]
Strategy = Literal["auto", "ghost", "per_example", "generic"]
_STRATEGIES = ("auto", "ghost", "per_example", "generic")


class PerExampleGradientEngine(CaptureHooks, StepFinalisation, LossReductionCheck):
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
        RecordMixingLayerError: BatchNorm that uses batch statistics.
        UnsupportedLayerError: a module option that mixes records (``scale_grad_by_freq``), or
            a configuration a layer rule refuses (its ``check_fn``: e.g. an LSTM with
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
        _check_arguments(model, loss_reduction, strategy, check_steps, generic_chunk_size)
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
        self._open_generic: list[tuple[_Unit, list[torch.Tensor]]] = []
        self._cuda_devices = sorted(
            {p.device.index or 0 for p in self._params.values() if p.device.type == "cuda"}
        )
        self._install_hooks()

        generic = [u.label for u in self._units if u.sampler is None]
        if generic and strategy != "generic":
            logger.warning(
                "no layer rule is registered for %d module(s); their per-example gradients "
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
        sampler = None if self._strategy == "generic" else layer_rule(type(module))
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
        if self._checks_remaining > 0 or self._compiled_step:  # compiled: no autograd edges
            loss.backward()
        else:
            self._backward_to_outputs(loss)
        if found is not None:
            self._check_reduction(*found)

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
            reached = self._parameters_reached(loss)
            if reached:  # the loss uses parameters whose module's forward was never called
                raise _outside_use_error(self._model, self._units, reached)
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

    def _parameters_reached(self, loss: torch.Tensor) -> list[str]:
        """The trainable parameters (names) that ``loss``'s autograd graph accumulates into."""
        names = {id(p): n for n, p in self._params.items()}
        found, seen, stack = set(), set(), [loss.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            variable = getattr(node, "variable", None)  # an AccumulateGrad node's parameter
            if variable is not None and id(variable) in names:
                found.add(names[id(variable)])
            stack.extend(next_node for next_node, _ in node.next_functions)
        return [n for n in self._params if n in found]

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


def _check_arguments(
    model: Any, loss_reduction: Any, strategy: Any, check_steps: Any, generic_chunk_size: Any
) -> None:
    """Refuse a bad argument of :class:`PerExampleGradientEngine` (InvalidParameterError)."""
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
