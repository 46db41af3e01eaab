"""Per-example gradient norms and clipped sums for ``nn.MultiheadAttention``.

An attention layer is four affine maps around a parameter-free core. With x^q, x^k, x^v the
query, key and value inputs of example i (shapes (L, d), (S, k_dim), (S, v_dim)):

    q = x^q W_qᵀ + b_q,   k = x^k W_kᵀ + b_k,   v = x^v W_vᵀ + b_v,
    c = Attention(q, k, v; masks, heads),         y = c W_oᵀ + b_o,

where W_q, W_k, W_v are the three row blocks of ``in_proj_weight`` (or ``q_proj_weight``,
``k_proj_weight``, ``v_proj_weight`` when the key or value width differs from the embedding),
b_q, b_k, b_v the three blocks of ``in_proj_bias``, and W_o, b_o ``out_proj``'s parameters. Given
example i's gradients ∂q_i, ∂k_i, ∂v_i and ∂y_i, each map is a linear layer applied at L or S
positions, so the ghost norms, book-keeping clipped sums and per-example gradients of
:mod:`~dpledger.adapters.torch.layer_rules.linear` apply to it; a packed parameter's norm is the sum
of its blocks' norms and its clipped sum their concatenation.

The layer does not expose q, k, v or c, so the sampler recomputes them on the whole batch from
the stored inputs: the projections as plain products, then torch's own attention
(``F.multi_head_attention_forward`` with identity projections, so masks, causal attention and
the returned attention weights follow torch's semantics exactly) on q, k, v as leaves of a small
autograd graph. Differentiating c (and the attention weights, when the loss used them) against
∂y W_o (and their captured gradient) gives ∂q, ∂k, ∂v. Records do not interact in the layer
(each attends only within its own sequence), so row i of each is example i's. This costs about
one more forward and backward of the attention core, in the precision of the stored inputs
(float32 at least under autocast) with autocast off, and no per-example ``torch.func`` pass; the
result is cached for the step, so the norms and the clipped sum share one recomputation. The
recomputation reads the module's current parameters: query the engine before the optimizer
changes them (the usual order).

Handled: packed or separate projection weights, with or without biases, ``batch_first`` either
way, self- and cross-attention, ``key_padding_mask``, ``attn_mask``, ``is_causal``,
``need_weights`` and ``average_attn_weights``, any subset of the parameters trainable. A layer
with attention dropout (``dropout > 0``), ``bias_k``/``bias_v`` or ``add_zero_attn`` keeps the
generic path (:func:`attention_applies`), which replays the layer's random draws and is exact for
any configuration. Inputs without a batch dimension are refused
(:class:`~dpledger.errors.UnsupportedLayerError`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from dpledger.adapters.torch.layer_rules.linear import (
    affine_bias_clipped_sum,
    affine_bias_norms,
    affine_weight_clipped_sum,
    affine_weight_norms,
    affine_weight_per_example,
    keeping_per_example_is_cheaper,
)
from dpledger.adapters.torch.layer_rules.step_cache import cached_per_step
from dpledger.adapters.torch.registry import register_layer_rule
from dpledger.errors import UnsupportedLayerError

__all__ = [
    "attention_applies",
    "attention_check",
    "attention_clipped_sum",
    "attention_norms",
    "attention_output_record_dims",
    "attention_per_example",
    "attention_prefers_per_example",
]

# The forward's parameters after (query, key, value), with their defaults, in signature order.
_OPTIONS = (
    ("key_padding_mask", None),
    ("need_weights", True),
    ("attn_mask", None),
    ("average_attn_weights", True),
    ("is_causal", False),
)


class _Block(NamedTuple):
    """One affine map: its weight and bias names (blocks of a packed one), inputs, gradients."""

    weight: str
    bias: str | None
    inputs: torch.Tensor  # (B, positions, d_in)
    grads: torch.Tensor  # (B, positions, d_out)


def attention_applies(module: nn.MultiheadAttention) -> bool:
    """True when the recomputation reproduces the layer exactly (see the module docstring)."""
    return module.dropout == 0 and module.bias_k is None and not module.add_zero_attn


def attention_check(module: nn.MultiheadAttention, activations: tuple | None) -> None:
    """Refuse inputs without a batch dimension.

    Args:
        module: the attention layer.
        activations: its forward arguments, or None to check its configuration only.

    Raises:
        UnsupportedLayerError: the query is not a 3-D tensor.
    """
    if activations is None:
        return
    query = activations[0] if activations else None
    if not isinstance(query, torch.Tensor) or query.dim() != 3:
        shape = tuple(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__
        raise UnsupportedLayerError(
            f"the query has shape {shape}; per-example gradients need batched inputs "
            "(B, L, E) with batch_first=True or (L, B, E)"
        )


def attention_output_record_dims(
    module: nn.MultiheadAttention, activations: tuple
) -> tuple[int, ...]:
    """Records along dim 0 (``batch_first``) or 1 of the output, dim 0 of the weights."""
    return (0 if module.batch_first else 1, 0)


def _options(activations: tuple) -> dict:
    given = dict(zip((name for name, _ in _OPTIONS), activations[3:], strict=False))
    return {name: given.get(name, default) for name, default in _OPTIONS}


def _records_first(module: nn.MultiheadAttention, t: torch.Tensor) -> torch.Tensor:
    return t if module.batch_first else t.transpose(0, 1)


def _projection_weights(module: nn.MultiheadAttention) -> list[tuple[str, torch.Tensor, slice]]:
    """(name, weight, rows) of the query, key and value projections."""
    e = module.embed_dim
    rows = [slice(0, e), slice(e, 2 * e), slice(2 * e, 3 * e)]
    if module._qkv_same_embed_dim:
        w = module.in_proj_weight
        return [("in_proj_weight", w[r], r) for r in rows]
    return [
        (name, getattr(module, name), r)
        for name, r in zip(("q_proj_weight", "k_proj_weight", "v_proj_weight"), rows, strict=True)
    ]


def _blocks(module: nn.MultiheadAttention, activations: tuple, backprops: tuple) -> list[_Block]:
    query, key, value = (_records_first(module, t) for t in activations[:3])
    options = _options(activations)
    grad_out, grad_weights = backprops[0], backprops[1] if len(backprops) > 1 else None
    dtype = torch.promote_types(query.dtype, torch.float32)
    device_type = query.device.type
    e = module.embed_dim
    bias = module.in_proj_bias
    with torch.no_grad(), torch.autocast(device_type, enabled=False):
        projections = []
        for (_, w, rows), x in zip(_projection_weights(module), (query, key, value), strict=True):
            b = None if bias is None else bias[rows].to(dtype)
            projections.append(F.linear(x.to(dtype), w.to(dtype), b))
        eye = torch.eye(e, dtype=dtype, device=query.device)
        w_out = module.out_proj.weight.to(dtype)
    leaves = [p.detach().requires_grad_(True) for p in projections]
    with torch.enable_grad(), torch.autocast(device_type, enabled=False):
        masks = {
            k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
            for k, v in options.items()
        }
        context, weights = F.multi_head_attention_forward(
            *(t.transpose(0, 1) for t in leaves),
            e,
            module.num_heads,
            None,
            None,
            None,
            None,
            False,
            0.0,
            eye,
            None,
            training=module.training,
            key_padding_mask=masks["key_padding_mask"],
            need_weights=bool(options["need_weights"]),
            attn_mask=masks["attn_mask"],
            use_separate_proj_weight=True,
            q_proj_weight=eye,
            k_proj_weight=eye,
            v_proj_weight=eye,
            average_attn_weights=bool(options["average_attn_weights"]),
            is_causal=bool(options["is_causal"]),
        )
        context = context.transpose(0, 1)  # (B, L, E)
        outputs, grads = [], []
        if grad_out is not None:
            grad_out = grad_out.to(dtype)
            outputs.append(context)
            grads.append(grad_out @ w_out)
        if grad_weights is not None and weights is not None:
            outputs.append(weights)
            grads.append(grad_weights.to(dtype))
        if outputs:
            dq, dk, dv = torch.autograd.grad(outputs, leaves, grads, allow_unused=True)
        else:
            dq = dk = dv = None
    grads_in = [
        torch.zeros_like(p) if g is None else g
        for p, g in zip(projections, (dq, dk, dv), strict=True)
    ]
    blocks = []
    bias_name = None if bias is None else "in_proj_bias"
    for (name, _, _), x, g in zip(
        _projection_weights(module), (query, key, value), grads_in, strict=True
    ):
        blocks.append(_Block(name, bias_name, x.to(dtype), g))
    if grad_out is None:
        grad_out = torch.zeros_like(context)
    out_bias = None if module.out_proj.bias is None else "out_proj.bias"
    blocks.append(_Block("out_proj.weight", out_bias, context.detach(), grad_out))
    return blocks


def _cached_blocks(
    module: nn.MultiheadAttention, activations: tuple, backprops: tuple
) -> list[_Block]:
    return cached_per_step(module, activations[:3], backprops, _blocks, activations)


def _parameter(module: nn.Module, name: str) -> torch.Tensor:
    return module.get_parameter(name)


def _trainable(module: nn.Module, name: str | None) -> bool:
    return name is not None and _parameter(module, name).requires_grad


def attention_norms(
    module: nn.MultiheadAttention, activations: tuple, backprops: tuple
) -> dict[str, torch.Tensor]:
    """‖g_i‖² of every trainable parameter: the sum of its blocks' ghost norms."""
    out: dict[str, torch.Tensor] = {}

    def add(name: str, value: torch.Tensor) -> None:
        out[name] = value if name not in out else out[name] + value

    for block in _cached_blocks(module, activations, backprops):
        if _trainable(module, block.weight):
            add(block.weight, affine_weight_norms(block.inputs, block.grads))
        if _trainable(module, block.bias):
            add(block.bias, affine_bias_norms(block.grads))
    return out


