"""Per-example gradients of the affine parameters of normalisation layers.

A normalisation layer computes y = x̂ ⊙ w + β, where x̂ is its input normalised with statistics of
the example alone (LayerNorm, GroupNorm, RMSNorm) or with frozen running statistics (BatchNorm in
evaluation mode). With b_i the output gradient of example i and the sums running over every
position that shares one scale (feature positions of earlier dimensions for LayerNorm, spatial
positions for GroupNorm and BatchNorm):

    ∂ℓ_i/∂w = Σ_positions b_i ⊙ x̂_i,        ∂ℓ_i/∂β = Σ_positions b_i.

These have as many entries per example as the parameters (small), so they are materialised and
the engine derives the norms and clipped sums from them. x̂ is recomputed from the stored input
by the same functional the layer uses, without its affine parameters.

BatchNorm that normalises with batch statistics (training mode, or no running statistics) mixes
records and is refused (:class:`RecordMixingLayerError`); the engine checks this on every
forward. A LayerNorm whose ``normalized_shape`` covers the batch dimension mixes records too.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from dpledger.adapters.torch.registry import register_layer_rule
from dpledger.errors import RecordMixingLayerError

__all__ = [
    "batch_norm_per_example",
    "group_norm_per_example",
    "layer_norm_per_example",
    "rms_norm_per_example",
    "uses_batch_statistics",
]


def uses_batch_statistics(module: nn.Module) -> bool:
    """True for a BatchNorm layer that would normalise with the statistics of the batch."""
    if not isinstance(module, nn.modules.batchnorm._BatchNorm):
        return False
    return bool(module.training or module.running_mean is None or module.running_var is None)


def _affine(
    module: nn.Module, b: torch.Tensor, xhat: torch.Tensor, batch: int, trailing: tuple
) -> dict[str, torch.Tensor]:
    """Σ over the middle dimension of (B, -1, *trailing) views of b ⊙ x̂ and b."""
    out: dict[str, torch.Tensor] = {}
    middle = math.prod(b.shape[1 : b.dim() - len(trailing)])
    bb = b.reshape(batch, middle, *trailing)
    weight = getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    if weight is not None and weight.requires_grad:
        out["weight"] = (bb * xhat.reshape(batch, middle, *trailing)).sum(1)
    if bias is not None and bias.requires_grad:
        out["bias"] = bb.sum(1)
    return out


def _channel_affine(
    module: nn.Module, b: torch.Tensor, xhat: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Σ over the positions of (B, C, *) tensors of b ⊙ x̂ and b, shape (B, C)."""
    out: dict[str, torch.Tensor] = {}
    bb = b.flatten(2) if b.dim() > 2 else b.unsqueeze(2)
    weight = getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    if weight is not None and weight.requires_grad:
        out["weight"] = (bb * xhat.reshape(bb.shape)).sum(2)
    if bias is not None and bias.requires_grad:
        out["bias"] = bb.sum(2)
    return out


def layer_norm_per_example(
    module: nn.LayerNorm, activations: tuple, backprops: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per-example gradients of LayerNorm's weight and bias, shape (B, *normalized_shape)."""
    x = activations[0]
    shape = tuple(module.normalized_shape)
    if x.dim() <= len(shape):
        raise RecordMixingLayerError(
            f"LayerNorm{shape} normalises over the batch dimension of an input of shape "
            f"{tuple(x.shape)}: every example's output depends on the others. Give the records "
            "their own leading dimension."
        )
    xhat = F.layer_norm(x, shape, None, None, module.eps)
    return _affine(module, backprops, xhat, x.shape[0], shape)


def rms_norm_per_example(
    module: nn.Module, activations: tuple, backprops: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per-example gradients of RMSNorm's weight, shape (B, *normalized_shape)."""
    x = activations[0]
    shape = tuple(module.normalized_shape)
    if x.dim() <= len(shape):
        raise RecordMixingLayerError(
            f"RMSNorm{shape} normalises over the batch dimension of an input of shape "
            f"{tuple(x.shape)}: every example's output depends on the others."
        )
    xhat = F.rms_norm(x, shape, None, module.eps)
    return _affine(module, backprops, xhat, x.shape[0], shape)


def group_norm_per_example(
    module: nn.GroupNorm, activations: tuple, backprops: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per-example gradients of GroupNorm's weight and bias, shape (B, C)."""
    x = activations[0]
    xhat = F.group_norm(x, module.num_groups, None, None, module.eps)
    return _channel_affine(module, backprops, xhat)


def batch_norm_per_example(
    module: nn.modules.batchnorm._BatchNorm, activations: tuple, backprops: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per-example gradients of a frozen BatchNorm's weight and bias, shape (B, C).

    Raises:
        RecordMixingLayerError: the layer normalises with batch statistics.
    """
    if uses_batch_statistics(module):
        raise RecordMixingLayerError(batch_norm_refusal_message(module))
    x = activations[0]
    mean, var = module.running_mean.to(x.dtype), module.running_var.to(x.dtype)
    xhat = F.batch_norm(x, mean, var, None, None, False, 0.0, module.eps)
    return _channel_affine(module, backprops, xhat)


def batch_norm_refusal_message(module: nn.Module, name: str | None = None) -> str:
    """The explanation given when a BatchNorm layer would mix the records of a batch."""
    where = f" '{name}'" if name else ""
    kind = type(module).__name__
    why = (
        "is in training mode"
        if module.training
        else "has no running statistics (track_running_stats=False)"
    )
    return (
        f"{kind}{where} {why}, so it normalises each example with statistics of the whole "
        "batch: one record's gradient then depends on every other record and per-example "
        "clipping bounds nothing. Replace it by nn.GroupNorm or nn.LayerNorm (e.g. "
        "nn.GroupNorm(min(32, C), C)), or freeze it with running statistics by calling "
        ".eval() on the layer (after model.train(), which switches it back to training mode)."
    )


for _norm_type, _fn in (
    (nn.LayerNorm, layer_norm_per_example),
    (nn.GroupNorm, group_norm_per_example),
    (nn.RMSNorm, rms_norm_per_example),
    (nn.BatchNorm1d, batch_norm_per_example),
    (nn.BatchNorm2d, batch_norm_per_example),
    (nn.BatchNorm3d, batch_norm_per_example),
):
    register_layer_rule(_norm_type, per_example_fn=_fn)
