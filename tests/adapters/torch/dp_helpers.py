"""Small models, data and reference computations for the DP optimizer tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from tests.adapters.torch.reference import loop_per_example_grads


class SmallCNN(nn.Module):
    """Conv2d, GroupNorm, Linear layers (all with grad samplers) on 1×6×6 inputs, 3 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.norm = nn.GroupNorm(2, 4)
        self.fc1 = nn.Linear(4 * 4 * 4, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.conv(x))).flatten(1)
        return self.fc2(torch.tanh(self.fc1(h)))


def small_cnn(seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    return SmallCNN().to(dtype)


def batch(size: int, seed: int = 1, dtype: torch.dtype = torch.float64) -> tuple:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 1, 6, 6, generator=g, dtype=dtype) * 2
    y = torch.randint(0, 3, (size,), generator=g)
    return x, y


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def per_example(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """g_i of the cross-entropy of each example, by a loop over the examples."""
    return loop_per_example_grads(model, F.cross_entropy, (x,), y)


def clipped_sum(
    grads: dict[str, torch.Tensor],
    groups: list[tuple[str, ...]],
    bounds: list[float],
    *,
    rule: str = "flat",
    scales: dict[str, float] | None = None,
    stability: float = 0.01,
) -> dict[str, torch.Tensor]:
    """Σ_i f_ig g_ig with f from each group's (scaled) norm, computed example by example."""
    scales = scales or {}
    batch_size = next(iter(grads.values())).shape[0]
    out = {n: torch.zeros_like(g[0]) for n, g in grads.items()}
    for i in range(batch_size):
        for members, bound in zip(groups, bounds, strict=True):
            norm = torch.sqrt(
                sum((grads[n][i] / scales.get(n, 1.0)).square().sum() for n in members)
            ).item()
            if rule == "flat":
                f = min(1.0, bound / norm) if norm > 0 else 1.0
            elif rule == "global":
                f = 1.0 if norm <= bound else 0.0
            else:
                f = bound / (norm + stability)
            for n in members:
                out[n] += f * grads[n][i]
    return out
