"""The per-example losses of :class:`~dpledger.integrations.transformers.DPTrainer`.

Per-example clipping is per record only if each record's loss depends on that record alone and
the stepped loss is their mean. The Trainer's token-level losses divide a sum over the batch's
tokens by the batch's token count (``num_items_in_batch``), so one record changes the weight of
the others; :func:`per_example_token_loss` takes each example's own mean instead.
:func:`loss_kind` says which loss a model head gets, from the ``transformers`` auto-model
mappings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional
from transformers.models.auto import modeling_auto

__all__ = ["PerExampleLoss", "loss_kind", "per_example_token_loss"]

PerExampleLoss = Callable[[Any, torch.Tensor], torch.Tensor]
"""``per_example_loss(model_outputs, labels)`` → one loss per example, shape ``(B,)``."""

_IGNORE_INDEX = -100


def _class_names(*mappings: Any) -> frozenset[str]:
    names: set[str] = set()
    for mapping in mappings:
        for value in mapping.values():
            names.update((value,) if isinstance(value, str) else value)
    return frozenset(names)


_SEQUENCE_HEADS = _class_names(modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)
_CAUSAL_HEADS = _class_names(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
_TOKEN_HEADS = _class_names(
    modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    modeling_auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
)


def per_example_token_loss(
    logits: torch.Tensor, labels: torch.Tensor, *, shift: bool
) -> torch.Tensor:
    """Each example's mean cross-entropy over its labelled tokens, shape ``(B,)``.

    ℓ_i = (1/T_i) Σ_t CE(logits[i, t], labels[i, t]) over the T_i tokens of example i whose
    label is not -100 (an example with none has ℓ_i = 0). Unlike the Trainer's token-level loss
    (Σ over the batch's tokens / the batch's token count), ℓ_i depends on example i alone.

    Args:
        logits: ``(B, T, V)``.
        labels: ``(B, T)``, -100 where a token is not scored.
        shift: predict token t + 1 from position t (causal language models).
    """
    if shift:
        logits, labels = logits[:, :-1, :], labels[:, 1:]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    per_token = functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=_IGNORE_INDEX,
        reduction="none",
    ).reshape(labels.shape)
    counts = (labels != _IGNORE_INDEX).sum(dim=1).clamp(min=1)
    return per_token.sum(dim=1) / counts


def loss_kind(model: Any) -> str | None:
    """``"sequence"``, ``"causal"`` or ``"token"`` for a head DPTrainer knows, else None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = type(base).__name__
    if name in _SEQUENCE_HEADS:
        return "sequence"
    if name in _CAUSAL_HEADS:
        return "causal"
    if name in _TOKEN_HEADS:
        return "token"
    return None
