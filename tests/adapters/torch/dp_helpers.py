"""Small models, data and reference computations for the DP optimizer tests."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from dpledger import PrivacyLedger
from dpledger.adapters.torch import DPOptimizer
from tests.adapters.torch.reference import loop_per_example_grads


class SmallCNN(nn.Module):
    """Conv2d, GroupNorm, Linear layers (all with layer rules) on 1×6×6 inputs, 3 classes."""

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


def assert_dp_step_equals_clipped_loop(
    make_model: Callable[[], nn.Module], x: torch.Tensor, y: torch.Tensor
) -> DPOptimizer:
    """One noiseless DPOptimizer step moves the parameters by the clipped per-example loop's sum.

    The clip bound is the median per-example norm, so that some records are clipped and some are
    not; the step's update must be lr · Σ_i f_i g_i / (q·n) with f_i from a float64 loop.
    Returns the optimizer, for checks of its engine.
    """
    torch.manual_seed(0)
    model = make_model().double()
    ref = make_model().double()
    ref.load_state_dict(model.state_dict())
    before = params_of(model)
    grads = loop_per_example_grads(ref, F.cross_entropy, (x,), y)
    norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in grads.values()))
    bound = float(norms.median())
    assert (norms < bound).any() and (norms > bound).any()  # some records clipped, some not
    q, n, lr = 0.05, 200, 0.3
    dp = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr),
        model=model,
        l2_norm_bound=bound,
        noise_multiplier=0.0,
        sampling_probability=q,
        population_size=n,
        ledger=PrivacyLedger(),
    )
    dp.zero_grad()
    F.cross_entropy(model(x), y).backward()
    dp.step()
    want = clipped_sum(grads, [tuple(grads)], [bound])
    for name, p in model.named_parameters():
        expected = before[name] - lr * want[name] / (q * n)
        torch.testing.assert_close(p.detach(), expected, rtol=1e-10, atol=1e-12)
    return dp
