"""The noise of a DP step: its standard deviation is σ·C/(q·n) on every coordinate of the update.

The update of one SGD step with σ > 0 minus the update with σ = 0 from the same parameters and
batch is −lr·noise/(q·n). Divided by its claimed standard deviation it must be D independent
standard normal values; the test is the exact χ² test of Σ z_j² with D degrees of freedom (the
mean is known to be 0), two-sided, at level 1e-3, plus a mean test at 4 standard errors.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from scipy import stats
from torch import nn

from dpledger import PrivacyLedger
from dpledger.adapters.torch import DPOptimizer
from tests.adapters.torch.reference import DEVICES

Q, N, LR = 0.02, 1000, 0.5  # q·n = 20


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(60, 60), nn.Tanh(), nn.Linear(60, 40)).double()


def updates(
    sigma: float, seed: int, device: str = "cpu", **kwargs
) -> tuple[dict[str, torch.Tensor], DPOptimizer]:
    model = mlp().to(device)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    dp = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR),
        model=model,
        l2_norm_bound=0.7,
        noise_multiplier=sigma,
        sampling_probability=Q,
        population_size=N,
        ledger=PrivacyLedger(),
        seed=seed,
        **kwargs,
    )
    g = torch.Generator().manual_seed(11)
    x = torch.randn(23, 60, generator=g, dtype=torch.float64)
    y = torch.randint(0, 40, (23,), generator=g)
    F.cross_entropy(model(x.to(device)), y.to(device)).backward()
    dp.step()
    return {n: (p.detach() - before[n]).cpu() for n, p in model.named_parameters()}, dp


def _chi2_two_sided(z: np.ndarray) -> float:
    k = z.size
    cdf = stats.chi2.cdf(float(np.sum(z * z)), df=k)
    return 2 * min(cdf, 1 - cdf)


@pytest.mark.statistical
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {
            "groups": "per_layer",
            "clip_split": "dimension",
            "noise_allocation": "dimension",
            "scales": {"2.bias": 3.0},
        },
    ],
    ids=["flat", "per_layer_dimension_scaled"],
)
@pytest.mark.parametrize("device", DEVICES)
def test_update_noise_has_standard_deviation_sigma_c_over_qn(kwargs, device):
    """On each device: CUDA draws its noise from its own generator (Philox), not the CPU's."""
    sigma = 1.3
    noisy, dp = updates(sigma, seed=123, device=device, **kwargs)
    clean, _ = updates(0.0, seed=123, device=device, **kwargs)
    zs = []
    for query, members in zip(dp.queries.queries, dp.queries.members, strict=True):
        for name in members:
            alpha = dp.queries.scales.get(name, 1.0)
            expected = LR * alpha * query.noise_stddev / (Q * N)
            zs.append(((noisy[name] - clean[name]) / -expected).reshape(-1).numpy())
    if not kwargs:
        assert dp.queries.queries[0].noise_stddev == sigma * 0.7  # σ̃ = σ·C
    z = np.concatenate(zs)
    assert z.size == sum(p.numel() for p in mlp().parameters())
    assert _chi2_two_sided(z) > 1e-3, f"sample std {z.std():.4f}, expected 1"
    assert abs(z.mean()) < 4 / math.sqrt(z.size)
    for part in zs:  # every block separately, at a level corrected for the number of blocks
        assert _chi2_two_sided(part) > 1e-3 / len(zs)
