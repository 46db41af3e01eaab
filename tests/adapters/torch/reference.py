"""Independent references for the engine tests: gradients of one example at a time."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def loop_per_example_grads(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: tuple[torch.Tensor, ...],
    targets: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """g_i = ∇ loss_fn(model(x_i), y_i), each example run on its own as a batch of one."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    batch = targets.shape[0]
    rows: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    for i in range(batch):
        out = model(*(x[i : i + 1] for x in inputs))
        grads = torch.autograd.grad(loss_fn(out, targets[i : i + 1]), params, allow_unused=True)
        for n, p, g in zip(names, params, grads, strict=True):
            rows[n].append(torch.zeros_like(p) if g is None else g)
    return {
        n: torch.stack(v) if v else p.new_zeros((0, *p.shape))
        for (n, v), p in zip(rows.items(), params, strict=True)
    }


def squared_norms(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: g.flatten(1).square().sum(1) for n, g in grads.items()}


def weighted_sum(grads: dict[str, torch.Tensor], f: torch.Tensor) -> dict[str, torch.Tensor]:
    return {n: torch.einsum("b,b...->...", f.to(g.dtype), g) for n, g in grads.items()}


def assert_close_dicts(got: dict, want: dict, **tol) -> None:
    assert list(got) == list(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], msg=lambda m, n=n: f"{n}: {m}", **tol)
