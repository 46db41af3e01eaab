"""Per-example gradients with Bias-Aware Minimisation's ascent step (Knolle et al., Algorithm 2).

BAM reduces the bias that clipping puts into the private gradient by minimising, per example,
the loss at a point moved uphill by a sharpness-aware (SAM) ascent step of radius λ:

    θ_i = θ + λ · ∇ℓ_i(θ) / ‖∇ℓ_i(θ)‖₂                       (Algorithm 2, line 4; Eq. 14)
    g_i = ∇ℓ_i(θ_i)                                           (line 5)

g_i is then clipped, summed and noised exactly like a DP-SGD gradient (lines 6–7). The ascent
uses only example i's own gradient, so g_i is a function of record i alone and the privacy
analysis is that of DP-SGD with the same clip norm, noise and sampling (the paper, section 6):
BAM changes no event in the ledger.

The per-example ascent needs one model evaluation per example at its own parameters, so BAM runs
on the generic path: ``torch.func.vmap`` over examples of two gradient evaluations (at θ and at
θ_i), materialising g_i (memory O(B·P), about twice the generic path's time). The ascent
direction is ∇ℓ_i over all trainable parameters together; an example whose gradient is zero is
not moved.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn
from torch.func import functional_call, grad, grad_and_value, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from dpledger.errors import InvalidParameterError
from dpledger.validation import check_non_negative_finite

__all__ = ["per_example_gradients_and_losses"]


def per_example_gradients_and_losses(
    model: nn.Module,
    loss_fn: Callable[..., torch.Tensor],
    inputs: Any,
    targets: Any,
    *,
    bam_radius: float = 0.0,
    chunk_size: int | None = None,
    randomness: Literal["different", "same", "error"] = "different",
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per-example gradients g_i (with BAM's ascent of radius λ when λ > 0) and losses ℓ_i(θ).

    Args:
        model: the model; its trainable parameters are differentiated.
        loss_fn: ``loss_fn(output, target) -> scalar`` for one example (run as a batch of one).
        inputs: a tensor, or a tuple of tensors passed positionally, records along dim 0.
        targets: a tensor (or pytree of tensors) with records along dim 0.
        bam_radius: λ ≥ 0; 0 gives the plain per-example gradients ∇ℓ_i(θ).
        chunk_size: examples per ``vmap`` chunk (bounds memory); None for all at once.
        randomness: ``vmap``'s treatment of random operations such as dropout.

    Returns:
        ``({name: (B, *param.shape)}, losses of shape (B,))``; the losses are at θ, detached.
    """
    radius = check_non_negative_finite("bam_radius", bam_radius)
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise InvalidParameterError("chunk_size", chunk_size, "an integer >= 1, or None")
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    buffers = dict(model.named_buffers())
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    batch = args[0].shape[0]
    if batch == 0:
        ref = next(iter(params.values()))
        grads = {n: p.new_zeros((0, *p.shape)) for n, p in params.items()}
        return grads, ref.new_zeros(0)

    def example_loss(p: dict[str, torch.Tensor], x: tuple, y: Any) -> torch.Tensor:
        xb = tuple(t.unsqueeze(0) for t in x)
        leaves, spec = tree_flatten(y)
        yb = tree_unflatten([t.unsqueeze(0) for t in leaves], spec)
        return loss_fn(functional_call(model, (p, buffers), xb), yb)

    def example(p: dict[str, torch.Tensor], x: tuple, y: Any) -> tuple:
        g, loss = grad_and_value(example_loss)(p, x, y)
        if radius == 0.0:
            return g, loss
        sq = sum(v.square().sum() for v in g.values())
        norm = torch.sqrt(sq)
        step = torch.where(
            norm > 0, radius / torch.clamp(norm, min=torch.finfo(norm.dtype).tiny), 0
        )
        moved = {n: p[n] + step * g[n] for n in p}
        return grad(example_loss)(moved, x, y), loss

    grads, losses = vmap(
        example, in_dims=(None, 0, 0), randomness=randomness, chunk_size=chunk_size
    )(params, args, targets)
    return grads, losses.detach()
