"""The trade-off curve derived from δ(ε), against the Gaussian mechanism's closed form."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.special import ndtri

from dpledger.report import tradeoff

ALPHAS = (0.5, 0.1, 0.01, 0.001, 1e-4)
EPS_MAX = 5.0
ULP = np.finfo(float).eps


def _rounding(eps_max: float) -> float:
    """Floating-point error of one candidate line: a few ulp of terms no larger than
    e^ε_max (the Φ and exp evaluations are accurate to a few ulp)."""
    return 16 * ULP * math.exp(eps_max)


def _optimum_inside(mu: float) -> float:
    """An ε_max beyond every line's optimum: the line 1 − δ(ε) − e^ε α is largest where
    −δ'(ε) = e^ε Φ(b) = e^ε α, i.e. b = Φ⁻¹(α), ε* = −μ (Φ⁻¹(α) + μ/2) ≤ −μ Φ⁻¹(min α)."""
    return max(1.0, -mu * float(ndtri(min(ALPHAS)))) + 1.0


def _curvature_bound(mu: float, eps_max: float) -> float:
    """A bound on |∂²/∂ε²| of both candidate lines over ε in [0, eps_max], for μ-GDP.

    With a = −ε/μ + μ/2 and b = −ε/μ − μ/2, φ(a) = e^ε φ(b), so δ'(ε) = −e^ε Φ(b) and
    δ''(ε) = −e^ε Φ(b) + e^ε φ(b)/μ; hence |(1 − δ − e^ε α)''| ≤ e^ε (2 + 1/(μ√(2π))) and
    |(e^(−ε)(1 − δ − α))''| = |e^(−ε)((1 − δ − α) + 2δ' − δ'')| ≤ 1 + 3 + 1/(μ√(2π)).
    """
    return math.exp(eps_max) * (2 + 1 / (mu * math.sqrt(2 * math.pi))) + 4 + 1 / mu


@pytest.mark.parametrize("z", [0.5, 1.0, 1.1, 2.0, 4.0])
def test_tradeoff_of_the_gaussian_mechanism_is_the_closed_form(z: float) -> None:
    mu = 1.0 / z
    exact = tradeoff.gaussian_tpr(mu, ALPHAS)
    eps_max = _optimum_inside(mu)
    grid = tradeoff.epsilon_grid(eps_max, points=20001)
    rounding, curvature = _rounding(eps_max), _curvature_bound(mu, eps_max)

    def delta_of(eps: np.ndarray) -> np.ndarray:
        return tradeoff.gaussian_delta(mu, eps)

    coarse = tradeoff.true_positive_rate(delta_of, ALPHAS, grid, refine=False)
    refined = tradeoff.true_positive_rate(delta_of, ALPHAS, grid)
    # Every ε gives a valid bound: the computed TPR never falls below the exact one.
    assert np.all(coarse >= exact - rounding)
    assert np.all(refined >= exact - rounding)
    # On a grid of spacing h the best grid point is within h/2 of each line's optimum, where
    # its derivative vanishes: the gap is at most C (h/2)² / 2.
    h = grid[1] - grid[0]
    assert np.all(coarse - exact <= curvature * h**2 / 8 + rounding)
    # Brent's search ends within xatol = 1e-10 of the optimum: a gap of C·1e-20 / 2.
    assert np.all(refined - exact <= curvature * 1e-20 / 2 + rounding)


def test_no_privacy_loss_leaves_a_blind_guess() -> None:
    grid = tradeoff.epsilon_grid(1.0, points=11)
    tpr = tradeoff.true_positive_rate(lambda e: np.zeros_like(e), ALPHAS, grid)
    # TPR = 1 − (1 − α) at ε = 0: exact up to the rounding of 1 − α (one ulp of 1).
    np.testing.assert_allclose(tpr, np.asarray(ALPHAS), rtol=0, atol=2 * ULP)


def test_a_larger_delta_profile_gives_a_larger_tpr() -> None:
    # An upper bound on δ(ε) can only overstate the attacker: monotone in δ.
    grid = tradeoff.epsilon_grid(EPS_MAX, points=2001)
    tight = tradeoff.true_positive_rate(lambda e: tradeoff.gaussian_delta(1.0, e), ALPHAS, grid)
    loose = tradeoff.true_positive_rate(
        lambda e: np.minimum(1.0, 1.5 * tradeoff.gaussian_delta(1.0, e)), ALPHAS, grid
    )
    assert np.all(loose >= tight - _rounding(EPS_MAX))


def test_epsilon_grid_refuses_a_bad_maximum() -> None:
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="epsilon_max"):
            tradeoff.epsilon_grid(bad)