def _assemble(parts: dict[str, list[torch.Tensor]], dim: int) -> dict[str, torch.Tensor]:
    """Each parameter from its blocks: one block as is, a packed one concatenated by rows."""
    return {
        name: pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)
        for name, pieces in parts.items()
    }


def attention_clipped_sum(
    module: nn.MultiheadAttention,
    activations: tuple,
    backprops: tuple,
    factors: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Σ_i f_i g_i of every parameter named in ``factors`` (book-keeping, block by block)."""
    parts: dict[str, list[torch.Tensor]] = {}
    for block in _cached_blocks(module, activations, backprops):
        if block.weight in factors:
            parts.setdefault(block.weight, []).append(
                affine_weight_clipped_sum(block.inputs, block.grads, factors[block.weight])
            )
        if block.bias is not None and block.bias in factors:
            parts.setdefault(block.bias, []).append(
                affine_bias_clipped_sum(block.grads, factors[block.bias])
            )
    return _assemble(parts, 0)


def attention_per_example(
    module: nn.MultiheadAttention, activations: tuple, backprops: tuple
) -> dict[str, torch.Tensor]:
    """The per-example gradients g_i of every trainable parameter, shape (B, *shape)."""
    parts: dict[str, list[torch.Tensor]] = {}
    for block in _cached_blocks(module, activations, backprops):
        if _trainable(module, block.weight):
            parts.setdefault(block.weight, []).append(
                affine_weight_per_example(block.inputs, block.grads)
            )
        if _trainable(module, block.bias):
            parts.setdefault(block.bias, []).append(block.grads.sum(1))
    return _assemble(parts, 1)


def attention_prefers_per_example(
    module: nn.MultiheadAttention, activations: tuple, backprops: tuple
) -> bool:
    """Keep the per-example gradients when every affine map would (the Linear criterion)."""
    query, key = (_records_first(module, t) for t in activations[:2])
    e = module.embed_dim
    return all(
        keeping_per_example_is_cheaper(positions, d_in, e)
        for positions, d_in in (
            (query.shape[1], e),
            (key.shape[1], module.kdim),
            (key.shape[1], module.vdim),
            (query.shape[1], e),
        )
    )


register_layer_rule(
    nn.MultiheadAttention,
    norm_fn=attention_norms,
    clipped_sum_fn=attention_clipped_sum,
    per_example_fn=attention_per_example,
    prefer_per_example=attention_prefers_per_example,
    output_record_dims=attention_output_record_dims,
    check_fn=attention_check,
    applies_fn=attention_applies,
)
