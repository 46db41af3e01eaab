"""The closed-form Gaussian ε is certified after floating-point error: against δ_μ(ε) evaluated
with mpmath at 80 digits, the upper ε of ``gdp_epsilon`` and of PRV's ``gaussian_epsilon`` is
never below the exact ε(δ) (δ_μ(upper) ≤ δ exactly), the lower one never above it, and each is
within a relative 1e-12 + 3e-13/μ of it (the cancellation of the two terms of δ_μ grows like 1/μ;
μ = 1e-6, δ = 1e-100 was below the exact value by 2.4e-9 relative). The same holds for δ at a
given ε (``gdp_delta``, PRV's ``gaussian_delta_bounds`` and the accountants' closed-form δ):
never below the exact value, within the relative margin ``gaussian_delta_bounds`` states."""

from __future__ import annotations

import math

import mpmath
import pytest

from dpledger import PrivacyLedger
from dpledger.accountants import make_accountant
from dpledger.accountants.gaussian_profile import (
    gaussian_epsilon_bounds,
    gaussian_log_delta_bounds,
)
from dpledger.accountants.gdp import gdp_delta, gdp_epsilon
from dpledger.accountants.prv.gaussian import gaussian_delta_bounds, gaussian_epsilon
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


# ------------------------------------------------------------------ δ at a given ε
DELTA_MUS = [1e-10, 1e-8, 1e-6, 1e-4, 1e-2, 0.3, 1.0, 3.0, 10.0, 100.0, 1e3, 1e4]
T_VALUES = [0.0, 1e-6, 1e-3, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 37.0]
U = 2.0**-52


def delta_margin(mu: float, epsilon: float) -> float:
    """The relative margin ``gaussian_delta_bounds`` states: 64u(1 + x)²(1 + (1 + ε/μ)/μ)."""
    x = epsilon / mu + mu / 2
    return 64 * U * (1 + x) ** 2 * (1 + (1 + epsilon / mu) / mu)


def extreme_epsilons(mu: float) -> list[float]:
    """ε from 0 to where δ_μ(ε) leaves the float range: ε = tμ and μ²/2 ± tμ (the loss's
    mean ± t standard deviations), and a few absolute values."""
    out = {0.0, 1e-9, 1e-3, 0.5, 10.0, 400.0}
    for t in T_VALUES:
        out |= {t * mu, mu * mu / 2 + t * mu, max(0.0, mu * mu / 2 - t * mu)}
    return sorted(out)


@pytest.mark.parametrize("mu", DELTA_MUS)
def test_the_gaussian_delta_is_certified_against_80_digits(mu: float) -> None:
    """``gdp_delta`` and PRV's ``gaussian_delta_bounds`` at extreme μ and ε: the upper δ is never
    below δ_μ(ε) at 80 digits, the lower one never above it, and where δ ≥ 1e-300 each is within
    the stated relative margin of it. The float64 closed form was below the exact value (by
    3.5e-6 relative at μ = 1e-6, ε = 3e-5)."""
    for eps in extreme_epsilons(mu):
        exact = exact_delta(mu, eps)
        upper = gdp_delta(mu, eps)
        lower, prv_upper = gaussian_delta_bounds(eps, mu)
        assert prv_upper == upper and 0.0 <= lower <= upper <= 1.0
        assert upper >= exact and lower <= exact, (mu, eps, upper, lower)
        if exact >= 1e-300:
            rel = delta_margin(mu, eps)
            assert upper <= exact * (1 + rel) and lower >= exact * (1 - rel), (mu, eps)


@pytest.mark.parametrize("mu", [1e-8, 1e-6, 1e-3, 1.0, 30.0])
def test_the_certified_epsilon_and_delta_agree(mu: float) -> None:
    """ε(δ) and δ(ε) of the same closed form never contradict each other: the δ certified at the
    certified ε is at most δ, and the δ at the certified lower ε is above δ."""
    for delta in DELTAS:
        lower, upper = gaussian_epsilon(delta, mu)
        assert gdp_delta(mu, upper) <= delta
        assert lower == 0.0 or gaussian_delta_bounds(lower, mu)[0] > delta


@pytest.mark.parametrize("name", ["gdp", "pld", "prv"])
@pytest.mark.parametrize(("z", "epsilon"), [(1e6, 3e-5), (1e6, 1e-5), (1e4, 0.02)])
def test_accountants_delta_of_full_batch_steps_is_never_below_the_exact_value(
    name: str, z: float, epsilon: float
) -> None:
    """Four full-batch steps at a huge noise multiplier are one Gaussian mechanism with
    μ = 2/z; each accountant answers δ(ε) with the closed form and its upper bound is never
    below the 80-digit value (nor its lower bound above it)."""
    ledger = PrivacyLedger()
    for _ in range(4):
        ledger.record_sample(sampling_probability=1.0)
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=z)
    answer = make_accountant(name).delta(ledger, epsilon=epsilon)
    exact = exact_delta(2.0 / z, epsilon)
    assert answer.upper is not None and answer.upper >= exact
    assert answer.lower is None or answer.lower <= exact


def test_huge_mu_gives_delta_one() -> None:
    assert gdp_delta(1e200, 0.5) == 1.0 and gaussian_delta_bounds(0.5, 1e200)[1] == 1.0
    assert gaussian_delta_bounds(0.5, 0.0) == (0.0, 0.0)
    assert gaussian_delta_bounds(0.5, math.inf) == (1.0, 1.0)
