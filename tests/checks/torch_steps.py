"""Hand-written PyTorch DP-SGD steps (correct and deliberately buggy) for the check tests.

Per-example gradients come from ``torch.func.vmap(grad(...))``; clipping is flat (the whole
parameter vector of one example is clipped to C); the noise N(0, (σC)² I) is added to the sum and
the result divided by the realised batch size B or a fixed denominator D.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.func import functional_call, grad, vmap

__all__ = ["BUGS", "make_adam_step", "make_dp_sgd_step", "mlp"]

BUGS = {
    None: "correct DP-SGD",
    "no_clip": "no clipping",
    "clip_mean": "clips the batch-mean gradient instead of each example's",
    "uncalibrated": "noise N(0, σ²) instead of N(0, (σC)²)",
    "noise_over_batch": "noise standard deviation σC/B",
}


def mlp(n_in: int = 10, n_out: int = 3, hidden: int = 16) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(n_in, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, n_out)
    )


def _loss_fn(loss: str):
    if loss == "mse":
        return torch.nn.functional.mse_loss
    return torch.nn.functional.cross_entropy  # accepts class indices and probabilities


def _noisy_update(model, x, y, *, c, s, generator, loss, bug, denominator):
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    loss_fn = _loss_fn(loss)

    def one(p: dict[str, Any], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, p, (xi.unsqueeze(0),))
        return loss_fn(out, yi.unsqueeze(0))

    grads = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    b = x.shape[0]
    flat = torch.cat([grads[n].reshape(b, -1) for n in names], dim=1)
    d = float(b if denominator is None else denominator)
    std = {"uncalibrated": s, "noise_over_batch": s * c / b}.get(bug, s * c)
    noise = torch.randn(flat.shape[1], generator=generator, dtype=flat.dtype) * std
    if bug == "no_clip":
        update = (flat.sum(0) + noise) / d
    elif bug == "clip_mean":
        mean = flat.sum(0) / d
        update = mean * torch.clamp(c / (mean.norm() + 1e-12), max=1.0) + noise / d
    else:
        factor = torch.clamp(c / (flat.norm(dim=1, keepdim=True) + 1e-12), max=1.0)
        update = ((flat * factor).sum(0) + noise) / d
    out, i = {}, 0
    for n in names:
        k = params[n].numel()
        out[n] = update[i : i + k].reshape(params[n].shape)
        i += k
    return out


def make_dp_sgd_step(*, loss: str = "mse", bug: str | None = None, denominator=None):
    """A plain DP-SGD step function with the protocol of ``check_dp_sgd``."""
    assert bug in BUGS

    def step(model, x, y, *, l2_norm_bound, noise_multiplier, lr, generator):
        upd = _noisy_update(
            model,
            x,
            y,
            c=l2_norm_bound,
            s=noise_multiplier,
            generator=generator,
            loss=loss,
            bug=bug,
            denominator=denominator,
        )
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in upd:
                    p.sub_(lr * upd[n])

    return step


def make_adam_step(*, loss: str = "mse", bug: str | None = None, denominator=None):
    """``make_step(model)`` for DP-Adam: the noisy gradient is handed to torch.optim.Adam."""
    assert bug in BUGS

    def make_step(model):
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)

        def step(model, x, y, *, l2_norm_bound, noise_multiplier, lr, generator):
            upd = _noisy_update(
                model,
                x,
                y,
                c=l2_norm_bound,
                s=noise_multiplier,
                generator=generator,
                loss=loss,
                bug=bug,
                denominator=denominator,
            )
            for group in opt.param_groups:
                group["lr"] = lr
            for n, p in model.named_parameters():
                if n in upd:
                    p.grad = upd[n].clone()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    return make_step


# module-level step functions for the command-line tests
correct_mse_step = make_dp_sgd_step(loss="mse")
correct_ce_step = make_dp_sgd_step(loss="cross_entropy")
clip_mean_mse_step = make_dp_sgd_step(loss="mse", bug="clip_mean")
correct_adam_mse = make_adam_step(loss="mse")


def small_mlp() -> torch.nn.Module:
    return mlp(10, 3)
