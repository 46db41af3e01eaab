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
            ``scale_grad_by_freq=True``; Opacus's ``DPLSTM``, ``DPGRU`` or ``DPRNN``.
    """
    check_no_record_mixing(model)
    for name, module in model.named_modules():
        _refuse_opacus_recurrent(name, module)
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.scale_grad_by_freq:
            raise UnsupportedLayerError(
                f"{type(module).__name__} '{name}' has scale_grad_by_freq=True: it divides each "
                "row's gradient by the index's frequency in the whole batch, so one example's "
                "gradient depends on the others. Construct it with scale_grad_by_freq=False."
            )


_OPACUS_RECURRENT = {"DPLSTM": "LSTM", "DPGRU": "GRU", "DPRNN": "RNN"}
"""Opacus's recurrent layers and the torch.nn layer that replaces each."""


def _refuse_opacus_recurrent(name: str, module: nn.Module) -> None:
    """Refuse Opacus's DPLSTM / DPGRU / DPRNN, naming the torch.nn layer to use instead.

    They compute the recurrence with cells of ``nn.Linear`` layers whose parameters they also
    register under ``nn.LSTM``'s names, so one parameter belongs to two modules and its
    gradient comes from forwards that the layer's own call does not show.
    """
    kind = type(module)
    plain = _OPACUS_RECURRENT.get(kind.__name__)
    if plain is None or not kind.__module__.startswith("opacus."):
        return
    raise UnsupportedLayerError(
        f"'{name}' is Opacus's {kind.__name__}, which computes the recurrence with its own "
        f"cells of nn.Linear layers and registers their parameters again under nn.{plain}'s "
        "names: each parameter then belongs to two modules and cannot be given exact "
        f"per-example gradients. Use torch.nn.{plain} with the same arguments instead: "
        f"dpledger has a per-example rule for it, and a {kind.__name__}'s state_dict loads "
        "into it (Opacus needs its DP layers only for its own hooks).",
        layer_name=name,
        layer_type=kind.__name__,
    )
