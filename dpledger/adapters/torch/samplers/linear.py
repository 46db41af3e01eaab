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
example and materialising G_i costs O(T·d_in·d_out); ``prefer_per_example`` picks the cheaper
(mixed ghost clipping, Bu et al. 2023).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from dpledger.adapters.torch.registry import register_grad_sampler

__all__ = [
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


def linear_prefers_per_example(
    module: nn.Linear, activations: tuple, backprops: torch.Tensor
) -> bool:
    """True when materialising G_i is cheaper than the ghost norm: T²(d_in+d_out) > d_in·d_out."""
    a = activations[0]
    t = a[0].numel() // module.in_features if a.shape[0] > 0 else 1
    return t * t * (module.in_features + module.out_features) > (
        module.in_features * module.out_features
    )


def linear_norms(
    module: nn.Linear, activations: tuple, backprops: torch.Tensor
) -> dict[str, torch.Tensor]:
    """‖G_i‖² by the ghost norm and ‖β_i‖² (see the module docstring)."""
    a, b = _flatten(module, activations, backprops)
    out: dict[str, torch.Tensor] = {}
    if module.weight.requires_grad:
        if a.shape[1] == 1:
            out["weight"] = a.squeeze(1).square().sum(1) * b.squeeze(1).square().sum(1)
        else:
            gram_a = torch.bmm(a, a.transpose(1, 2))
            gram_b = torch.bmm(b, b.transpose(1, 2))
            out["weight"] = (gram_a * gram_b).sum((1, 2))
    if module.bias is not None and module.bias.requires_grad:
        out["bias"] = b.sum(1).square().sum(1)
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
        fb = b * factors["weight"].view(-1, 1, 1)
        out["weight"] = (
            fb.reshape(-1, module.out_features).t().mm(a.reshape(-1, module.in_features))
        )
    if "bias" in factors:
        out["bias"] = factors["bias"].view(1, -1).mm(b.sum(1)).view(-1)
    return out


def linear_per_example(
    module: nn.Linear, activations: tuple, backprops: torch.Tensor
) -> dict[str, torch.Tensor]:
    """G_i = Σ_t b_it a_itᵀ of shape (B, d_out, d_in) and β_i of shape (B, d_out)."""
    a, b = _flatten(module, activations, backprops)
    out: dict[str, torch.Tensor] = {}
    if module.weight.requires_grad:
        out["weight"] = torch.bmm(b.transpose(1, 2), a)
    if module.bias is not None and module.bias.requires_grad:
        out["bias"] = b.sum(1)
    return out


register_grad_sampler(
    nn.Linear,
    norm_fn=linear_norms,
    clipped_sum_fn=linear_clipped_sum,
    per_example_fn=linear_per_example,
    prefer_per_example=linear_prefers_per_example,
)
