"""The hypothesis-testing view of (ε, δ(ε)): the best attacker's true-positive rate at a given
false-positive rate.

An attacker who sees the output of a run and must decide whether a given record was in the
data set (the neighbouring data sets D and D') is a hypothesis test. For a test with type-I
error (false-positive rate) α, the smallest type-II error any test can reach is the trade-off
function β(α); its true-positive rate is TPR = 1 − β(α).

Derivation. A mechanism is (ε, δ)-DP iff every test's errors satisfy α + e^ε β ≥ 1 − δ and
e^ε α + β ≥ 1 − δ (Kairouz, Oh & Viswanath 2015; Dong, Roth & Su 2022, Prop. 2.5). Solving each
for β, and using that β ≥ 0:

    β ≥ max(0, 1 − δ − e^ε α, e^{−ε} (1 − δ − α)).

The mechanism is (ε, δ(ε))-DP for every ε ≥ 0 at once, so β(α) is at least the largest of these
lower bounds over ε:

    β(α) ≥ max over ε ≥ 0 of max(0, 1 − δ(ε) − e^ε α, e^{−ε} (1 − δ(ε) − α)),

with equality when δ(ε) is the mechanism's exact privacy profile (the trade-off function is the
upper envelope of these lines; Dong, Roth & Su 2022, Prop. 2.12). Two facts make the computed
curve safe to show:

* each ε gives a valid lower bound on β by itself, so the maximum over a finite grid of ε is
  still a lower bound on β (it can only understate β, overstate the TPR);
* a larger δ(ε) gives a smaller bound, so a δ(ε) that is an *upper bound* on the true privacy
  profile (the PLD accountant's pessimistic estimate, or the PRV upper bound) gives a β that is
  a lower bound on the true β: the TPR shown is an upper bound on what any attacker achieves.

Check: for the Gaussian mechanism with sensitivity 1 and noise z (no sampling), μ = 1/z,
δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) and the envelope is exactly
TPR(α) = Φ(Φ⁻¹(α) + μ) (Dong, Roth & Su 2022, Cor. 2.13); ``tests/report/test_tradeoff.py``
compares the two.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
from scipy import optimize, special

__all__ = [
    "REPORTED_FPRS",
    "epsilon_grid",
    "gaussian_delta",
    "gaussian_tpr",
    "true_positive_rate",
    "type_two_error",
]

REPORTED_FPRS = (0.01, 0.001)
"""The false-positive rates at which the report states the attacker's true-positive rate."""

DeltaOfEpsilon = Callable[[np.ndarray], np.ndarray]


def _lines(epsilons: np.ndarray, deltas: np.ndarray, alpha: float) -> np.ndarray:
    """The lower bound on β(α) that each (ε, δ(ε)) gives."""
    one_minus = 1.0 - deltas
    return np.maximum.reduce(
        [
            np.zeros_like(epsilons),
            one_minus - np.exp(epsilons) * alpha,
            np.exp(-epsilons) * (one_minus - alpha),
        ]
    )


def epsilon_grid(epsilon_max: float, points: int = 2001) -> np.ndarray:
    """Evenly spaced ε from 0 to ``epsilon_max`` (inclusive), the grid :func:`type_two_error`
    maximises over before it refines each maximum."""
    if not (math.isfinite(epsilon_max) and epsilon_max > 0.0):
        raise ValueError(f"epsilon_max must be finite and > 0, got {epsilon_max!r}")
    return np.linspace(0.0, float(epsilon_max), int(points))


def type_two_error(
    delta_of_epsilon: DeltaOfEpsilon,
    alphas: Sequence[float],
    epsilons: np.ndarray,
    *,
    refine: bool = True,
    deltas: np.ndarray | None = None,
) -> np.ndarray:
    """β(α) = max over ε of max(0, 1 − δ(ε) − e^ε α, e^{−ε}(1 − δ(ε) − α)) (module docstring).

    The maximum is taken over ``epsilons``, then (with ``refine``) refined by a bounded scalar
    search between the grid points either side of the best one. Every candidate is a valid lower
    bound on β when ``delta_of_epsilon`` is an upper bound on the privacy profile, so refining can
    only move the result towards the exact envelope, never past it.

    Args:
        delta_of_epsilon: δ as a function of ε, vectorised over a numpy array of ε ≥ 0.
        alphas: false-positive rates in [0, 1].
        epsilons: the ε grid, sorted, ≥ 0.
        refine: refine each maximum between its neighbouring grid points.
        deltas: δ(ε) at ``epsilons``, when already computed (``delta_of_epsilon`` is then
            called only to refine).

    Returns:
        β at each α, in [0, 1].
    """
    eps = np.asarray(epsilons, dtype=float)
    if deltas is None:
        deltas = np.asarray(delta_of_epsilon(eps), dtype=float)
    deltas = np.clip(np.asarray(deltas, dtype=float), 0.0, 1.0)
    if deltas.shape != eps.shape:
        raise ValueError(f"deltas has shape {deltas.shape}, epsilons {eps.shape}")
    out = np.empty(len(alphas))
    for i, alpha in enumerate(alphas):
        values = _lines(eps, deltas, float(alpha))
        best = int(np.argmax(values))
        beta = float(values[best])
        if refine and len(eps) > 2:
            lo, hi = eps[max(best - 1, 0)], eps[min(best + 1, len(eps) - 1)]

            def negative(e: float, a: float = float(alpha)) -> float:
                d = float(np.clip(delta_of_epsilon(np.array([e]))[0], 0.0, 1.0))
                return -float(_lines(np.array([e]), np.array([d]), a)[0])

            found = optimize.minimize_scalar(
                negative, bounds=(lo, hi), method="bounded", options={"xatol": 1e-10}
            )
            beta = max(beta, -float(found.fun))
        out[i] = min(max(beta, 0.0), 1.0)
    return out


def true_positive_rate(
    delta_of_epsilon: DeltaOfEpsilon,
    alphas: Sequence[float],
    epsilons: np.ndarray,
    *,
    refine: bool = True,
    deltas: np.ndarray | None = None,
) -> np.ndarray:
    """The best attacker's TPR = 1 − β(α) at each false-positive rate α (see
    :func:`type_two_error`); an upper bound when ``delta_of_epsilon`` is one."""
    return 1.0 - type_two_error(delta_of_epsilon, alphas, epsilons, refine=refine, deltas=deltas)


def gaussian_delta(mu: float, epsilons: np.ndarray) -> np.ndarray:
    """The exact privacy profile of μ-GDP: δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2)
    (Balle & Wang 2018, Thm. 8), computed with log-CDFs so that it does not overflow."""
    eps = np.asarray(epsilons, dtype=float)
    first = special.ndtr(-eps / mu + mu / 2.0)
    second = np.exp(eps + special.log_ndtr(-eps / mu - mu / 2.0))
    return np.clip(first - second, 0.0, 1.0)


def gaussian_tpr(mu: float, alphas: Sequence[float]) -> np.ndarray:
    """The exact trade-off of μ-GDP as a TPR: Φ(Φ⁻¹(α) + μ) (Dong, Roth & Su 2022)."""
    return np.asarray(special.ndtr(special.ndtri(np.asarray(alphas, dtype=float)) + mu))
