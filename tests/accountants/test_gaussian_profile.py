"""The closed-form Gaussian ε is certified after floating-point error: against δ_μ(ε) evaluated
with mpmath at 80 digits, the upper ε of ``gdp_epsilon`` and of PRV's ``gaussian_epsilon`` is
never below the exact ε(δ) (δ_μ(upper) ≤ δ exactly), the lower one never above it, and each is
within a relative 1e-12 + 3e-13/μ of it (the cancellation of the two terms of δ_μ grows like 1/μ;
μ = 1e-6, δ = 1e-100 was below the exact value by 2.4e-9 relative)."""

from __future__ import annotations

import math

import mpmath
import pytest

from dpledger.accountants.gaussian_profile import (
    gaussian_epsilon_bounds,
    gaussian_log_delta_bounds,
)
from dpledger.accountants.gdp import gdp_epsilon
from dpledger.accountants.prv.gaussian import gaussian_epsilon
from tests.gdp_oracle import gaussian_epsilon as oracle_epsilon

MUS = [1e-8, 1e-6, 1e-4, 1e-2, 0.3, 1.0, 3.0, 10.0, 100.0, 1e3]
DELTAS = [1e-300, 1e-100, 1e-30, 1e-10, 1e-5, 1e-2, 0.3, 0.9]


def exact_delta(mu: float, epsilon: float) -> mpmath.mpf:
    """δ_μ(ε) at 80 digits, from the float arguments exactly as given."""
    with mpmath.workdps(80):
        m, e = mpmath.mpf(mu), mpmath.mpf(epsilon)
        return mpmath.ncdf(-e / m + m / 2) - mpmath.exp(e) * mpmath.ncdf(-e / m - m / 2)


def margin(mu: float) -> float:
    return 1e-12 + 3e-13 / mu


@pytest.mark.parametrize("mu", MUS)
def test_the_gaussian_epsilon_is_certified_against_80_digits(mu: float) -> None:
    for delta in DELTAS:
        upper = gdp_epsilon(mu, delta)
        lower, prv_upper = gaussian_epsilon(delta, mu)
        assert prv_upper == upper and 0.0 <= lower <= upper
        # never below the exact ε: δ_μ(upper) ≤ δ exactly
        assert exact_delta(mu, upper) <= delta, (mu, delta, upper)
        # the lower one is certified too: δ_μ(lower) > δ exactly, unless it is 0
        assert lower == 0.0 or exact_delta(mu, lower) > delta, (mu, delta, lower)
        if upper > 0.0:  # and not above the exact ε by more than the margin
            assert exact_delta(mu, upper / (1.0 + margin(mu))) > delta, (mu, delta, upper)
        if exact_delta(mu, 0.0) > delta:
            assert lower > 0.0 and exact_delta(mu, lower * (1.0 + margin(mu))) <= delta


def test_the_reviewed_setting_is_no_longer_below_the_exact_value() -> None:
    """μ = 1e-6, δ = 1e-100: the root of δ_μ as float64 computes it is below the exact ε (by
    about 2e-9 relative); the certified one is not."""
    naive = oracle_epsilon(1e-6, 1e-100)
    assert exact_delta(1e-6, naive) > 1e-100
    upper = gdp_epsilon(1e-6, 1e-100)
    assert exact_delta(1e-6, upper) <= 1e-100 and upper > naive


@pytest.mark.parametrize("mu", [1e-8, 1e-3, 1.0, 50.0])
@pytest.mark.parametrize("epsilon", [0.0, 1e-9, 1e-3, 0.5, 10.0, 400.0])
def test_the_log_delta_enclosure_contains_the_exact_value(mu: float, epsilon: float) -> None:
    lo, hi = gaussian_log_delta_bounds(mu, epsilon)
    exact = exact_delta(mu, epsilon)
    with mpmath.workdps(80):
        log_exact = mpmath.log(exact) if exact > 0 else -mpmath.inf
    assert lo <= log_exact <= hi
    # where δ is a float, its enclosure is narrow (hi − lo ≈ its relative width)
    assert hi - lo < 1e-5 or hi < -700.0


def test_huge_mu_gives_an_infinite_upper_bound() -> None:
    assert gaussian_epsilon_bounds(1e200, 1e-5) == (0.0, math.inf)
    assert gdp_epsilon(math.inf, 1e-5) == math.inf and gdp_epsilon(0.0, 1e-5) == 0.0
