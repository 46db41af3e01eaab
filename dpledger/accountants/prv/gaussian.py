"""The exact privacy profile of the Gaussian mechanism (full-batch steps).

A full-batch step with noise multiplier z is the Gaussian mechanism with sensitivity s (s = 1 for
add/remove, s = 2 for replace-one); its privacy loss is N(μ²/2, μ²) with μ = s/z, and k such steps
with multipliers z_i compose to one Gaussian mechanism with μ² = Σ_i (s/z_i)². Its privacy profile
(Balle & Wang 2018, Theorem 8) is

    δ_μ(ε) = Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2),

evaluated here in log space so that it neither overflows nor cancels at large ε. For small μ its
two terms still cancel: :func:`gaussian_delta` is the float64 value (used inside the composition,
whose error terms bound the rest), :func:`gaussian_delta_bounds` and :func:`gaussian_epsilon` are
certified after floating-point error (:mod:`dpledger.accountants.gaussian_profile`).
"""

from __future__ import annotations

import math

import numpy as np
import scipy.special

from dpledger.accountants.gaussian_profile import gaussian_delta_bounds as _delta_bounds
from dpledger.accountants.gaussian_profile import gaussian_epsilon_bounds

__all__ = ["gaussian_delta", "gaussian_delta_bounds", "gaussian_epsilon"]


def gaussian_delta(epsilon: np.ndarray | float, mu: float) -> np.ndarray:
    """δ_μ(ε) for an array of ε (any real ε; δ_μ(ε) → 1 − e^ε as ε → −∞)."""
    eps = np.asarray(epsilon, dtype=float)
    log_a = scipy.special.log_ndtr(-eps / mu + mu / 2)
    log_b = eps + scipy.special.log_ndtr(-eps / mu - mu / 2)
    with np.errstate(invalid="ignore", over="ignore"):
        out = np.exp(log_a) * -np.expm1(np.minimum(log_b - log_a, 0.0))
    return np.where(np.isfinite(out), out, 0.0)


def gaussian_delta_bounds(epsilon: float, mu: float) -> tuple[float, float]:
    """(lower, upper) around δ_μ(ε) for one ε ≥ 0, certified after floating-point error.

    ``upper`` is never below the exact δ_μ(ε) and ``lower`` never above it
    (:func:`~dpledger.accountants.gaussian_profile.gaussian_delta_bounds`, which states the
    relative margin); (0, 0) for μ = 0 and (1, 1) for μ = ∞.
    """
    if mu == 0.0:
        return 0.0, 0.0
    if not mu < math.inf:
        return 1.0, 1.0
    return _delta_bounds(mu, float(epsilon))


def gaussian_epsilon(delta: float, mu: float) -> tuple[float, float]:
    """(lower, upper): a tight bracket of the ε at which δ_μ(ε) = δ (ε ≥ 0), certified after
    floating-point error.

    ``upper`` has δ_μ(upper) ≤ δ and ``lower`` has δ_μ(lower) > δ (or is 0), both proven by an
    enclosure of the closed form that bounds every rounding
    (:func:`~dpledger.accountants.gaussian_profile.gaussian_epsilon_bounds`): the two terms of
    δ_μ(ε) cancel for small μ, so δ_μ as computed by :func:`gaussian_delta` cannot certify them.
    """
    return gaussian_epsilon_bounds(mu, delta)
