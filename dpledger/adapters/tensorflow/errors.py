"""Exceptions of the TensorFlow/Keras adapter.

They extend the hierarchy of :mod:`dpledger.errors`: every one is a
:class:`dpledger.errors.DPLedgerError`, and each is caused by a model, a loss or an argument the
caller can change, so each also subclasses :class:`ValueError`.
"""

from __future__ import annotations

from dpledger.errors import DPLedgerError

__all__ = [
    "PerExampleLossError",
    "RecordMixingLayerError",
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
