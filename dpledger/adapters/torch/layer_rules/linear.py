"""Per-example gradient norms and clipped sums for ``nn.Linear``.

With the layer input of example i flattened to a_i ∈ R^{T×d_in} (T = 1 without extra dimensions,
otherwise the product of the dimensions between the batch and the features) and the output
gradient b_i ∈ R^{T×d_out}, the per-example gradients are

    G_i = Σ_t b_it a_itᵀ  (weight),      β_i = Σ_t b_it  (bias).

Ghost norm (Li et al. 2022, "Large language models can be strong differentially private
learners", section 4):

    ‖G_i‖²_F = Σ_{s,t} (a_is·a_it)(b_is·b_it) = ⟨A_i A_iᵀ, B_i B_iᵀ⟩_F,

which for T = 1 is ‖a_i‖²‖b_i‖². The clipped sum is one matrix product,
Σ_i f_i G_i = (f ⊙ B)ᵀ A over all (i, t) (book-keeping, Bu et al. 2023, "Differentially private
optimization on large model at small cost"). The ghost norm costs O(T²(d_in + d_out)) per
example and materialising G_i costs O(T·d_in·d_out); :func:`linear_norms` takes the cheaper
(mixed ghost clipping, Bu et al. 2023), chunk by chunk so that no per-example gradient outlives its
chunk. Where keeping G_i is cheaper for the whole step and takes no more memory than the stored
activations, :func:`linear_prefers_per_example` asks the engine to keep them instead, and the
clipped sum becomes a weighted sum of them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

import torch
from torch import nn

from dpledger.adapters.torch.registry import register_layer_rule
from dpledger.errors import InvalidParameterError

__all__ = [
    "affine_bias_clipped_sum",
    "affine_bias_norms",
    "affine_weight_clipped_sum",
    "affine_weight_norms",
    "affine_weight_per_example",
    "chunk_budget",
    "ghost_norm_is_cheaper",
    "keeping_per_example_is_cheaper",
    "linear_clipped_sum",
    "linear_norms",
    "linear_per_example",
    "linear_prefers_per_example",
]


def _flatten(module: nn.Linear, activations: tuple, backprops: torch.Tensor):
    a = activations[0]
    batch, positions = a.shape[0], math.prod(a.shape[1:-1])
    return (
        a.reshape(batch, positions, module.in_features),
        backprops.reshape(batch, positions, module.out_features),
    )


# The batch is processed in chunks whose largest transient tensor (Gram matrices or
# materialised gradients) has at most this many elements: on the CPU few enough to stay in
# cache; on an accelerator many more, since there each chunk costs a few kernel launches, and
# for a small layer the launches, not the arithmetic, take the time (64 Mi elements are 256 MB
# of float32).
_MAX_CHUNK_ELEMENTS = 1 << 20
_MAX_CHUNK_ELEMENTS_ACCELERATOR = 1 << 26


def chunk_budget(device: torch.device) -> int:
    """The most elements a chunk's transient tensor may have on ``device``."""
    return _MAX_CHUNK_ELEMENTS if device.type == "cpu" else _MAX_CHUNK_ELEMENTS_ACCELERATOR


def _sizes(module: nn.Linear, activations: tuple) -> tuple[int, int, int]:
    a = activations[0]
    return math.prod(a.shape[1:-1]), module.in_features, module.out_features


def ghost_norm_is_cheaper(positions: int, d_in: int, d_out: int) -> bool:
    """For the norms alone: T²(d_in + d_out) ≤ T·d_in·d_out (Gram matrices vs materialising)."""
    return positions * (d_in + d_out) <= d_in * d_out


def keeping_per_example_is_cheaper(positions: int, d_in: int, d_out: int) -> bool:
    """Whether keeping G_i beats the fast path for T positions (see linear_prefers_per_example)."""
    t = positions
    return t * t * (d_in + d_out) > d_in * d_out and d_in * d_out <= t * (d_in + d_out)


def linear_prefers_per_example(
    module: nn.Linear, activations: tuple, backprops: torch.Tensor
) -> bool:
    """Keep the materialised G_i when that is cheaper for the whole step and not larger.

    The fast path costs T²(d_in + d_out) for the norms (or T·d_in·d_out materialising them chunk
    by chunk) plus T·d_in·d_out for the clipped sum; keeping G_i costs T·d_in·d_out plus d_in·d_out
    for the weighted sum. G_i are kept when T²(d_in + d_out) > d_in·d_out (the criterion of
    mixed ghost clipping, Bu et al. 2023) and one G_i is no larger than the example's stored input
    and output gradient, d_in·d_out ≤ T·(d_in + d_out), so that memory does not grow.
    """
    return keeping_per_example_is_cheaper(*_sizes(module, activations))


