"""Checks that a model's modules keep the records of a batch apart.

Per-example clipping bounds each record's influence only if every example's gradient depends on
that example alone. Batch normalisation with batch statistics breaks this (it normalises each
example with the mean and variance of the batch), and so does ``nn.Embedding`` with
``scale_grad_by_freq=True`` (it scales by index counts over the batch). BatchNorm frozen in
evaluation mode with running statistics is a per-example affine map and is allowed; its weight
and bias, if trainable, get exact per-example gradients from the running statistics.
"""

from __future__ import annotations

from torch import nn

from dpledger.adapters.torch.layer_rules.normalization import (
    batch_norm_refusal_message,
    uses_batch_statistics,
)
from dpledger.errors import RecordMixingLayerError, UnsupportedLayerError

__all__ = ["check_module_configuration", "check_no_record_mixing"]


def check_no_record_mixing(model: nn.Module) -> None:
    """Raise :class:`RecordMixingLayerError` for a BatchNorm that would use batch statistics.

    Covers every subclass of ``nn.modules.batchnorm._BatchNorm`` (BatchNorm1d/2d/3d, their lazy
    variants and SyncBatchNorm).
    """
    for name, module in model.named_modules():
        if uses_batch_statistics(module):
            raise RecordMixingLayerError(batch_norm_refusal_message(module, name or None))


def check_module_configuration(model: nn.Module) -> None:
    """Raise for module options whose gradients depend on the whole batch.

    Raises:
        RecordMixingLayerError: see :func:`check_no_record_mixing`.
        UnsupportedLayerError: ``nn.Embedding`` or ``nn.EmbeddingBag`` with
            ``scale_grad_by_freq=True``.
    """
    check_no_record_mixing(model)
    for name, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.scale_grad_by_freq:
            raise UnsupportedLayerError(
                f"{type(module).__name__} '{name}' has scale_grad_by_freq=True: it divides each "
                "row's gradient by the index's frequency in the whole batch, so one example's "
                "gradient depends on the others. Construct it with scale_grad_by_freq=False."
            )
