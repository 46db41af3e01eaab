"""What the per-example gradient engine stores, and the helpers that read it.

A *unit* (:class:`_Unit`) is a module whose parameters the engine differentiates per example
(see :mod:`~dpledger.adapters.torch.engine`); each forward call of a unit in a step leaves a
:class:`_Capture` (its inputs, the gradient edges of its outputs and, after the backward, the
gradients with respect to those outputs); the step's results are a :class:`_StepState`. The
functions below read a capture the way the layer rules need it (:func:`_aligned`: one floating
dtype, at least float32) and decide whether a sampler can take it (:func:`_takes`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dpledger.adapters.torch.layer_rules.normalization import (
    batch_norm_refusal_message,
    uses_batch_statistics,
)
from dpledger.adapters.torch.registry import LayerRule
from dpledger.errors import (
    RecordMixingLayerError,
    UnsupportedLayerError,
    UnsupportedParameterUseError,
)

__all__: list[str] = []  # internal to the engine


class _Capture:
    """One observed forward call of a unit and the gradients with respect to its outputs."""

    __slots__ = (
        "__weakref__",
        "args",
        "edges",
        "grads",
        "kwargs",
        "masks",
        "out_indices",
        "record_dims",
        "rng_state",
    )

    def __init__(
        self,
        args: tuple,
        kwargs: dict,
        out_indices: list[int],
        record_dims: list[int] | None = None,
        rng_state: Any = None,
        masks: list[torch.Tensor] | None = None,
    ) -> None:
        self.args = args
        # The dropout masks kept in this call (a generic unit's; dropout_replay), in call order.
        self.masks = masks
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
        """Drop the stored tensors and edges (they are the largest part of a step's memory).

        The hook on the autograd node of the unit's output refers to this capture and to the
        engine only weakly (``capture_hooks._OutputGradHook``): the capture's edges refer to
        that node, and strong references back would make a cycle through a C++ object that
        Python's garbage collector cannot see through.
        """
        self.args = ()
        self.kwargs = {}
        self.rng_state = None
        self.masks = None
        self.edges = []
        self.grads = [None] * len(self.out_indices)

    def output_grads(self) -> list[tuple[int, torch.Tensor]]:
        return [(i, g) for i, g in zip(self.out_indices, self.grads, strict=True) if g is not None]


@dataclass
class _Unit:
    name: str
    module: nn.Module
    sampler: LayerRule | None
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


def _tied_dtype(*captures: _Capture) -> torch.dtype:
    """The computation dtype of the per-example norms of these captures (at least float32)."""
    dtype = torch.float32
    for c in captures:
        for g in c.grads:
            if g is not None and g.is_floating_point():
                dtype = torch.promote_types(dtype, g.dtype)
    return dtype


def _takes(sampler: LayerRule, capture: _Capture) -> bool:
    """Whether the sampler can take the capture's output gradients (else: generic path)."""
    if capture.record_dims is not None:
        return capture.has_grad
    return len(capture.grads) == 1 and capture.grads[0] is not None


def _bound_arguments(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """A call's arguments as one positional tuple in ``forward``'s order, defaults filled in.

    Keyword arguments are placed where their parameter stands and every parameter not given
    takes its default, so that a layer rule reads an argument at the same position whichever
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
    except UnsupportedLayerError as exc:
        raise UnsupportedLayerError(f"module {unit.label}: {exc}") from exc


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
        raise RecordMixingLayerError(batch_norm_refusal_message(module, name or None))


def _outside_use_error(
    model: nn.Module, units: list[_Unit], names: list[str]
) -> UnsupportedParameterUseError:
    """The error for parameters that took part in the loss although the forward of the unit
    that owns them was not observed: a module containing the unit (typically its parent) used
    them directly. Names each owning module, its parent and what to do instead."""
    owners: dict[str, tuple[nn.Module, list[str]]] = {}
    for n in names:
        unit = next((u for u in units if n in u.local_to_global.values()), None)
        key = n.rpartition(".")[0] if unit is None else unit.name
        module = model.get_submodule(key) if unit is None else unit.module
        owners.setdefault(key, (module, []))[1].append(n)
    parts, example = [], ""
    for key, (module, params) in owners.items():
        parent_name = key.rpartition(".")[0]
        parent = model.get_submodule(parent_name)
        where = f"'{parent_name}'" if parent_name else "the model"
        parts.append(
            f"{', '.join(params)} of module '{key or '<model>'}' ({type(module).__name__}), "
            f"whose parent is {where} ({type(parent).__name__})"
        )
        example = example or params[0][len(parent_name) + 1 if parent_name else 0 :]
    return UnsupportedParameterUseError(
        f"the loss depends on {'; '.join(parts)}, but the owning module's forward was not "
        "called in this step: a module that contains it (its parent) uses the parameter "
        f"directly, e.g. F.linear(x, self.{example}) in the parent's forward instead of a call "
        "of the module. The engine sees a module's per-example inputs and output gradients only "
        "through the module's own forward, so it cannot compute per-example gradients of such a "
        "use. Call the owning module itself in the forward, or register a layer rule for the "
        "parent module's type (dpledger.adapters.torch.register_layer_rule) so that the "
        "parent is differentiated as a whole."
    )