def _chunks(batch: int, per_example: int, device: torch.device) -> list[tuple[int, int]]:
    step = max(1, chunk_budget(device) // max(per_example, 1))
    return [(i, min(i + step, batch)) for i in range(0, batch, step)] or [(0, 0)]


def _check_method(method: str) -> None:
    if method not in ("auto", "ghost", "per_example"):
        raise InvalidParameterError("method", method, "'auto', 'ghost' or 'per_example'")


def affine_weight_norms(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    method: Literal["auto", "ghost", "per_example"] = "auto",
) -> torch.Tensor:
    """‖G_i‖²_F of G_i = Σ_t b_it a_itᵀ, for a of shape (B, T, d_in) and b of shape (B, T, d_out).

    The shared maths of every layer that is a linear map applied at T positions (``nn.Linear``,
    the input and hidden projections of recurrent layers). ``method``: "ghost" (Gram matrices),
    "per_example" (G_i materialised chunk by chunk and discarded) or "auto" (the cheaper).
    """
    _check_method(method)
    batch, t, d_in = a.shape
    d_out = b.shape[2]
    if t == 1 and method != "per_example":
        return a.squeeze(1).square().sum(1) * b.squeeze(1).square().sum(1)
    ghost = method == "ghost" or (method == "auto" and ghost_norm_is_cheaper(t, d_in, d_out))
    per_example = t * t if ghost else d_in * d_out
    parts = []
    for lo, hi in _chunks(batch, per_example, a.device):
        ac, bc = a[lo:hi], b[lo:hi]
        if ghost:
            gram_a = torch.bmm(ac, ac.transpose(1, 2))
            gram_b = torch.bmm(bc, bc.transpose(1, 2))
            parts.append((gram_a * gram_b).sum((1, 2)))
        else:
            g = torch.bmm(bc.transpose(1, 2), ac)
            parts.append(torch.linalg.vector_norm(g.flatten(1), dim=1).square())
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def affine_bias_norms(b: torch.Tensor) -> torch.Tensor:
    """‖β_i‖² of β_i = Σ_t b_it, for b of shape (B, T, d_out)."""
    return b.sum(1).square().sum(1)


def affine_weight_clipped_sum(a: torch.Tensor, b: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """Σ_i f_i G_i = (f ⊙ B)ᵀ A over all (i, t), shape (d_out, d_in)."""
    fb = b * f.view(-1, 1, 1)
    return fb.reshape(-1, b.shape[2]).t().mm(a.reshape(-1, a.shape[2]))


def affine_bias_clipped_sum(b: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """Σ_i f_i β_i, shape (d_out,)."""
    return f.view(1, -1).mm(b.sum(1)).view(-1)


def affine_weight_per_example(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """G_i = Σ_t b_it a_itᵀ of shape (B, d_out, d_in)."""
    return torch.bmm(b.transpose(1, 2), a)


def linear_norms(
    module: nn.Linear,
    activations: tuple,
    backprops: torch.Tensor,
    *,
    method: Literal["auto", "ghost", "per_example"] = "auto",
) -> dict[str, torch.Tensor]:
    """‖G_i‖² and ‖β_i‖² of every example (see the module docstring).

    Args:
        module: the layer.
        activations: its forward arguments, ``(x,)``.
        backprops: the gradient with respect to its output.
        method: "ghost" (Gram matrices), "per_example" (G_i materialised chunk by chunk and
            discarded) or "auto" (the cheaper for these shapes).
    """
    _check_method(method)
    a, b = _flatten(module, activations, backprops)
    out: dict[str, torch.Tensor] = {}
    if module.weight.requires_grad:
        out["weight"] = affine_weight_norms(a, b, method=method)
    if module.bias is not None and module.bias.requires_grad:
        out["bias"] = affine_bias_norms(b)
    return out


def linear_clipped_sum(
    module: nn.Linear,
    activations: tuple,
    backprops: torch.Tensor,
    factors: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Σ_i f_i G_i = (f ⊙ B)ᵀ A and Σ_i f_i β_i."""
    a, b = _flatten(module, activations, backprops)
    out: dict[str, torch.Tensor] = {}
    if "weight" in factors:
        out["weight"] = affine_weight_clipped_sum(a, b, factors["weight"])
    if "bias" in factors:
        out["bias"] = affine_bias_clipped_sum(b, factors["bias"])
    return out


def linear_per_example(
    module: nn.Linear, activations: tuple, backprops: torch.Tensor
) -> dict[str, torch.Tensor]:
    """G_i = Σ_t b_it a_itᵀ of shape (B, d_out, d_in) and β_i of shape (B, d_out)."""
    a, b = _flatten(module, activations, backprops)
    out: dict[str, torch.Tensor] = {}
    if module.weight.requires_grad:
        out["weight"] = affine_weight_per_example(a, b)
    if module.bias is not None and module.bias.requires_grad:
        out["bias"] = b.sum(1)
    return out


# NonDynamicallyQuantizableLinear (nn.MultiheadAttention's out_proj) is nn.Linear with another
# name; the attention uses its weight directly, so the engine differentiates it with the
# attention's generic unit whenever the layer is not called itself.
for _linear_type in (nn.Linear, nn.modules.linear.NonDynamicallyQuantizableLinear):
    register_layer_rule(
        _linear_type,
        norm_fn=linear_norms,
        clipped_sum_fn=linear_clipped_sum,
        per_example_fn=linear_per_example,
        prefer_per_example=linear_prefers_per_example,
    )
