"""The closed form of a Gaussian mechanism's (ε, δ) curve, an oracle for the tests.

A Gaussian mechanism whose sensitivity is μ standard deviations (μ-GDP) has exactly

    δ(ε) = Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2)

(Balle & Wang 2018, Theorem 8; Dong, Roth & Su 2019, Corollary 2.13). The second term is formed
as exp(ε + log Φ(·)) so that it neither overflows nor loses its digits for large ε; ε(δ) is its
root, found by bisection to 1e-14.
"""

from __future__ import annotations

import math

from scipy.optimize import brentq
from scipy.special import log_ndtr, ndtr


def gaussian_delta(mu: float, epsilon: float) -> float:
    """Exact δ(ε) of μ-GDP."""
    second = math.exp(epsilon + float(log_ndtr(-epsilon / mu - mu / 2)))
    return float(ndtr(-epsilon / mu + mu / 2)) - second


def gaussian_epsilon(mu: float, delta: float) -> float:
    """Exact ε(δ) of μ-GDP: the root of δ(ε) = δ (0 when δ(0) ≤ δ already)."""
    if gaussian_delta(mu, 0.0) <= delta:
        return 0.0
    high = 1.0
    while gaussian_delta(mu, high) > delta:
        high *= 2.0
    return float(brentq(lambda e: gaussian_delta(mu, e) - delta, 0.0, high, xtol=1e-14, rtol=1e-14))
