"""Exceptions of the TensorFlow/Keras adapter.

They extend the hierarchy of :mod:`dpledger.errors`: every one is a
:class:`dpledger.errors.DPLedgerError`. Those caused by a model, a loss or an argument the caller
can change also subclass :class:`ValueError`; :class:`LedgerNotAttachedError` (a loaded model
without its ledger) is a :class:`RuntimeError`. :class:`UnrecordedTrainingWarning` is the warning
of training a wrapped model directly.
"""

from __future__ import annotations

from dpledger.errors import DPLedgerError
from dpledger.ledger.correlated import NoiseSeedReuseError, NoiseStreamRollbackError

__all__ = [
    "LedgerNotAttachedError",
    "NoiseSeedReuseError",
    "NoiseStreamEndError",
    "NoiseStreamRollbackError",
    "PerExampleLossError",
    "RecordMixingLayerError",
    "UnrecordedTrainingWarning",
    "UnsupportedLayerError",
]


class UnsupportedLayerError(DPLedgerError, ValueError):
    """A layer cannot be given correct per-example gradients as it is configured.

    Attributes:
        layer_name: the Keras name of the offending layer.
        layer_type: its class name.
    """

    def __init__(self, message: str, *, layer_name: str, layer_type: str) -> None:
        self.layer_name = layer_name
        self.layer_type = layer_type
        super().__init__(message)


class RecordMixingLayerError(UnsupportedLayerError):
    """A layer combines several records of the batch into one output.

    Batch normalisation in training mode normalises each example with the mean and variance of
    the whole batch, so one record's gradient depends on every other record of the batch and
    clipping each per-example gradient no longer bounds any record's influence on the update.
    Use ``keras.layers.GroupNormalization`` or ``keras.layers.LayerNormalization`` instead, or
    freeze the layer (``layer.trainable = False``, under which Keras 3 runs batch normalisation in
    inference mode with its moving statistics).
    """


class PerExampleLossError(DPLedgerError, ValueError):
    """A loss does not give one value per example.

    Per-example clipping needs the loss of each record separately: a Keras loss with
    ``reduction="none"`` (or ``None``), or a callable ``loss(y_true, y_pred)`` returning a tensor
    whose leading axis is the batch.
    """


class LedgerNotAttachedError(DPLedgerError, RuntimeError):
    """A :class:`~dpledger.adapters.tensorflow.DPKerasModel` loaded with
    ``keras.models.load_model`` was asked to train before it was given a ledger.

    The ledger is a file the user owns, not part of the saved model: a loaded model records
    nothing until :meth:`~dpledger.adapters.tensorflow.DPKerasModel.attach_ledger` gives it one
    (``PrivacyLedger(path, resume=True)`` continues the saved run's file; a new ledger starts a
    new account, which then does not hold the steps taken before the save).
    """


class UnrecordedTrainingWarning(UserWarning):
    """A model wrapped by :class:`~dpledger.adapters.tensorflow.DPKerasModel` is trained
    directly (its own ``fit``, ``train_on_batch`` or ``train_step``): those steps are not
    private and are not recorded in the wrapper's ledger."""


class NoiseStreamEndError(DPLedgerError, RuntimeError):
    """A step beyond the T steps of a correlated-noise release was asked for.

    The ledger's ``correlated_release`` stands for exactly T steps of one stream
    (``docs/correlated-noise.md``); a step T + 1 would release noise the event does not cover, so
    it is refused before anything is computed or recorded.
    """
