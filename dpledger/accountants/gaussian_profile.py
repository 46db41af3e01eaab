"""The privacy profile of the Gaussian mechanism, enclosed after floating-point error.

A Gaussian mechanism whose sensitivity is μ noise standard deviations (μ-GDP) has exactly

    δ_μ(ε) = Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2)

(Balle & Wang 2018, Theorem 8; Dong, Roth & Su 2019, Corollary 2.13), and ε_μ(δ) is its root.
Evaluated naively the two terms cancel: for small μ they agree to about μ·|ε/μ| relative digits,
so the rounding of the arguments and of Φ is amplified by up to 1/(μ·ε/μ) (μ = 1e-6, δ = 1e-100:
ε below the exact value by 2.4e-9 relative), and a root found on that curve is not an upper bound.

Here every step's rounding is bounded and carried, as :mod:`dpledger.accountants.rdp_moments`
does for the RDP moments (``docs/architecture.md``, "Soundness rules", rule 8), under the same
assumption: ``scipy.special.log_ndtr`` is accurate to a few ulp of its magnitude (8 ulp are
allowed), and ``exp``/``expm1``/``log`` to a few ulp of their results.

* The arguments x = −ε/μ ± μ/2 are formed with two roundings: |x̂ − x| ≤ 2.01u(|ε/μ| + μ/2),
  u = 2⁻⁵².
* log Φ is increasing with slope h = φ/Φ ≤ max(−x, 0) + 1 (Birnbaum's bound on the Mills ratio,
  R(t) ≥ (√(t² + 4) − t)/2, gives h(−t) ≤ (t + √(t² + 4))/2 ≤ t + 1), so log Φ(x) lies within
  8u(|log Φ(x̂)| + 1) + (max(−x̂ + Δ, 0) + 1)·Δ of log Φ(x̂), Δ the argument's error bound.
* δ = e^A − e^B with A = log Φ(a), B = ε + log Φ(b) is increasing in A and decreasing in B, so
  the enclosures of A and B give one of log δ = A + log(−expm1(B − A)), each rounding
  (the sum ε + log Φ(b), the difference B − A, the logarithms) widened by its own bound.

:func:`gaussian_log_delta_bounds` returns that enclosure of log δ_μ(ε);
:func:`gaussian_epsilon_bounds` returns ε values certified on either side of ε_μ(δ): the upper
one has a certified δ_μ(upper) ≤ δ (an upper bound on ε after rounding), the lower one a certified
δ_μ(lower) > δ. Both are found by a root search on the enclosure and then moved outwards until
the enclosure proves them. Against an 80-digit evaluation, for μ from 1e-8 to 1e3 and δ from
1e-300 to 0.9, each is within a relative 1e-12 + 3e-13/μ of the exact ε
(``tests/accountants/test_gaussian_profile.py``): the bound is as loose as the cancellation makes
the float64 evaluation (about 1e-13/μ), no looser.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from scipy.optimize import brentq
from scipy.special import log_ndtr

__all__ = ["gaussian_epsilon_bounds", "gaussian_log_delta_bounds"]

_U = 2.0**-52
_C = 8.0  # ulps allowed per library function (log_ndtr, exp, expm1, log)
_FLOOR = -1e4  # log δ values below this are all "far below any δ > 0" for the root search
_HUGE = 1e150


def _log_phi_bounds(x: float, error: float) -> tuple[float, float]:
    """[lo, hi] containing log Φ(x′) for every x′ within ``error`` of ``x``."""
    value = float(log_ndtr(x))
    slope = max(-(x - error), 0.0) + 1.0  # ≥ h = φ/Φ on [x − error, x + error]
    width = _C * _U * (abs(value) + 1.0) + slope * error * (1.0 + 4.0 * _U)
    return value - width, value + width


def _log_difference(a: float, b: float, *, up: bool) -> float:
    """log(e^a − e^b) rounded up (``up``) or down, −inf where it is ≤ 0 (the enclosure's
    rounding of each operation is added outwards)."""
    d = b - a
    d += 2.0 * _U * abs(d) * (-1.0 if up else 1.0)  # the subtraction is off by ≤ u·|d|
    if d >= 0.0:
        return -math.inf
    tail = -math.expm1(d)  # in (0, 1]
    value = a + math.log(tail)
    slack = _C * _U * (abs(value) + abs(a) + 1.0)
    return value + slack if up else value - slack


def gaussian_log_delta_bounds(mu: float, epsilon: float) -> tuple[float, float]:
    """An enclosure [lo, hi] of log δ_μ(ε) after floating-point error (−inf for δ = 0).

    Args:
        mu: μ > 0 (finite).
        epsilon: ε ≥ 0 (finite).
    """
    t = epsilon / mu
    half = 0.5 * mu
    if not abs(t) + half < _HUGE:
        # Φ(−t ± μ/2) with t or μ beyond 1e150: log δ < −1e299, below every δ > 0
        return -math.inf, -1e299
    error = 2.01 * _U * (abs(t) + half)
    a_lo, a_hi = _log_phi_bounds(-t + half, error)
    b_lo, b_hi = _log_phi_bounds(-t - half, error)
    # B = ε + log Φ(b), with the sum's rounding
    big_lo = (epsilon + b_lo) - _U * abs(epsilon + b_lo)
    big_hi = (epsilon + b_hi) + _U * abs(epsilon + b_hi)
    hi = min(_log_difference(a_hi, big_lo, up=True), 0.0)
    lo = _log_difference(a_lo, big_hi, up=False)
    return min(lo, hi), hi


def _outward(start: float, proven: Callable[[float], bool], step_sign: float) -> float:
    """The first ε from ``start`` (moving by doubling steps in ``step_sign``'s direction, and
    never below 0) at which ``proven(ε)`` holds."""
    eps = start
    step = 4.0 * _U * max(abs(start), 1e-300)
    while not proven(eps):
        eps = max(eps + step_sign * step, 0.0)
        step *= 2.0
        if eps == 0.0:
            break
    return eps


def gaussian_epsilon_bounds(mu: float, delta: float) -> tuple[float, float]:
    """(lower, upper) around ε_μ(δ), both certified after floating-point error.

    ``upper`` has δ_μ(upper) ≤ δ proven by :func:`gaussian_log_delta_bounds`, so the μ-GDP
    mechanism is (upper, δ)-DP; ``lower`` is 0 or has δ_μ(lower) > δ proven, so the mechanism
    is not (ε, δ)-DP for any ε ≤ lower. (0, 0) when δ_μ(0) ≤ δ is proven; (0, ∞) for
    μ ≥ 1e150.

    Args:
        mu: μ > 0 (finite).
        delta: δ in (0, 1).
    """
    log_delta = math.log(delta)
    if not mu < _HUGE:
        return 0.0, math.inf

    def upper_gap(eps: float) -> float:
        return max(gaussian_log_delta_bounds(mu, eps)[1], _FLOOR) - log_delta

    def lower_gap(eps: float) -> float:
        return max(gaussian_log_delta_bounds(mu, eps)[0], _FLOOR) - log_delta

    if upper_gap(0.0) <= 0.0:
        return 0.0, 0.0
    hi = max(1.0, mu * mu / 2.0 + mu * math.sqrt(2.0 * -log_delta) + 1.0)
    while upper_gap(hi) > 0.0:
        hi *= 2.0
    tol = 4.0 * _U
    root = float(brentq(upper_gap, 0.0, hi, xtol=1e-300, rtol=tol, maxiter=500))
    upper = _outward(root, lambda e: upper_gap(e) <= 0.0, 1.0)
    if lower_gap(0.0) <= 0.0:
        return 0.0, upper
    root = float(brentq(lower_gap, 0.0, upper, xtol=1e-300, rtol=tol, maxiter=500))
    lower = _outward(root, lambda e: e == 0.0 or lower_gap(e) > 0.0, -1.0)
    return lower, upper
