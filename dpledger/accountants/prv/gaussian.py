"""The exact privacy profile of the Gaussian mechanism (full-batch steps).

A full-batch step with noise multiplier z is the Gaussian mechanism with sensitivity s (s = 1 for
add/remove, s = 2 for replace-one); its privacy loss is N(μ²/2, μ²) with μ = s/z, and k such steps
with multipliers z_i compose to one Gaussian mechanism with μ² = Σ_i (s/z_i)². Its privacy profile
(Balle & Wang 2018, Theorem 8) is

    δ_μ(ε) = Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2),

evaluated here in log space so that it neither overflows nor cancels at large ε.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.optimize
import scipy.special

__all__ = ["gaussian_delta", "gaussian_epsilon"]


def gaussian_delta(epsilon: np.ndarray | float, mu: float) -> np.ndarray:
    """δ_μ(ε) for an array of ε (any real ε; δ_μ(ε) → 1 − e^ε as ε → −∞)."""
    eps = np.asarray(epsilon, dtype=float)
    log_a = scipy.special.log_ndtr(-eps / mu + mu / 2)
    log_b = eps + scipy.special.log_ndtr(-eps / mu - mu / 2)
    with np.errstate(invalid="ignore", over="ignore"):
        out = np.exp(log_a) * -np.expm1(np.minimum(log_b - log_a, 0.0))
    return np.where(np.isfinite(out), out, 0.0)


def gaussian_epsilon(delta: float, mu: float) -> tuple[float, float]:
    """(lower, upper): a tight bracket of the ε at which δ_μ(ε) = δ (ε ≥ 0).

    ``upper`` satisfies δ_μ(upper) ≤ δ and ``lower`` satisfies δ_μ(lower) > δ (or is 0).
    """

    def excess(eps: float) -> float:
        return math.log(max(float(gaussian_delta(eps, mu)), 1e-320)) - math.log(delta)

    if excess(0.0) <= 0:
        return 0.0, 0.0
    hi = max(1.0, mu * mu / 2 + mu * math.sqrt(2 * math.log(1 / delta)) + 1.0)
    while excess(hi) > 0:
        hi *= 2
    root = scipy.optimize.brentq(excess, 0.0, hi, xtol=1e-13 * max(1.0, hi), rtol=1e-15)
    upper = root
    step = 1e-12 * max(1.0, root)
    while excess(upper) > 0:
        upper += step
        step *= 2
    lower = root
    step = 1e-12 * max(1.0, root)
    while lower > 0 and excess(lower) <= 0:
        lower = max(0.0, lower - step)
        step *= 2
    return lower, upper
