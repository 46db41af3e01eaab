"""The engine's hooks: what it observes of a step's forward and backward.

:class:`CaptureHooks` is the part of
:class:`~dpledger.adapters.torch.engine.PerExampleGradientEngine` that the model's forward and
backward call into. A forward of the model (with gradients enabled) starts a step; each unit's
forward call stores a capture of its inputs and hooks the autograd node of each of its outputs
(a forward of a generic unit also keeps the random-number state it started from, and the masks
of the ``nn.Dropout`` calls inside it: :mod:`~dpledger.adapters.torch.dropout_replay`); in the
backward those hooks store the gradients with respect to the outputs, and the parameters' hooks
note which parameters received gradient (and, on checking steps, autograd's batch gradient).
The first hook of the first step also checks the loss's reduction
(:mod:`~dpledger.adapters.torch.loss_reduction`). BatchNorm that uses batch statistics is refused
at every forward.

An output shared by every record through broadcasting (one row, e.g. position embeddings of
shape (1, T, d)) is handed to the model expanded to the B records, so that its gradient arrives
per record.

Under ``torch.compile`` the same hooks put the opaque operators of
:mod:`~dpledger.adapters.torch.compiled_capture` into the graph instead, whose bodies call
this class's ``_on_compiled_*`` methods at run time, outside the compiled region.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from dpledger.adapters.torch.compiled_capture import (
    CompiledCapture,
    guard_module_hooks,
    is_compiling,
)
from dpledger.adapters.torch.dropout_replay import DropoutMasks
from dpledger.adapters.torch.engine_state import (
    _bound_arguments,
    _Capture,
    _check_unit,
    _refuse_batch_stats,
    _Unit,
)
from dpledger.errors import UnsupportedLayerError

__all__: list[str] = []  # internal to the engine


class _OutputGradHook:
    """The hook on a unit output's autograd node (or on the output, if it is a leaf): hands the
    gradient with respect to output k to the engine's capture.

    It refers to the engine and the capture weakly. The capture keeps the node (its gradient
    edge) and the engine keeps the capture, so strong references back would form a cycle
    through the C++ node, which Python's garbage collector cannot see through: a step that
    never finished (an exception, e.g. out of memory, between the forward and ``step()``)
    would keep the engine, the model, the optimizer and the step's activations alive after
    the user dropped them. Once the engine is gone the hook does nothing.
    """

    __slots__ = ("_capture", "_engine", "_k", "_output_nr")

    def __init__(
        self, engine: CaptureHooks, capture: _Capture, k: int, output_nr: int | None
    ) -> None:
        self._engine = weakref.ref(engine)
        self._capture = weakref.ref(capture)
        self._k = k
        self._output_nr = output_nr

    def __call__(self, grads: Any) -> None:
        engine, capture = self._engine(), self._capture()
        if engine is None or capture is None:
            return
        grad = grads if self._output_nr is None else grads[self._output_nr]
        engine._on_hooked_grad(capture, self._k, grad)


class _ParamGradHook:
    """The hook on a trainable parameter: notes that it received gradient.

    Weak for the same reason as :class:`_OutputGradHook`: a parameter's Python object is kept
    alive by the C++ autograd graph of a step that never finished, which the engine's captures
    keep in turn.
    """

    __slots__ = ("_engine", "_name")

    def __init__(self, engine: CaptureHooks, name: str) -> None:
        self._engine = weakref.ref(engine)
        self._name = name

    def __call__(self, grad: torch.Tensor) -> None:
        engine = self._engine()
        if engine is not None:
            engine._on_param_grad(self._name, grad)


class CaptureHooks:
    """The forward and backward hooks of the engine (a base class of
    :class:`~dpledger.adapters.torch.engine.PerExampleGradientEngine`; see the module
    docstring)."""

    def _install_hooks(self) -> None:
        """Hook the model, every unit, every BatchNorm and every trainable parameter."""
        self._compiled_step = False
        # called with a compiled forward's tensor inputs and their names, at run time
        self._compiled_forward_callbacks: list[Callable[[list, list], None]] = []
        self._compiled = CompiledCapture(self, [u.name for u in self._units if u.sampler])
        self._unit_of = {u.name: u for u in self._units}
        weakref.finalize(self, self._compiled.release)
        guard_module_hooks()
        self._handles.append(
            self._model.register_forward_pre_hook(self._on_model_forward, with_kwargs=True)
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
        for name, module in self._model.named_modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                self._handles.append(
                    module.register_forward_pre_hook(functools.partial(_refuse_batch_stats, name))
                )
        for name, p in self._params.items():
            self._handles.append(p.register_hook(_ParamGradHook(self, name)))
        if any(unit.sampler is None for unit in self._units):
            self._handles.extend(DropoutMasks(self).install(self._model))

    def _on_model_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if self._recomputing or not torch.is_grad_enabled():
            return None
        if is_compiling():
            return self._compiled.model_forward(args, kwargs)
        self._compiled_step = False
        self.clear()
        self._open_generic = []
        leaves, _ = tree_flatten((args, kwargs))
        self._input_records = {
            t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0
        }
        return None

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
        if is_compiling():
            raise _no_rule_under_compile(unit)
        unit.rng_state = (
            torch.get_rng_state(),
            {d: torch.cuda.get_rng_state(d) for d in self._cuda_devices},
        )
        self._open_generic.append((unit, []))

    def _close_generic(self, unit: _Unit) -> list[torch.Tensor] | None:
        """The dropout masks kept during ``unit``'s call that now ends (None: none kept)."""
        for k in range(len(self._open_generic) - 1, -1, -1):
            if self._open_generic[k][0] is unit:
                masks = self._open_generic.pop(k)[1]
                return masks or None
        return None

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
        if is_compiling():
            if unit.sampler is None:
                raise _no_rule_under_compile(unit)
            return self._compiled.unit_forward(unit.name, unit.label, args, kwargs, output)
        masks = self._close_generic(unit) if unit.sampler is None else None
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
            # alike for the unit's layer rule.
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
                raise UnsupportedLayerError(
                    f"the layer rule of {unit.label} needs a single tensor output, got "
                    f"{type(output).__name__}; register the type with output_record_dims, or "
                    "unregister it to use the generic path"
                )
            if kwargs:
                args, kwargs = _bound_arguments(module, args, kwargs), {}
        capture = _Capture(args, kwargs, indices, record_dims, unit.rng_state, masks)
        unit.rng_state = None
        for k, i in enumerate(indices):
            t = leaves[i]
            if t.grad_fn is None:  # the output is a leaf tensor (e.g. a parameter returned)
                t.register_hook(_OutputGradHook(self, capture, k, None))
            else:
                t.grad_fn.register_prehook(_OutputGradHook(self, capture, k, t.output_nr))
            capture.edges.append(get_gradient_edge(t))
        unit.captures.append(capture)
        self._mark_changed()
        return replaced

    def _mark_changed(self) -> None:
        if self._state is not None:
            self._stale = True

    def _on_hooked_grad(self, capture: _Capture, k: int, grad: torch.Tensor | None) -> None:
        """An output gradient delivered by autograd during a backward (not engine.backward's
        own gradients, which it passes to :meth:`_on_output_grad` itself)."""
        self._on_output_grad(capture, k, grad)
        if not self._reduction_checked and grad is not None and not self._direct_backward:
            self._check_reduction_in_backward(capture.edges[k].node)

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

    # ------------------------------------------------------------------ under torch.compile
    def _on_compiled_model_forward(self, tensors: list, names: list) -> None:
        """A compiled forward starts (run time): the callbacks, then a new step."""
        for callback in self._compiled_forward_callbacks:
            callback(tensors, names)
        self.clear()
        self._open_generic = []
        self._compiled_step = True
        self._input_records = {t.shape[0] for t in tensors if t.dim() > 0}

    def _on_compiled_unit_forward(
        self, name: str, inputs: list[torch.Tensor], output: torch.Tensor
    ) -> None:
        """A unit's call in a compiled forward (run time): store a capture of its inputs."""
        unit = self._unit_of[name]
        sampler = unit.sampler
        assert sampler is not None
        if unit.captures:
            raise UnsupportedLayerError(
                f"under torch.compile each layer is called once per forward; {unit.label} was "
                "called again (tied or reused layers need the eager model)"
            )
        batch = self._input_records - {1}
        if output.dim() == 0 or (len(batch) == 1 and output.shape[0] == 1):
            raise UnsupportedLayerError(
                f"under torch.compile the output of {unit.label} must have one row per record "
                f"(got shape {tuple(output.shape)}; outputs broadcast over the batch need the "
                "eager model)"
            )
        record_dims = None
        if sampler.output_record_dims is not None:
            record_dims = [sampler.output_record_dims(unit.module, tuple(inputs))[0]]
        unit.captures.append(_Capture(tuple(inputs), {}, [0], record_dims, None, None))
        self._mark_changed()

    def _on_compiled_output_grad(self, name: str, grad: torch.Tensor) -> None:
        """The gradient with respect to a unit's output in a compiled backward (run time)."""
        captures = self._unit_of[name].captures
        if captures:
            self._on_output_grad(captures[-1], 0, grad)

    @contextlib.contextmanager
    def _set_aside(self) -> Iterator[None]:
        """Keep the current step's captures and gradients aside while the block runs (the
        deferred record-independence probe of a compiled forward uses the engine too)."""
        saved = (
            [(u, u.captures) for u in self._units],
            self._grad_seen,
            self._autograd_grads,
            self._input_records,
            self._state,
            self._stale,
            self._compiled_step,
        )
        for u in self._units:
            u.captures = []
        self._grad_seen, self._autograd_grads = set(), {}
        self._state, self._stale = None, False
        try:
            yield
        finally:
            self.clear()
            for u, captures in saved[0]:
                u.captures = captures
            (_, self._grad_seen, self._autograd_grads, self._input_records) = saved[:4]
            self._state, self._stale, self._compiled_step = saved[4:]


def _no_rule_under_compile(unit: _Unit) -> UnsupportedLayerError:
    return UnsupportedLayerError(
        f"under torch.compile every layer with trainable parameters needs a layer rule; "
        f"{unit.label} has none (its generic per-example path keeps Python state that cannot "
        "be compiled): register a layer rule for it, or train the model eagerly"
    )
