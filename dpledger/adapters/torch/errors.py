"""Exceptions of the PyTorch adapter.

They extend the hierarchy of :mod:`dpledger.errors`: every one is a
:class:`dpledger.errors.DPLedgerError`, and those caused by a model or an argument the caller can
change also subclass :class:`ValueError`.
"""

from __future__ import annotations

from dpledger.errors import DPLedgerError
from dpledger.ledger.correlated import NoiseSeedReuseError, NoiseStreamRollbackError

__all__ = [
    "EngineStateError",
    "NoiseSeedReuseError",
    "NoiseStreamEndError",
    "NoiseStreamRollbackError",
    "RecordDependenceError",
    "RecordMixingModuleError",
    "UnsupportedModuleError",
    "UnsupportedParameterUseError",
]


class UnsupportedModuleError(DPLedgerError, ValueError):
    """A module cannot be given correct per-example gradients as it is configured.

    Examples: ``nn.Embedding(scale_grad_by_freq=True)`` (the scale depends on the whole batch), or
    a module with randomness (dropout) inside a part of the model whose forward the engine has to
    recompute per example.
    """


class RecordMixingModuleError(UnsupportedModuleError):
    """A module combines several records of the batch into one output.

    Batch normalisation in training mode normalises each example with statistics of the whole
    batch, so one record's gradient depends on every other record and per-example clipping no
    longer bounds any record's influence. Use ``nn.GroupNorm`` or ``nn.LayerNorm`` instead, or
    freeze the layer (``module.eval()`` with running statistics).
    """


class RecordDependenceError(RecordMixingModuleError):
    """The record-independence probe saw one record move another record's result.

    Raised before the first recorded step when changing record 0 of a small probe batch changes
    another record's module output or per-example gradient (see
    :mod:`~dpledger.adapters.torch.record_probe`).

    Attributes:
        module_name: the qualified name of the first module whose output mixes records
            (``""`` for the model itself), or None when no module output mixes and only the
            per-example gradients move (a backward that mixes records).
        module_type: that module's class name, or None.
        parameters: the parameters whose per-example gradients moved (empty when the forward
            check found the module first).
    """

    def __init__(
        self,
        message: str,
        *,
        module_name: str | None,
        module_type: str | None,
        parameters: tuple[str, ...] = (),
    ) -> None:
        self.module_name = module_name
        self.module_type = module_type
        self.parameters = parameters
        super().__init__(message)


class UnsupportedParameterUseError(DPLedgerError, ValueError):
    """A parameter's gradient does not come (only) from forward calls the engine observed.

    Raised when a trainable parameter receives gradient from a computation outside the forward of
    the module it belongs to (for example ``F.linear(h, self.embedding.weight)`` written in a
    parent module), or when the engine's sum of per-example gradients disagrees with autograd's
    batch gradient (which is also what a wrong ``loss_reduction`` looks like).
    """


class EngineStateError(DPLedgerError, RuntimeError):
    """The engine was asked for something before the step reached the point that provides it.

    Example: per-example norms asked for before ``loss.backward()`` ran on the last forward.
    """


class NoiseStreamEndError(EngineStateError):
    """A step past the end of a correlated-noise stream: the release recorded in the ledger
    covers ``num_steps`` steps and no more; nothing was released or recorded for the step.
    Train a longer stream (a new ``CorrelatedNoiseSpec`` and optimizer, a new release)."""


class LossReductionWarning(UserWarning):
    """The loss's own reduction contradicts the declared ``loss_reduction``.

    Raised as a warning on the first step, by
    :meth:`~dpledger.adapters.torch.engine.PerExampleGradientEngine.backward`
    (``optimizer.backward(loss)``) or from inside a plain ``loss.backward()``
    (:mod:`~dpledger.adapters.torch.loss_reduction`), when the loss is the direct output of a
    PyTorch loss with a ``reduction`` (``cross_entropy``, ``nll_loss``, ``mse_loss``,
    ``binary_cross_entropy``, …) whose value differs from the declaration. The privacy
    guarantee holds either way (the clipped contributions stay bounded by the clip norm), but
    every per-example gradient is scaled by B or 1/B before clipping, so clipping acts at another
    effective norm.

    Attributes:
        declared: the declared ``loss_reduction``.
        found: the reduction of the loss (``"mean"`` or ``"sum"``).
        loss_function: the autograd node of the loss (e.g. ``"NllLossBackward0"``).
    """

    def __init__(self, message: str, *, declared: str, found: str, loss_function: str) -> None:
        self.declared = declared
        self.found = found
        self.loss_function = loss_function
        super().__init__(message)


__all__ += ["LossReductionWarning"]
