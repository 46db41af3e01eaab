"""A closed-form-safe RDP upper bound, used only when a PRV numerical check fails.

For the Poisson-subsampled Gaussian under add/remove, the Rényi divergence of integer order α ≥ 2
is (Mironov, Talwar & Zhang 2019, §3.3)

    ε_α = 1/(α − 1) · log Σ_{k=0}^{α} C(α, k)·(1 − q)^{α−k}·q^k·exp((k² − k)/(2z²)),

composition adds ε_α over steps, a Gaussian part of parameter μ adds α·μ²/2, and
ε = min_α ε_α + log((α − 1)/α) − (log δ + log α)/(α − 1) converts to (ε, δ)-DP (Canonne, Kamath &
Steinke 2020, Prop. 12). Everything is computed with log-sum-exp, so it cannot overflow.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import scipy.special

__all__ = ["FALLBACK_ORDERS", "rdp_epsilon"]

FALLBACK_ORDERS = np.array([*range(2, 64), 80, 96, 128, 160, 192, 256, 384, 512, 1024], dtype=float)


def _subsampled_gaussian_rdp(q: float, z: float, order: int) -> float:
    k = np.arange(order + 1, dtype=float)
    log_terms = (
        scipy.special.gammaln(order + 1)
        - scipy.special.gammaln(k + 1)
        - scipy.special.gammaln(order - k + 1)
        + (order - k) * math.log1p(-q)
        + k * math.log(q)
        + (k * k - k) / (2 * z * z)
    )
    return float(scipy.special.logsumexp(log_terms)) / (order - 1)


def rdp_epsilon(
    runs: Sequence[tuple[float, float, int]], gaussian_mu: float, delta: float
) -> tuple[float, float]:
    """(ε, optimal order) of the RDP bound for Poisson-subsampled Gaussian runs (add/remove).

    Args:
        runs: (q, z, count) with 0 < q < 1.
        gaussian_mu: μ of the full-batch part (0 for none).
        delta: target δ.
    """
    best = (math.inf, math.nan)
    for order in FALLBACK_ORDERS:
        a = int(order)
        rdp = a * gaussian_mu * gaussian_mu / 2
        for q, z, count in runs:
            rdp += count * _subsampled_gaussian_rdp(q, z, a)
        eps = rdp + math.log1p(-1 / a) - (math.log(delta) + math.log(a)) / (a - 1)
        if eps < best[0]:
            best = (max(eps, 0.0), float(a))
    return best
