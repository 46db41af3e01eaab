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

:func:`gaussian_delta_bounds` returns the same enclosure of δ_μ(ε) itself (the exponentials
rounded outwards): its upper end is never below the exact δ and, wherever the exact δ is at
least 1e-300, above it by less than a relative 64u·(1 + x)²·(1 + (1 + ε/μ)/μ), x = ε/μ + μ/2
(the argument rounding, amplified by the cancellation like 1/μ; 8e-5 at μ = 1e-10, ε = 0, and
below 1e-10 for μ ≥ 1 at δ ≥ 1e-300). The ε bounds are proven on it, so ε and δ agree: the upper
end of δ at the upper ε is at most δ.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from scipy.optimize import brentq
from scipy.special import log_ndtr

__all__ = ["gaussian_delta_bounds", "gaussian_epsilon_bounds", "gaussian_log_delta_bounds"]

_U = 2.0**-52
_C = 8.0  # ulps allowed per library function (log_ndtr, exp, expm1, log)
_FLOOR = -1e4  # log δ values below this are all "far below any δ > 0" for the root search
_HUGE = 1e150
_TINY = _C * 5e-324  # a few subnormal ulps: exp's absolute error where its result is subnormal


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
    if not half < _HUGE:
        return -math.inf, 0.0  # μ beyond 1e150: δ is within a float of 1; only δ ≤ 1 is claimed
    if not abs(t) + half < _HUGE:
        # t beyond 1e150 with μ below 2e150: Φ(−t + μ/2) ≤ Φ(−t/2), so log δ < −1e299
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


def gaussian_delta_bounds(mu: float, epsilon: float) -> tuple[float, float]:
    """An enclosure [lower, upper] of δ_μ(ε) after floating-point error, within [0, 1].

    The exponentials of :func:`gaussian_log_delta_bounds`, rounded outwards: ``upper`` is never
    below the exact δ_μ(ε) (and never 0, even where the exact value is below the float range),
    ``lower`` never above it. Where the exact δ is at least 1e-300, ``upper`` exceeds it by less
    than a relative 64u·(1 + x)²·(1 + (1 + ε/μ)/μ), x = ε/μ + μ/2, u = 2⁻⁵² (module docstring).

    Args:
        mu: μ > 0 (finite).
        epsilon: ε ≥ 0 (finite).
    """
    lo, hi = gaussian_log_delta_bounds(mu, epsilon)
    upper = min(1.0, math.exp(hi) * (1.0 + _C * _U) + _TINY)
    lower = max(0.0, math.exp(lo) * (1.0 - _C * _U) - _TINY)
    return lower, upper


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

    ``upper`` has δ_μ(upper) ≤ δ proven by :func:`gaussian_delta_bounds` (its upper end is
    at most δ), so the μ-GDP mechanism is (upper, δ)-DP; ``lower`` is 0 or has δ_μ(lower) > δ
    proven (the lower end is above δ), so the mechanism is not (ε, δ)-DP for any ε ≤ lower.
    (0, 0) when δ_μ(0) ≤ δ is proven; (0, ∞) for μ ≥ 1e150.

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

    # the root searches run on log δ; what is returned is proven on δ itself, the value
    # gaussian_delta_bounds gives (so δ(ε) of the same enclosure never contradicts this ε)
    def upper_proven(eps: float) -> bool:
        return gaussian_delta_bounds(mu, eps)[1] <= delta

    def lower_proven(eps: float) -> bool:
        return eps == 0.0 or gaussian_delta_bounds(mu, eps)[0] > delta

    if upper_proven(0.0):
        return 0.0, 0.0
    hi = max(1.0, mu * mu / 2.0 + mu * math.sqrt(2.0 * -log_delta) + 1.0)
    while not upper_proven(hi):
        hi *= 2.0
    tol = 4.0 * _U
    root = float(brentq(upper_gap, 0.0, hi, xtol=1e-300, rtol=tol, maxiter=500))
    upper = _outward(root, upper_proven, 1.0)
    if not gaussian_delta_bounds(mu, 0.0)[0] > delta:
        return 0.0, upper
    root = float(brentq(lower_gap, 0.0, upper, xtol=1e-300, rtol=tol, maxiter=500))
    lower = _outward(root, lower_proven, -1.0)
    return lower, upper
