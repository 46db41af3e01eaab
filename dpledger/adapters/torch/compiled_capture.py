"""The engine's hooks under ``torch.compile``: what runs outside the compiled region.

When a model hooked by :class:`~dpledger.adapters.torch.engine.PerExampleGradientEngine` is
compiled (``torch.compile(model)`` or ``model.compile()``), Dynamo traces the engine's forward
hooks together with the model's forward. The eager hooks keep Python state (captures, autograd
node hooks, random-number states) that Dynamo cannot trace: every layer would end its graph
there (a graph break per layer). Under compilation the hooks take the path of this module
instead, which puts three opaque custom operators (``torch.library.custom_op``) into the graph;
the compiler does not trace into them and their Python bodies run at run time, eagerly:

* ``dpledger::begin_forward`` (the model's forward pre-hook): the start of a step: it hands the
  forward's tensor inputs to the engine's callbacks (the optimizer's guard and its
  record-independence probe, which is deferred to ``step()`` and run eagerly there), clears the
  previous step and notes the batch size. It returns a copy of the first input, which the
  forward uses in its place, so the operator stays in the graph.
* ``dpledger::capture_unit`` (a unit's forward hook): stores a copy of the unit's inputs and
  returns a copy of its output that the rest of the forward uses; its backward is
* ``dpledger::deliver_grad``: stores a copy of the gradient with respect to that output and
  passes the gradient on.

Dynamo does not guard compiled code on a module's hooks by default
(``torch._dynamo.config.skip_nnmodule_hook_guards``): code compiled for another model of the
same structure, without hooks, would then run in place of the hooked code, and the step would
be refused (its parameters received gradients the engine did not observe).
:func:`guard_module_hooks` turns those guards on when the engine is created (if Dynamo is
loaded) and at every compiled step, so that code compiled from then on is only reused for
modules with the same hooks; code compiled before is not, so wrap a model before compiling
another model of the same structure (or call ``torch._dynamo.reset()``).

The copies are needed because the compiled code may reuse the memory of a buffer once its last
use in the graph has passed; they cost one copy of each unit's input and output per step. Only
units with a layer rule and positional tensor inputs, called once per forward, are supported
under compilation; anything else is refused with
:class:`~dpledger.errors.UnsupportedLayerError` (use the eager model, or register a layer rule).
"""

from __future__ import annotations

import itertools
import sys
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from dpledger.errors import UnsupportedLayerError

__all__ = ["CompiledCapture", "guard_module_hooks", "is_compiling"]

_SLOTS = itertools.count()
# slot -> (engine, unit name): the units (and, with unit name "", engines) hooked for compiling
_REGISTRY: dict[int, tuple[weakref.ReferenceType[Any], str]] = {}


def is_compiling() -> bool:
    """True while ``torch.compile`` traces the code that calls this (never at run time)."""
    return bool(torch.compiler.is_compiling())


