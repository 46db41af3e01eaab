"""Per-example gradient norms and clipped sums for ``nn.Conv1d`` and ``nn.Conv2d``.

Unfolding example i's (padded) input gives U_i ∈ R^{L×(C_in/g·K)} per group, one row per output
position (K = kernel size, L = number of output positions), and the output gradient is
b_i ∈ R^{(C_out/g)×L} per group, so the per-example weight gradient of a group is G_i = b_i U_i
and the bias gradient is β_i = Σ_l b_il. As for ``nn.Linear``, with output positions in the role
of the sequence, ‖G_i‖² has two routes:

* ghost norm: ‖G_i‖²_F = ⟨U_i U_iᵀ, b_iᵀ b_i⟩_F, O(L²(C_in·K + C_out)/g) per example;
* materialised: G_i = b_i U_i by one batched product, O(L·C_out·C_in·K/g) per example.

:func:`conv_norms` takes the cheaper route and works through the batch in chunks, so the transient
memory stays bounded and no per-example gradient outlives its chunk. The fast-path clipped sum
Σ_i f_i G_i is the ordinary weight gradient of the convolution for the output gradient f_i·b_i,
computed by the same kernel autograd uses (``aten.convolution_backward``), without unfolding
(book-keeping, Bu et al. 2023). Where materialising is cheaper and one G_i is no larger than the
example's stored input and output gradient, :func:`conv_prefers_per_example` asks the engine to
keep the G_i and form the clipped sum as their weighted sum. The unfolding uses a strided view
of the input (``Tensor.unfold``) and one copy, several times faster on CPU than ``F.unfold``.
Padding modes other than zeros and ``padding="same"`` are handled by padding the input
explicitly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from dpledger.adapters.torch.registry import register_layer_rule
from dpledger.errors import InvalidParameterError

__all__ = ["conv_clipped_sum", "conv_norms", "conv_per_example", "conv_prefers_per_example"]

Conv = nn.Conv1d | nn.Conv2d

# The batch is processed in chunks whose unfolded input has at most this many elements: on the
# CPU few enough to stay in cache; on an accelerator many more, since there each chunk costs a
# few kernel launches (the unfolding copy, a batched product, a norm), and for the small
# convolutions of a CNN the launches, not the arithmetic, take the time.
_MAX_CHUNK_ELEMENTS = 1 << 21
_MAX_CHUNK_ELEMENTS_ACCELERATOR = 1 << 26


def _padding_amounts(module: Conv) -> tuple[int, ...]:
    """F.pad amounts (last dimension first) that make the convolution's padding explicit."""
    if isinstance(module.padding, str):
        if module.padding == "valid":
            amounts = [(0, 0) for _ in module.kernel_size]
        else:  # "same": as torch does it, an odd remainder goes to the end of the dimension
            amounts = []
            for d, k in zip(module.dilation, module.kernel_size, strict=True):
                total = d * (k - 1)
                amounts.append((total // 2, total - total // 2))
    else:
        amounts = [(p, p) for p in module.padding]
    flat: list[int] = []
    for left, right in reversed(amounts):
        flat.extend((left, right))
    return tuple(flat)


def _padded_input(module: Conv, x: torch.Tensor) -> torch.Tensor:
    """The input padded as the convolution pads it (zeros or the module's padding mode)."""
    pad = _padding_amounts(module)
    if not any(pad):
        return x
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    return F.pad(x, pad, mode=mode)


def _channels_inner(module: Conv) -> bool:
    """Whether unfolding with the channels innermost copies longer contiguous runs.

    Unfolding copies, for every output position, C/g·K input values. In the input's layout the
    innermost kernel dimension is contiguous (a run of k_w values, 1 with dilation); with the
    input in channels-last layout the C/g channels are (a run of C/g values). The longer run
    makes the copy several times faster; the order of the columns of U only matters for
    materialised gradients, which :func:`_weight_order` restores.
    """
    run_kernel = module.kernel_size[-1] if module.dilation[-1] == 1 else 1
    return module.in_channels // module.groups > run_kernel


def _unfold(module: Conv, xp: torch.Tensor, channels_inner: bool) -> torch.Tensor:
    """U of shape (B, g, L, C_in/g·K) from the padded input.

    Columns are ordered (C/g, *kernel) like the weight, or (*kernel, C/g) if ``channels_inner``.
    """
    batch, groups, nd = xp.shape[0], module.groups, len(module.kernel_size)
    cg = module.in_channels // groups
    first = 1 if channels_inner else 2  # the first spatial dimension
    v = xp.movedim(1, -1).contiguous() if channels_inner else xp
    geometry = zip(module.kernel_size, module.stride, module.dilation, strict=True)
    for i, (k, s, d) in enumerate(geometry):
        v = v.unfold(first + i, d * (k - 1) + 1, s)
        if d > 1:
            v = v[..., ::d]
    positions = math.prod(v.shape[first : first + nd])
    kernel = list(range(3 + nd, 3 + 2 * nd))
    if channels_inner:  # v: (B, *positions, C, *kernel) -> (B, g, *positions, *kernel, C/g)
        v = v.reshape(batch, *v.shape[1 : 1 + nd], groups, cg, *v.shape[2 + nd :])
        v = v.permute(0, 1 + nd, *range(1, 1 + nd), *kernel, 2 + nd)
    else:  # v: (B, C, *positions, *kernel) -> (B, g, *positions, C/g, *kernel)
        v = v.reshape(batch, groups, cg, *v.shape[2:])
        v = v.permute(0, 1, *range(3, 3 + nd), 2, *kernel)
    return v.reshape(batch, groups, positions, cg * math.prod(module.kernel_size))


def _weight_order(module: Conv, g: torch.Tensor, channels_inner: bool) -> torch.Tensor:
    """Per-example gradients (n, g, C_out/g, cols) in the weight's shape (n, *weight.shape)."""
    n = g.shape[0]
    if not channels_inner:
        return g.reshape(n, *module.weight.shape)
    nd = len(module.kernel_size)
    g = g.reshape(n, module.out_channels, *module.kernel_size, module.in_channels // module.groups)
    return g.permute(0, 1, 2 + nd, *range(2, 2 + nd)).reshape(n, *module.weight.shape)


def _grouped_backprops(module: Conv, backprops: torch.Tensor) -> torch.Tensor:
    """b of shape (B, g, C_out/g, L)."""
    return backprops.reshape(
        backprops.shape[0],
        module.groups,
        module.out_channels // module.groups,
        math.prod(backprops.shape[2:]),
    )


def _positions(module: Conv, backprops: torch.Tensor) -> int:
    return math.prod(backprops.shape[2:]) if backprops.dim() > 2 else 1


def _chunks(module: Conv, backprops: torch.Tensor) -> list[tuple[int, int]]:
    batch = backprops.shape[0]
    per_example = module.in_channels * math.prod(module.kernel_size) * _positions(module, backprops)
    budget = (
        _MAX_CHUNK_ELEMENTS if backprops.device.type == "cpu" else _MAX_CHUNK_ELEMENTS_ACCELERATOR
    )
    step = max(1, budget // max(per_example, 1))
    return [(i, min(i + step, batch)) for i in range(0, batch, step)] or [(0, 0)]


def _ghost_is_cheaper(module: Conv, backprops: torch.Tensor) -> bool:
    """L²(k + o) ≤ L·k·o per group: the Gram matrices cost less than materialising G_i."""
    positions = _positions(module, backprops)
    k = module.in_channels // module.groups * math.prod(module.kernel_size)
    o = module.out_channels // module.groups
    return positions * (k + o) <= k * o


def conv_prefers_per_example(module: Conv, activations: tuple, backprops: torch.Tensor) -> bool:
    """Keep the materialised G_i when that is cheaper for the whole step and not larger.

    As for ``nn.Linear`` with L output positions, k = C_in·K/g and o = C_out/g: G_i are kept when
    L²(k + o) > k·o (the fast path's norms plus its convolution-backward clipped sum cost more
    than materialising plus a weighted sum) and one G_i (the weight's size) is no larger than the
    example's stored input and output gradient.
    """
    if backprops.shape[0] == 0:
        return False
    positions = _positions(module, backprops)
    k = module.in_channels // module.groups * math.prod(module.kernel_size)
    o = module.out_channels // module.groups
    stored = activations[0][0].numel() + backprops[0].numel()
    return positions * positions * (k + o) > k * o and module.weight.numel() <= stored


def conv_norms(
    module: Conv,
    activations: tuple,
    backprops: torch.Tensor,
    *,
    method: Literal["auto", "ghost", "per_example"] = "auto",
) -> dict[str, torch.Tensor]:
    """‖G_i‖² and ‖β_i‖² of every example (see the module docstring).

    Args:
        module: the convolution.
        activations: its forward arguments, ``(x,)``.
        backprops: the gradient with respect to its output.
        method: "ghost" (Gram matrices), "per_example" (G_i materialised chunk by chunk) or
            "auto" (the cheaper for these shapes).
    """
    if method not in ("auto", "ghost", "per_example"):
        raise InvalidParameterError("method", method, "'auto', 'ghost' or 'per_example'")
    out: dict[str, torch.Tensor] = {}
    if module.weight.requires_grad:
        ghost = method == "ghost" or (method == "auto" and _ghost_is_cheaper(module, backprops))
        xp = _padded_input(module, activations[0])
        b = _grouped_backprops(module, backprops)
        inner = _channels_inner(module)
        parts = []
        for lo, hi in _chunks(module, backprops):
            u = _unfold(module, xp[lo:hi], inner).flatten(0, 1)  # (n·g, L, k)
            bb = b[lo:hi].flatten(0, 1)  # (n·g, o, L)
            if ghost:
                gram_u = torch.bmm(u, u.transpose(1, 2))
                gram_b = torch.bmm(bb.transpose(1, 2), bb)
                sq = (gram_u * gram_b).sum((1, 2))
            else:
                sq = torch.linalg.vector_norm(torch.bmm(bb, u).flatten(1), dim=1).square()
            parts.append(sq.view(hi - lo, module.groups).sum(1))
        out["weight"] = torch.cat(parts) if len(parts) > 1 else parts[0]
    if module.bias is not None and module.bias.requires_grad:
        out["bias"] = backprops.flatten(2).sum(2).square().sum(1)
    return out


def conv_clipped_sum(
    module: Conv,
    activations: tuple,
    backprops: torch.Tensor,
    factors: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Σ_i f_i G_i as the convolution's weight gradient for the output gradient f_i·b_i."""
    out: dict[str, torch.Tensor] = {}
    batch = backprops.shape[0]
    if "weight" in factors:
        if module.padding_mode == "zeros" and not isinstance(module.padding, str):
            x, padding = activations[0], list(module.padding)
        else:
            x, padding = _padded_input(module, activations[0]), [0] * len(module.kernel_size)
        shape = (batch,) + (1,) * (backprops.dim() - 1)
        scaled = backprops * factors["weight"].view(shape)
        out["weight"] = torch.ops.aten.convolution_backward(
            scaled,
            x,
            scaled.new_empty(1).expand(module.weight.shape),  # only the shape is used
            None,
            list(module.stride),
            padding,
            list(module.dilation),
            False,
            [0] * len(module.kernel_size),
            module.groups,
            (False, True, False),
        )[1]
    if "bias" in factors:
        summed = backprops.flatten(2).sum(2)
        out["bias"] = factors["bias"].view(1, -1).mm(summed).view(-1)
    return out


def conv_per_example(
    module: Conv, activations: tuple, backprops: torch.Tensor
) -> dict[str, torch.Tensor]:
    """G_i of shape (B, *weight.shape) and β_i of shape (B, C_out)."""
    out: dict[str, torch.Tensor] = {}
    if module.weight.requires_grad:
        xp = _padded_input(module, activations[0])
        b = _grouped_backprops(module, backprops)
        inner = _channels_inner(module)
        parts = []
        for lo, hi in _chunks(module, backprops):
            u = _unfold(module, xp[lo:hi], inner).flatten(0, 1)  # (n·g, L, k)
            g = torch.bmm(b[lo:hi].flatten(0, 1), u)  # (n·g, o, k)
            g = g.view(hi - lo, module.groups, module.out_channels // module.groups, u.shape[-1])
            parts.append(_weight_order(module, g, inner))
        out["weight"] = torch.cat(parts) if len(parts) > 1 else parts[0]
    if module.bias is not None and module.bias.requires_grad:
        out["bias"] = backprops.flatten(2).sum(2)
    return out


for _conv_type in (nn.Conv1d, nn.Conv2d):
    register_layer_rule(
        _conv_type,
        norm_fn=conv_norms,
        clipped_sum_fn=conv_clipped_sum,
        per_example_fn=conv_per_example,
        prefer_per_example=conv_prefers_per_example,
    )
