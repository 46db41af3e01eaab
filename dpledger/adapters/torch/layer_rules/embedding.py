"""Per-example gradient norms and clipped sums for ``nn.Embedding``.

Example i looks up indices x_i1..x_iT and receives output gradients b_i1..b_iT ∈ R^d. Its
gradient is non-zero only in the rows it used: row v is r_iv = Σ_{t: x_it = v} b_it (the row of
``padding_idx``, if any, gets no gradient). Hence

    ‖G_i‖² = Σ_v ‖r_iv‖² = Σ_{s,t: x_is = x_it ≠ padding_idx} b_is·b_it,

computed by grouping the (example, index) pairs, summing the b_it within each group and squaring:
O(B·T·d) time and memory, never the dense (B, V, d) per-example gradient. The clipped sum adds
f_i·b_it into row x_it, as the ordinary embedding backward does with f_i = 1.

A token embedding tied to a linear output layer (GPT-2's ``lm_head``) shares one weight W (V×d)
between the two; the per-example gradient is the sum of both layers' and its squared norm needs
the cross term ⟨E_i, L_i⟩ with E_i = Σ_t e_{x_it} b_itᵀ and L_i = Σ_s c_is a_isᵀ (c_is ∈ R^V the
output layer's output gradient, a_is ∈ R^d its input):

    ⟨E_i, L_i⟩ = Σ_{t,s} c_is[x_it] · (b_it·a_is),

a gather of the output gradients at the looked-up indices and one (T_s × T_t) matrix product per
example (:func:`embedding_linear_cross_term`), in float64.

``scale_grad_by_freq=True`` divides each row's gradient by how often the index occurs in the
*whole batch*, which makes one example's gradient depend on the others; such a layer is refused
by the engine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from dpledger.adapters.torch.layer_rules.linear import chunk_budget
from dpledger.adapters.torch.registry import register_cross_term, register_layer_rule

__all__ = [
    "embedding_clipped_sum",
    "embedding_linear_cross_term",
    "embedding_norms",
    "embedding_per_example",
]


def _flatten(module: nn.Embedding, activations: tuple, backprops: torch.Tensor):
    idx = activations[0]
    batch = idx.shape[0]
    positions = math.prod(idx.shape[1:])
    idx = idx.reshape(batch, positions)
    b = backprops.reshape(batch, positions, module.embedding_dim)
    if module.padding_idx is not None:
        keep = (idx != module.padding_idx).unsqueeze(-1)
        b = b * keep.to(b.dtype)
    return idx, b


def embedding_norms(
    module: nn.Embedding, activations: tuple, backprops: torch.Tensor
) -> dict[str, torch.Tensor]:
    """‖G_i‖² from the rows each example touched (see the module docstring)."""
    if not module.weight.requires_grad:
        return {}
    idx, b = _flatten(module, activations, backprops)
    batch = idx.shape[0]
    rows = torch.arange(batch, device=idx.device).unsqueeze(1)
    keys = (rows * module.num_embeddings + idx).reshape(-1)
    # Group equal (example, index) keys without torch.unique, whose output size depends on the
    # data (a host synchronisation on an accelerator): sort, number the runs of equal keys, and
    # sum into a buffer with one row per position (rows of unused group numbers stay zero).
    ordered, order = torch.sort(keys)
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    group_of_sorted = torch.cumsum(starts, 0) - 1
    inverse = torch.empty_like(group_of_sorted).scatter_(0, order, group_of_sorted)
    sums = b.new_zeros(keys.shape[0], module.embedding_dim)
    sums.index_add_(0, inverse, b.reshape(-1, module.embedding_dim))
    example = torch.zeros_like(group_of_sorted).scatter_(
        0, group_of_sorted, ordered // module.num_embeddings
    )
    norms = b.new_zeros(batch)
    norms.index_add_(0, example, sums.square().sum(1))
    return {"weight": norms}


def embedding_clipped_sum(
    module: nn.Embedding,
    activations: tuple,
    backprops: torch.Tensor,
    factors: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Σ_i f_i G_i: f_i·b_it added into row x_it."""
    if "weight" not in factors:
        return {}
    idx, b = _flatten(module, activations, backprops)
    scaled = (b * factors["weight"].view(-1, 1, 1)).reshape(-1, module.embedding_dim)
    out = b.new_zeros(module.num_embeddings, module.embedding_dim)
    out.index_add_(0, idx.reshape(-1), scaled)
    return {"weight": out}


def embedding_per_example(
    module: nn.Embedding, activations: tuple, backprops: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The dense per-example gradients, shape (B, V, d) (used only for tied or reused weights)."""
    if not module.weight.requires_grad:
        return {}
    idx, b = _flatten(module, activations, backprops)
    batch = idx.shape[0]
    out = b.new_zeros(batch * module.num_embeddings, module.embedding_dim)
    rows = torch.arange(batch, device=idx.device).unsqueeze(1)
    out.index_add_(0, (rows * module.num_embeddings + idx).reshape(-1), b.reshape(-1, b.shape[-1]))
    return {"weight": out.view(batch, module.num_embeddings, module.embedding_dim)}


register_layer_rule(
    nn.Embedding,
    norm_fn=embedding_norms,
    clipped_sum_fn=embedding_clipped_sum,
    per_example_fn=embedding_per_example,
)


def embedding_linear_cross_term(
    embedding: nn.Embedding,
    embedding_activations: tuple,
    embedding_backprops: torch.Tensor,
    embedding_name: str,
    linear: nn.Linear,
    linear_activations: tuple,
    linear_backprops: torch.Tensor,
    linear_name: str,
) -> torch.Tensor:
    """⟨E_i, L_i⟩ of an embedding's weight tied to a linear layer's weight (module docstring).

    Computed in float64 (chunks of examples), so that the only rounding left in
    ‖E_i‖² + ‖L_i‖² + 2⟨E_i, L_i⟩ is that of the two layers' own norms.
    """
    if embedding_name != "weight" or linear_name != "weight":
        raise ValueError(f"no cross term for {embedding_name!r} and {linear_name!r}")
    idx, b = _flatten(embedding, embedding_activations, embedding_backprops)
    a = linear_activations[0]
    batch = a.shape[0]
    a = a.reshape(batch, -1, linear.in_features)
    c = linear_backprops.reshape(batch, -1, linear.out_features)
    t_emb, t_lin = idx.shape[1], a.shape[1]
    step = max(1, chunk_budget(a.device) // max(t_emb * t_lin, 1))
    out = torch.empty(batch, dtype=torch.float64, device=a.device)
    for lo in range(0, batch, step):
        hi = min(lo + step, batch)
        at = idx[lo:hi].unsqueeze(1).expand(hi - lo, t_lin, t_emb)
        picked = torch.gather(c[lo:hi], 2, at).to(torch.float64)  # c_is[x_it], (b, T_s, T_t)
        dots = torch.bmm(a[lo:hi].to(torch.float64), b[lo:hi].to(torch.float64).transpose(1, 2))
        out[lo:hi] = (picked * dots).sum((1, 2))
    return out


register_cross_term(nn.Embedding, nn.Linear, embedding_linear_cross_term)