def guard_module_hooks() -> None:
    """Make Dynamo guard the code it compiles from now on on the modules' hooks (see the
    module docstring); nothing when Dynamo is not loaded (nothing was compiled yet)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.config.skip_nnmodule_hook_guards = False


def _lookup(slot: int) -> tuple[Any, str] | None:
    entry = _REGISTRY.get(slot)
    if entry is None:
        return None
    engine = entry[0]()
    if engine is None:
        return None
    return engine, entry[1]


@torch.library.custom_op("dpledger::begin_forward", mutates_args=())
def _begin_forward(tensors: list[torch.Tensor], names: str, slot: int) -> torch.Tensor:
    guard_module_hooks()
    found = _lookup(slot)
    if found is not None:  # names: the inputs' positions or keywords, joined by commas
        found[0]._on_compiled_model_forward(list(tensors), names.split(","))
    return tensors[0].clone()


@_begin_forward.register_fake
def _begin_forward_fake(tensors: list[torch.Tensor], names: str, slot: int) -> torch.Tensor:
    return torch.empty_like(tensors[0])


@torch.library.custom_op("dpledger::capture_unit", mutates_args=())
def _capture_unit(output: torch.Tensor, inputs: list[torch.Tensor], slot: int) -> torch.Tensor:
    found = _lookup(slot)
    if found is not None:
        engine, unit = found
        engine._on_compiled_unit_forward(unit, [t.detach().clone() for t in inputs], output)
    return output.clone()


@_capture_unit.register_fake
def _capture_unit_fake(output: torch.Tensor, inputs: list[torch.Tensor], slot: int) -> torch.Tensor:
    return torch.empty_like(output)


@torch.library.custom_op("dpledger::deliver_grad", mutates_args=())
def _deliver_grad(grad: torch.Tensor, slot: int) -> torch.Tensor:
    found = _lookup(slot)
    if found is not None:
        engine, unit = found
        engine._on_compiled_output_grad(unit, grad.detach().clone())
    return grad.clone()


@_deliver_grad.register_fake
def _deliver_grad_fake(grad: torch.Tensor, slot: int) -> torch.Tensor:
    return torch.empty_like(grad)


def _capture_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.slot = inputs[2]
    ctx.inputs = len(inputs[1])


def _capture_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    return _deliver_grad(grad, ctx.slot), [None] * ctx.inputs, None


def _begin_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.inputs = len(inputs[0])


def _begin_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    return [grad] + [None] * (ctx.inputs - 1), None, None


_capture_unit.register_autograd(_capture_backward, setup_context=_capture_setup)
_begin_forward.register_autograd(_begin_backward, setup_context=_begin_setup)


class CompiledCapture:
    """The traced side of the engine's hooks under ``torch.compile`` (see the module
    docstring): what the model's and the units' forward hooks put into the graph.

    Args:
        engine: the engine (held weakly); it implements ``_on_compiled_model_forward``,
            ``_on_compiled_unit_forward`` and ``_on_compiled_output_grad``.
        unit_names: the names of the engine's units that have a layer rule.
    """

    def __init__(self, engine: Any, unit_names: Sequence[str]) -> None:
        ref = weakref.ref(engine)
        self.model_slot = next(_SLOTS)
        _REGISTRY[self.model_slot] = (ref, "")
        self.unit_slots: dict[str, int] = {}
        for name in unit_names:
            slot = next(_SLOTS)
            _REGISTRY[slot] = (ref, name)
            self.unit_slots[name] = slot

    def release(self) -> None:
        """Forget the engine's slots (after its hooks were removed)."""
        for slot in (self.model_slot, *self.unit_slots.values()):
            _REGISTRY.pop(slot, None)

    def model_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The model's forward inputs with the first tensor replaced by ``begin_forward``'s."""
        tensors, names = [], []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                tensors.append(a)
                names.append(str(i))
            elif a is not None:
                raise _not_tensor("the model's forward", f"positional argument {i}", a)
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                tensors.append(v)
                names.append(k)
            elif v is not None:
                raise _not_tensor("the model's forward", f"keyword argument {k!r}", v)
        if not tensors:
            raise UnsupportedLayerError(
                "under torch.compile the model's forward needs at least one tensor input"
            )
        first = _begin_forward(tensors, ",".join(names), self.model_slot)
        if names[0].isdigit():
            args = (first, *args[1:]) if names[0] == "0" else _replace(args, int(names[0]), first)
        else:
            kwargs = {**kwargs, names[0]: first}
        return args, kwargs

    def unit_forward(self, name: str, label: str, args: tuple, kwargs: dict, output: Any) -> Any:
        """The unit's output passed through ``capture_unit`` (stores inputs, hooks its grad)."""
        if kwargs:
            raise UnsupportedLayerError(
                f"under torch.compile the layer {label} must be called with positional "
                f"arguments only, got keywords {sorted(kwargs)}"
            )
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                raise _not_tensor(f"the layer {label}", f"positional argument {i}", a)
        if not isinstance(output, torch.Tensor):
            raise UnsupportedLayerError(
                f"under torch.compile the layer {label} must return one tensor, got "
                f"{type(output).__name__}"
            )
        if not output.requires_grad:
            return None
        return _capture_unit(output, list(args), self.unit_slots[name])


def _replace(args: tuple, index: int, value: torch.Tensor) -> tuple:
    return tuple(value if i == index else a for i, a in enumerate(args))


def _not_tensor(where: str, what: str, value: Any) -> UnsupportedLayerError:
    return UnsupportedLayerError(
        f"under torch.compile {where} takes tensors only, got {what} of type "
        f"{type(value).__name__}: run the model eagerly, or pass only tensors"
    )
