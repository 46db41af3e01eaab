"""The engine's check of a loss's reduction against the declared ``loss_reduction``.

``loss_reduction`` is a declaration the gradients cannot confirm (a mean loss and a sum loss
differ by a constant factor that every gradient shares). The one case that can be told is a loss
that is the direct output of a PyTorch loss which saves its reduction on its autograd node
(``cross_entropy``, ``nll_loss``, ``mse_loss``, ``binary_cross_entropy``,
``binary_cross_entropy_with_logits``, ``huber_loss``, ``smooth_l1_loss``): on the first step
the engine reads that reduction and warns
(:class:`~dpledger.errors.LossReductionWarning`) when it contradicts the
declaration over more than one record and more than one term.

The engine sees the loss in two ways:

* ``engine.backward(loss)`` (``optimizer.backward(loss)``) is handed it;
* a plain ``loss.backward()`` (or ``torch.autograd.grad(loss, …)``) is seen from inside the
  backward: the first hook that receives a unit's output gradient looks for the backward call
  in progress (``torch.autograd.graph._engine_run_backward``, through which every backward and
  ``grad`` call runs, on the hook's thread or, for a device's backward thread, on the thread
  that waits for it) and reads its root. A root is judged only when it is certain to be this
  step's loss: one backward call in progress whose graph reaches the unit's output, with one
  output, differentiated with the implicit gradient 1 (a ``loss.backward(gradient=c)`` rescales
  the loss). By then the loss's node has run and freed its saved tensors, so a mean
  ``nll_loss`` / ``cross_entropy`` is not judged this way (its ignored targets change the
  mean's divisor and can no longer be seen): ``engine.backward(loss)`` judges it. Where any of
  this cannot be established (another PyTorch version, several backward calls at once) nothing
  is claimed.

Any other loss (a ``.sum()``, a ``.mean()``, a rescaled loss, a weighted mean) is not judged: the
same gradients come from a correct declaration, so no check on the gradients is free of false
alarms. After the first step nothing is looked at.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from collections.abc import Sequence
from types import FrameType
from typing import Any

import torch

from dpledger.errors import EngineStateError, LossReductionWarning

__all__: list[str] = []  # internal to the engine

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


_ENGINE_ENTRY = ("_engine_run_backward", os.path.join("autograd", "graph.py"))
"""The Python function (name, file) through which every backward and ``grad`` call runs."""


def _backward_calls_in(frame: FrameType | None) -> list[tuple[Any, Any]]:
    """(outputs, gradients of the outputs) of each backward call on this stack of frames."""
    calls = []
    while frame is not None:
        code = frame.f_code
        if code.co_name == _ENGINE_ENTRY[0] and code.co_filename.endswith(_ENGINE_ENTRY[1]):
            local = frame.f_locals
            args = local.get("args") or ()
            calls.append((local.get("t_outputs"), args[0] if args else None))
        frame = frame.f_back
    return calls


def _running_backward_calls() -> list[tuple[Any, Any]]:
    """The backward calls in progress: on this thread's stack, or else on every thread's (a
    device's backward runs on an autograd thread while the caller's thread waits)."""
    calls = _backward_calls_in(sys._getframe(1))
    if not calls:
        for frame in sys._current_frames().values():
            calls.extend(_backward_calls_in(frame))
    return calls


def _reaches(root: Any, node: Any) -> bool:
    """Whether the autograd graph below ``root`` contains ``node``."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        if current is node:
            return True
        seen.add(id(current))
        stack.extend(next_node for next_node, _ in current.next_functions)
    return False


def _is_implicit_gradient(grads: Any) -> bool:
    """Whether a backward call's output gradients are the one scalar 1 of ``loss.backward()``."""
    if not isinstance(grads, Sequence) or len(grads) != 1:
        return False
    (g,) = grads
    return isinstance(g, torch.Tensor) and g.numel() == 1 and bool(g.detach() == 1)


def _loss_reduction_of_backward(node: Any) -> tuple[str, str, int] | None:
    """:func:`_loss_reduction_of` of the loss whose backward is running through ``node``.

    None unless exactly one backward call in progress reaches ``node`` and its one output,
    differentiated with the implicit gradient 1, is the direct output of a built-in loss.
    """
    reaching = [
        (outputs, grads)
        for outputs, grads in _running_backward_calls()
        if isinstance(outputs, Sequence)
        and any(isinstance(t, torch.Tensor) and _reaches(t.grad_fn, node) for t in outputs)
    ]
    if len(reaching) != 1:
        return None
    ((outputs, grads),) = reaching
    if len(outputs) != 1 or not _is_implicit_gradient(grads):
        return None
    return _loss_reduction_after_backward(outputs[0])


def _loss_reduction_after_backward(loss: torch.Tensor) -> tuple[str, str, int] | None:
    """:func:`_loss_reduction_of` from what the loss's node keeps once it has run.

    Its saved tensors are freed by then (the root of a backward runs first); what is left is
    its reduction, whether it had a ``weight`` (reading a freed one fails) and the shape of its
    input. The terms are the input's elements, or for ``nll_loss`` its targets (the input's
    size without the class dimension); ``nll_loss`` with ``"mean"`` is not claimed, because
    its ignored targets, which change the mean's divisor, can no longer be seen.
    """
    node = loss.grad_fn
    code = getattr(node, "_saved_reduction", None)
    if not isinstance(code, int) or code not in _REDUCTIONS:
        return None
    try:
        if getattr(node, "_saved_weight", None) is not None:
            return None
    except RuntimeError:  # a weight tensor, freed
        return None
    name = type(node).__name__
    nll = name.startswith("NllLoss")
    if nll and _REDUCTIONS[code] == "mean":
        return None
    edges = node.next_functions
    if not edges or edges[0][0] is None:
        return None
    first, nr = edges[0]
    metadata = getattr(first, "_input_metadata", None)
    if metadata is None:
        return None
    shape = list(metadata[nr].shape)
    if nll:
        shape = shape[:1] + shape[2:] if len(shape) > 1 else []
    return name, _REDUCTIONS[code], math.prod(shape)


class LossReductionCheck:
    """The first step's check of the loss's reduction (a base class of
    :class:`~dpledger.adapters.torch.engine.PerExampleGradientEngine`).

    It uses the engine's ``_loss_reduction`` (the declaration), ``_reduction_checked`` (True once
    the first step was looked at) and ``_batch_size()``.
    """

    _loss_reduction: str
    _reduction_checked: bool

    def _check_reduction_in_backward(self, node: Any) -> None:
        """From a hook in a plain backward: check the running backward's loss (first step)."""
        self._reduction_checked = True
        found = _loss_reduction_of_backward(node)
        if found is not None:
            self._check_reduction(*found, stacklevel=2)

    def _check_reduction(
        self, node: str, reduction: str, elements: int, *, stacklevel: int = 3
    ) -> None:
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
            stacklevel=stacklevel,
        )
