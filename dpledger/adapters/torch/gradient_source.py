"""Where :class:`~dpledger.adapters.torch.optimizer.DPOptimizer` gets per-example gradients.

:class:`GradientSource` is the object ``DPOptimizer`` holds between the model and the clipping.
On the hook path (no ``loss_fn``) a
:class:`~dpledger.adapters.torch.engine.PerExampleGradientEngine` observes the user's forward
and backward; two forward pre-hooks on the model run before the engine's: the guard, which
refuses a forward that would lose a batch whose backward has not been stepped, and the
record-independence probe (:mod:`~dpledger.adapters.torch.record_probe`), at the first forward
with at least two records and whenever the model's modules or training modes change.
:meth:`GradientSource.backward` is the engine's cheaper backward. On the functional path
(``loss_fn``), :meth:`GradientSource.compute_gradients` computes the batch's per-example
gradients with ``torch.func`` (with Bias-Aware Minimisation's ascent when ``bam_radius`` is
set).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dpledger.adapters.torch.accumulation import MaterialisedGradients
from dpledger.adapters.torch.bam import per_example_gradients_and_losses
from dpledger.adapters.torch.compiled_capture import is_compiling
from dpledger.adapters.torch.engine import LossReduction, PerExampleGradientEngine, Strategy
from dpledger.adapters.torch.module_checks import check_module_configuration
from dpledger.adapters.torch.record_probe import (
    model_fingerprint,
    probe_record_independence,
    records_in,
)
from dpledger.adapters.torch.sharding import all_ranks_have_records
from dpledger.errors import EngineStateError

__all__ = ["GradientSource"]

logger = logging.getLogger("dpledger.adapters.torch.optimizer")


class GradientSource:
    """The per-example gradients of one model: the engine and its forward hooks, or the
    functional path (see the module docstring).

    Args:
        model: the model.
        names: the trainable parameters' names, in the optimizer's order.
        loss_fn: ``loss_fn(output, target)`` for one example (the functional path), or None.
        bam_radius: Bias-Aware Minimisation's λ on the functional path, or None.
        loss_reduction: the hook path's declared loss reduction.
        strategy: the engine's per-example strategy.
        check_steps: steps on which the engine checks Σ_i g_i against autograd.
        sharding: (whether the model is sharded by FSDP2, the run's process group or None):
            a sharded model's ranks probe together, or none does.

    Attributes:
        engine: the engine (None on the functional path).
        functional: the functional path's pending per-example gradients (None when none wait).
        probed: the model fingerprint the record-independence probe last passed (None before).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        names: tuple[str, ...],
        loss_fn: Callable[..., torch.Tensor] | None,
        bam_radius: float | None,
        loss_reduction: LossReduction,
        strategy: Strategy,
        check_steps: int,
        sharding: tuple[bool, Any] = (False, None),
    ) -> None:
        self.model = model
        self.names = names
        self.loss_fn = loss_fn
        self.bam_radius = bam_radius
        self.engine: PerExampleGradientEngine | None = None
        self.functional: MaterialisedGradients | None = None
        self.probed: tuple | None = None
        self._probing = False
        self._sharded, self._group = sharding
        self._handles: list[Any] = []
        # a compiled forward's probe, run eagerly at step(): (fingerprint, inputs, their names)
        self._deferred_probe: tuple[tuple, list[torch.Tensor], list[str]] | None = None
        if loss_fn is None:
            self.engine = PerExampleGradientEngine(
                model, loss_reduction=loss_reduction, strategy=strategy, check_steps=check_steps
            )

    def install_hooks(self, check_record_independence: bool) -> None:
        """The forward hooks of the hook path: the record-independence probe and the guard."""
        if check_record_independence:
            self._handles.append(
                self.model.register_forward_pre_hook(
                    self._probe_forward, prepend=True, with_kwargs=True
                )
            )
        else:
            logger.warning(
                "check_record_independence=False: the record-independence probe is off. A "
                "model whose forward mixes the records of a batch (batch statistics, "
                "attention or pooling over the batch) lets one record move every other "
                "record's clipped gradient, and the ledger's epsilon is then wrong"
            )
        # the guard runs first: it refuses a forward that would lose a pending step
        self._handles.append(
            self.model.register_forward_pre_hook(self._guard_forward, prepend=True)
        )
        if self.engine is not None:  # under torch.compile both run at run time instead
            callbacks = self.engine._compiled_forward_callbacks
            callbacks.append(lambda tensors, names: self._refuse_lost_step())
            if check_record_independence:
                callbacks.append(self._defer_probe)

    def _guard_forward(self, module: nn.Module, args: tuple) -> None:
        engine = self.engine
        if engine is None or engine.recomputing or not torch.is_grad_enabled():
            return
        if not is_compiling():
            self._refuse_lost_step()

    def _refuse_lost_step(self) -> None:
        if self.engine is not None and self.engine.has_gradients:
            raise EngineStateError(
                "a forward pass with gradients enabled started after loss.backward() and "
                "before optimizer.step(): the previous batch's per-example gradients would be "
                "lost. Call optimizer.step() after each backward (optimizer.virtual_step() for "
                "a chunk of a virtual batch), optimizer.zero_grad() to skip the batch, or run "
                "evaluation forwards under torch.no_grad()"
            )

    def _probe_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        engine = self.engine
        if engine is None or self._probing or engine.recomputing or not torch.is_grad_enabled():
            return
        if is_compiling():
            return  # deferred: _defer_probe runs at run time, the probe itself at step()
        fingerprint = model_fingerprint(self.model)
        if fingerprint == self.probed:
            return
        records = records_in(args, kwargs) or 0
        if self._sharded:  # FSDP2: every rank probes, or none (sharding.py)
            if not all_ranks_have_records(records, minimum=2, process_group=self._group):
                return
        elif records < 2:
            return  # a batch of at most one record (which cannot mix)
        self._probing = True
        try:
            probe_record_independence(self.model, engine=engine, args=args, kwargs=kwargs)
        finally:
            self._probing = False
        self.probed = fingerprint

    def _defer_probe(self, tensors: list[torch.Tensor], names: list[str]) -> None:
        """A compiled forward starts (run time): keep its inputs for the probe at step()."""
        fingerprint = model_fingerprint(self.model)
        if self._probing or fingerprint == self.probed:
            return
        if (records_in(*_inputs_of(tensors, names)) or 0) < 2:
            return  # a batch of at most one record (which cannot mix)
        self._deferred_probe = (fingerprint, [t.detach().clone() for t in tensors], names)

    def run_deferred_probe(self) -> None:
        """Probe a compiled forward's batch eagerly (the model's compiled code set aside),
        before its step uses anything; the step's own captures are kept aside meanwhile."""
        deferred, self._deferred_probe = self._deferred_probe, None
        if deferred is None or self.engine is None:
            return
        fingerprint, tensors, names = deferred
        args, kwargs = _inputs_of(tensors, names)
        self._probing = True
        try:
            with self.engine._set_aside(), torch.compiler.set_stance("force_eager"):
                probe_record_independence(self.model, engine=self.engine, args=args, kwargs=kwargs)
        finally:
            self._probing = False
        self.probed = fingerprint

    # ------------------------------------------------------------------ the pending batch
    @property
    def pending(self) -> bool:
        """Whether a batch's per-example gradients wait for a step."""
        if self.engine is not None:
            return self.engine.has_gradients
        return self.functional is not None

    def current(self) -> Any:
        """The pending batch's per-example gradients: the engine, or the functional path's
        :class:`~dpledger.adapters.torch.accumulation.MaterialisedGradients`."""
        if self.engine is not None:
            return self.engine
        assert self.functional is not None
        return self.functional

    def discard(self) -> None:
        """Let the pending batch's per-example gradients go."""
        if self.engine is not None:
            self.engine.clear()
        self.functional = None

    def detach(self) -> None:
        """Remove the hooks from the model."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.engine is not None:
            self.engine.remove()

    # ------------------------------------------------------------------ per-example gradients
    def backward(self, loss: torch.Tensor) -> None:
        """The engine's backward to the layers' outputs only (see ``DPOptimizer.backward``)."""
        if self.engine is None:
            raise EngineStateError(
                "optimizer.backward(loss) is for the hook path; with loss_fn= call "
                "optimizer.compute_gradients(inputs, targets)"
            )
        self.engine.backward(loss)

    def compute_gradients(self, inputs: Any, targets: Any) -> torch.Tensor:
        """The functional path (see ``DPOptimizer.compute_gradients``)."""
        if self.loss_fn is None:
            raise EngineStateError(
                "compute_gradients needs loss_fn= at construction; on the hook path run the "
                "forward and loss.backward() (or optimizer.backward(loss))"
            )
        if self.functional is not None:
            raise EngineStateError(
                "per-example gradients of the previous batch are waiting: call "
                "optimizer.step() (or virtual_step()) before computing another batch"
            )
        check_module_configuration(self.model)
        grads, losses = per_example_gradients_and_losses(
            self.model, self.loss_fn, inputs, targets, bam_radius=self.bam_radius or 0.0
        )
        self.functional = MaterialisedGradients({n: grads[n] for n in self.names}, self.names)
        return losses.mean() if losses.numel() else losses.new_tensor(math.nan)


def _inputs_of(tensors: list[torch.Tensor], names: list[str]) -> tuple[tuple, dict]:
    """A compiled forward's inputs as (args, kwargs), from its tensors and their names (a
    position, or a keyword); positions without a tensor were None."""
    positional = {int(n): t for n, t in zip(names, tensors, strict=True) if n.isdigit()}
    args = tuple(positional.get(i) for i in range(max(positional, default=-1) + 1))
    kwargs = {n: t for n, t in zip(names, tensors, strict=True) if not n.isdigit()}
    return args, kwargs
