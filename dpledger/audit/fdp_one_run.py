"""One-run audit of a Gaussian trade-off curve (f-DP), beside the (ε, δ) one-run audit.

Mahloujifar, Melis & Chaudhuri (2024, "Auditing f-Differential Privacy in One Run",
arXiv:2410.22235) audit the same single training run as Steinke, Nasr & Jagielski (2023): m
canaries, each included independently with probability ½; the auditor makes r guesses about
which were included (abstaining on the others), v of them correct. Instead of testing an
(ε, δ) hypothesis, they test the whole trade-off curve f of the mechanism with respect to each
canary, which is far tighter for mechanisms whose curve is known in shape (DP-SGD with full
batches is exactly μ-GDP, f = G_μ with G_μ(x) = Φ(Φ⁻¹(1 − x) − μ)).

**The test.** Let f̄(x) = 1 − f(1 − x) be the curve's "inverse blow-up"; for G_μ it is
f̄_μ(x) = Φ(Φ⁻¹(x) − μ). If the mechanism is f-DP and the auditor's chance of at least v correct
guesses is at least τ, then the sequence

    r_v = τ·v/m,  h_v = τ·(r − v)/m,
    h_{i} = max(h_{i+1}, f̄(r_{i+1})),  r_{i} = min(r_{i+1} + i/(r − i)·(h_{i} − h_{i+1}), 1),
    for i = v − 1, …, 0,

ends with r_0 + h_0 ≤ r/m: the paper's recursion for membership guesses with abstentions
(alphabet of two: each guess names a canary's bit, "included" or "excluded"), the
``audit_rh_with_cap`` check of its analysis, also implemented in Meta's PrivacyGuard and in
``jax_privacy.auditing``. So r_0 + h_0 > r/m at τ = α = 1 − confidence means that ≥ v correct
guesses had probability below α under f: the observation rejects f at confidence 1 − α. The cap
at 1 only lowers r_0, which keeps the test valid. The tests check the tail bound against Monte
Carlo for "included" guesses alone and for both kinds of guesses.

**The bound.** :func:`fdp_one_run_mu_bound` reports μ⁻ = the supremum of the μ such that every μ'
in [0, μ] is rejected (found by scanning μ upwards and bisecting the first interval that ends in a
μ not rejected), so μ⁻ > μ_true only if μ_true itself was rejected: with probability at least
1 − α a μ-GDP mechanism has μ ≥ μ⁻. :func:`fdp_one_run_epsilon_bound` turns μ⁻ into ε at δ with
the μ-GDP privacy profile (:func:`~dpledger.audit.privacy_bounds.gaussian_dp_epsilon`); that ε is a
lower bound only under the assumption that the curve is Gaussian (exact for full-batch DP-SGD
steps), which the result records, as for the Gaussian-DP bound of the two-sided audit.

Compared with the (ε, δ) one-run bound on the same guesses: rejecting (ε, δ)-DP needs the
binomial tail of an ε-randomized response plus a δ term paid for every canary (2·m·δ), while the
Gaussian curve has no such term; on white-box DP-SGD canaries the f-DP bound is typically well
above the (ε, δ) one (see ``benchmarks/RESULTS.md``). Neither bound dominates the other in general
(the (ε, δ) test also rejects mechanisms that are not Gaussian), so they are reported side by side.
"""

from __future__ import annotations

import math
from typing import Any

from scipy import optimize, special

from dpledger.audit.privacy_bounds import (
    GAUSSIAN_TRADEOFF_ASSUMPTION,
    BoundMethod,
    EpsilonLowerBound,
    _check_audit_delta,
    _check_confidence,
    _one_run_inputs,
    gaussian_dp_epsilon,
)
from dpledger.errors import InvalidParameterError

__all__ = [
    "fdp_one_run_epsilon_bound",
    "fdp_one_run_mu_bound",
    "fdp_one_run_p_value",
    "fdp_one_run_rejects",
]

_MU_STEP = 0.0625
"""Step of the upward scan over μ before bisection."""

_MU_MAX = 64.0
"""μ beyond which the scan stops (μ = 64 is ε in the thousands at any useful δ)."""


def _check_mu(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise InvalidParameterError("mu", value, "a finite number >= 0")
    return float(value)


def _margin(m: int, r: int, v: int, mu: float, tau: float) -> float:
    """r_0 + h_0 − r/m of the recursion for G_μ at level τ (> 0: rejected)."""
    if v == 0:
        return -math.inf
    rr = tau * v / m
    h = tau * (r - v) / m
    for i in range(v - 1, -1, -1):
        h_new = max(h, float(special.ndtr(special.ndtri(rr) - mu)))
        if h_new == h:
            break  # (r, h) is a fixed point of every remaining step
        rr = min(rr + i / (r - i) * (h_new - h), 1.0)
        h = h_new
    return rr + h - r / m


def fdp_one_run_rejects(
    *, num_canaries: int, num_guesses: int, num_correct: int, mu: float, confidence: float
) -> bool:
    """Whether v correct guesses out of r (m canaries) reject μ-GDP at ``confidence``.

    Args:
        num_canaries: m, canaries each included independently with probability ½.
        num_guesses: r ≤ m, guesses made (abstentions excluded), fixed before the run.
        num_correct: v ≤ r, correct guesses.
        mu: μ ≥ 0 of the null hypothesis (the trade-off curve G_μ).
        confidence: 1 − α in (0, 1).
    """
    m, r, v = _one_run_inputs(num_canaries, num_guesses, num_correct)
    alpha = 1.0 - _check_confidence(confidence)
    return m > 0 and _margin(m, r, v, _check_mu(mu), alpha) > 0.0


def fdp_one_run_p_value(
    *, num_canaries: int, num_guesses: int, num_correct: int, mu: float
) -> float:
    """Upper bound on P[≥ v correct guesses out of r] for any μ-GDP mechanism and auditor.

    The infimum of the τ at which the recursion rejects (it rejects at every larger τ: all its
    terms grow with τ), found by bisection to a relative 1e-10; 1 when even τ = 1 is not
    rejected. ``fdp_one_run_rejects`` is True exactly when this is below α (up to the bisection).
    """
    m, r, v = _one_run_inputs(num_canaries, num_guesses, num_correct)
    mu = _check_mu(mu)
    if m == 0 or v == 0 or _margin(m, r, v, mu, 1.0) <= 0.0:
        return 1.0
    lo, hi = 0.0, 1.0
    while hi - lo > 1e-10 * hi:
        mid = 0.5 * (lo + hi)
        if _margin(m, r, v, mu, mid) > 0.0:
            hi = mid
        else:
            lo = mid
    return hi


def fdp_one_run_mu_bound(
    *, num_canaries: int, num_guesses: int, num_correct: int, confidence: float
) -> float:
    """μ⁻: every μ ≤ μ⁻ is rejected by the guesses at ``confidence`` (0 if μ = 0 is not).

    Args:
        num_canaries: m.
        num_guesses: r ≤ m, fixed before the run.
        num_correct: v ≤ r.
        confidence: 1 − α in (0, 1).
    """
    m, r, v = _one_run_inputs(num_canaries, num_guesses, num_correct)
    alpha = 1.0 - _check_confidence(confidence)
    if m == 0 or _margin(m, r, v, 0.0, alpha) <= 0.0:
        return 0.0
    lo = 0.0
    hi = _MU_STEP
    while _margin(m, r, v, hi, alpha) > 0.0:
        lo, hi = hi, hi + _MU_STEP
        if hi > _MU_MAX:
            return _MU_MAX
    return float(
        optimize.brentq(lambda u: _margin(m, r, v, u, alpha), lo, hi, xtol=1e-10, rtol=1e-12)
    )


def fdp_one_run_epsilon_bound(
    *,
    num_canaries: int,
    num_guesses: int,
    num_correct: int,
    delta: float,
    confidence: float,
) -> EpsilonLowerBound:
    """f-DP one-run lower bound (Mahloujifar, Melis & Chaudhuri 2024) for a Gaussian curve.

    μ⁻ from :func:`fdp_one_run_mu_bound`, then ε = the ε of μ⁻-GDP at δ. ``details["mu"]`` holds
    μ⁻; the result records the Gaussian-curve assumption behind the ε.

    Args:
        num_canaries: m, canaries each included independently with probability ½.
        num_guesses: r ≤ m, guesses made (fixed before seeing which canaries were included).
        num_correct: v ≤ r, correct guesses.
        delta: δ in [0, 1) at which μ⁻ is turned into ε.
        confidence: 1 − α in (0, 1).
    """
    m, r, v = _one_run_inputs(num_canaries, num_guesses, num_correct)
    delta = _check_audit_delta(delta)
    confidence = _check_confidence(confidence)
    mu = fdp_one_run_mu_bound(num_canaries=m, num_guesses=r, num_correct=v, confidence=confidence)
    eps = gaussian_dp_epsilon(mu, delta=delta)
    return EpsilonLowerBound(
        epsilon=eps,
        delta=delta,
        confidence=confidence,
        method=BoundMethod.FDP_ONE_RUN,
        counts={"m": m, "r": r, "v": v},
        selection="guesses fixed in advance",
        assumption=GAUSSIAN_TRADEOFF_ASSUMPTION,
        details={"mu": mu},
    )
