"""Monte-Carlo privacy estimates of balls-in-bins sampling (Chua et al. 2025).

References checked here:

* k = 1 batch per epoch: the pair is N(1, σ²) against N(0, σ²), the Gaussian mechanism, whose
  δ(ε) is Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) with μ = √E/σ after E epochs (Balle & Wang 2018,
  "Improving the Gaussian Mechanism for Differential Privacy", Theorem 8).
* k = 2, one epoch: the hockey-stick divergences of (1/2)(N(e₁, σ²I) + N(e₂, σ²I)) and
  N(0, σ²I) in both directions by two-dimensional quadrature (scipy), in coordinates where the
  region on which the integrand is positive has a closed-form boundary.

Tolerances: the estimate is an average of ``samples`` independent values in [0, 1]; by the central
limit theorem it lies within 5 of its estimated standard errors of the exact value except with
probability ~6e-7 per check (the seeds are fixed, so each check is deterministic).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
from scipy.integrate import quad
from scipy.optimize import brentq
from scipy.stats import norm

from dpledger.accountants.balls_in_bins import (
    BallsInBinsEstimate,
    balls_in_bins_delta,
    balls_in_bins_epsilon,
)
from dpledger.errors import InvalidParameterError

N = 200_000
SEED = 20250101


def _gaussian_delta(epsilon: float, sigma: float, epochs: int = 1) -> float:
    """δ(ε) of E compositions of the Gaussian mechanism (sensitivity 1, noise σ)."""
    mu = math.sqrt(epochs) / sigma
    return float(
        norm.cdf(-epsilon / mu + mu / 2) - math.exp(epsilon) * norm.cdf(-epsilon / mu - mu / 2)
    )


def _log_arccosh(log_c: float) -> float:
    """arccosh(e^{log_c}) for log_c ≥ 0, without overflow."""
    if log_c > 30.0:
        return log_c + math.log(2.0)
    return math.acosh(math.exp(log_c))


def _two_batch_divergences(epsilon: float, sigma: float) -> tuple[float, float]:
    """D_{e^ε}(P‖Q) and D_{e^ε}(Q‖P) for k = 2, one epoch, by 2-D quadrature.

    In u = (x₁ + x₂)/√2, v = (x₁ − x₂)/√2 the means e₁, e₂ are (a, ±a), a = 1/√2, and
    p/q = exp((u·a − a²)/σ²)·cosh(v·a/σ²): the integrand (p − e^ε q)_+ is positive exactly for
    |v| > v₀(u), and (q − e^ε p)_+ for |v| < v₁(u), both symmetric in v.
    """
    a = 1.0 / math.sqrt(2.0)
    s2 = sigma * sigma

    def phi(x: float) -> float:
        return math.exp(-x * x / (2 * s2)) / (sigma * math.sqrt(2 * math.pi))

    def p(u: float, v: float) -> float:
        return phi(u - a) * 0.5 * (phi(v - a) + phi(v + a))

    def q(u: float, v: float) -> float:
        return phi(u) * phi(v)

    def remove_inner(u: float) -> float:
        log_c = epsilon - (u * a - a * a) / s2
        v0 = 0.0 if log_c <= 0.0 else s2 / a * _log_arccosh(log_c)
        value, _ = quad(lambda v: p(u, v) - math.exp(epsilon) * q(u, v), v0, math.inf)
        return 2.0 * value

    def add_inner(u: float) -> float:
        log_c = -epsilon - (u * a - a * a) / s2
        if log_c <= 0.0:
            return 0.0
        v1 = s2 / a * _log_arccosh(log_c)
        value, _ = quad(lambda v: q(u, v) - math.exp(epsilon) * p(u, v), 0.0, v1)
        return 2.0 * value

    span = 14.0 * sigma + 2.0
    points = list(np.linspace(-span, span, 15))
    remove, _ = quad(remove_inner, -span, span, points=points, limit=200, epsabs=1e-12)
    add, _ = quad(add_inner, -span, span, points=points, limit=200, epsabs=1e-12)
    return remove, add


def _two_batch_delta(epsilon: float, sigma: float) -> float:
    return max(_two_batch_divergences(epsilon, sigma))


# --------------------------------------------------------------------------- references
@pytest.mark.parametrize(("sigma", "epsilon"), [(0.8, 0.5), (1.0, 1.0), (2.0, 0.3), (0.6, 3.0)])
def test_one_batch_is_the_gaussian_mechanism(sigma: float, epsilon: float) -> None:
    got = balls_in_bins_delta(epsilon, sigma, 1, samples=N, seed=SEED)
    exact = _gaussian_delta(epsilon, sigma)
    assert abs(got.estimate - exact) <= 5.0 * got.standard_error, (got, exact)
    assert got.upper_confidence >= exact


@pytest.mark.parametrize("epochs", [2, 5])
def test_epochs_compose_as_the_product_pair(epochs: int) -> None:
    sigma, epsilon = 2.0, 1.0
    got = balls_in_bins_delta(epsilon, sigma, 1, epochs=epochs, samples=N, seed=SEED)
    exact = _gaussian_delta(epsilon, sigma, epochs)
    assert abs(got.estimate - exact) <= 5.0 * got.standard_error, (got, exact)
    assert got.upper_confidence >= exact


def test_quadrature_oracle_is_consistent() -> None:
    # at ε = 0 both directions are the total variation distance, computed over complementary
    # regions with different integrands: they must agree
    for sigma in (0.5, 1.0, 2.0):
        remove, add = _two_batch_divergences(0.0, sigma)
        assert remove == pytest.approx(add, rel=1e-8)
    # two batches hide the record better than one (the one-batch pair is the Gaussian)
    for sigma, epsilon in ((1.0, 0.5), (0.7, 1.0)):
        assert _two_batch_delta(epsilon, sigma) < _gaussian_delta(epsilon, sigma)


@pytest.mark.parametrize(("sigma", "epsilon"), [(0.8, 0.5), (1.0, 1.0), (1.5, 0.2)])
def test_two_batches_match_two_dimensional_quadrature(sigma: float, epsilon: float) -> None:
    got = balls_in_bins_delta(epsilon, sigma, 2, samples=N, seed=SEED)
    exact = _two_batch_delta(epsilon, sigma)
    assert abs(got.estimate - exact) <= 5.0 * got.standard_error, (got, exact)
    assert got.upper_confidence >= exact


@pytest.mark.slow
def test_epsilon_for_a_target_delta_matches_the_gaussian() -> None:
    sigma, target = 1.0, 1e-2
    got = balls_in_bins_epsilon(target, sigma, 1, samples=N, seed=SEED)
    exact = brentq(lambda e: _gaussian_delta(e, sigma) - target, 0.0, 50.0, xtol=1e-14)
    # δ's error of 5 standard errors moves ε by 5·SE / |dδ/dε|, dδ/dε = −e^ε Φ(−ε/μ − μ/2)
    slope = math.exp(exact) * norm.cdf(-exact * sigma - 0.5 / sigma)
    assert abs(got.estimate - exact) <= 5.0 * got.standard_error / slope + 1e-8, (got, exact)
    assert got.upper_confidence >= exact
    # the returned ε meets the target with the estimate; a slightly smaller one does not
    at = balls_in_bins_delta(got.estimate, sigma, 1, samples=N, seed=SEED)
    assert at.estimate <= target
    below = balls_in_bins_delta(got.estimate * (1 - 1e-6), sigma, 1, samples=N, seed=SEED)
    assert below.estimate > target
    ucb = balls_in_bins_delta(got.upper_confidence, sigma, 1, samples=N, seed=SEED)
    assert ucb.upper_confidence <= target


# --------------------------------------------------------------------------- sanity
@pytest.mark.slow
def test_more_batches_amplify_and_stay_below_the_gaussian() -> None:
    sigma, epsilon, epochs = 1.0, 1.0, 2
    gaussian = _gaussian_delta(epsilon, sigma, epochs)
    previous = None
    for k in (1, 2, 4, 8, 16):
        got = balls_in_bins_delta(epsilon, sigma, k, epochs=epochs, samples=N, seed=SEED)
        assert got.estimate <= gaussian + 5.0 * got.standard_error
        if previous is not None:
            spread = 5.0 * math.hypot(got.standard_error, previous.standard_error)
            assert got.estimate < previous.estimate - spread, (k, got, previous)
        previous = got
    assert previous.estimate < gaussian / 10


@pytest.mark.slow
def test_same_seed_same_numbers_other_seed_other_numbers() -> None:
    a = balls_in_bins_delta(0.5, 1.0, 4, epochs=2, samples=50_000, seed=7)
    b = balls_in_bins_delta(0.5, 1.0, 4, epochs=2, samples=50_000, seed=7)
    c = balls_in_bins_delta(0.5, 1.0, 4, epochs=2, samples=50_000, seed=8)
    assert a == b
    assert a.estimate != c.estimate
    assert abs(a.estimate - c.estimate) <= 5.0 * math.hypot(a.standard_error, c.standard_error)
    e1 = balls_in_bins_epsilon(1e-2, 1.0, 4, samples=50_000, seed=7)
    assert e1 == balls_in_bins_epsilon(1e-2, 1.0, 4, samples=50_000, seed=7)
    assert (a.samples, a.seed, a.confidence) == (50_000, 7, 0.99)


@pytest.mark.parametrize(
    ("epsilon", "sigma", "k", "epochs"),
    [(0.0, 1.0, 3, 1), (0.5, 0.7, 5, 3), (2.0, 1.0, 10, 1), (8.0, 0.5, 2, 2), (1.0, 3.0, 50, 1)],
)
def test_upper_confidence_is_above_the_estimate(
    epsilon: float, sigma: float, k: int, epochs: int
) -> None:
    got = balls_in_bins_delta(epsilon, sigma, k, epochs=epochs, samples=20_000, seed=SEED)
    assert 0.0 <= got.estimate <= got.upper_confidence <= 1.0
    # Chernoff–Hoeffding is never tighter than the one-sided CLT interval at the same level
    # (up to the square-root-of-variance difference for small means): at least one SE above
    assert got.upper_confidence >= got.estimate + got.standard_error
    eps = balls_in_bins_epsilon(1e-2, sigma, k, epochs=epochs, samples=20_000, seed=SEED)
    assert 0.0 <= eps.estimate <= eps.upper_confidence


def test_more_confidence_raises_the_bound() -> None:
    low = balls_in_bins_delta(1.0, 1.0, 4, samples=20_000, seed=SEED, confidence=0.9)
    high = balls_in_bins_delta(1.0, 1.0, 4, samples=20_000, seed=SEED, confidence=0.999)
    assert low.estimate == high.estimate
    assert low.upper_confidence < high.upper_confidence


def test_unreachable_target_gives_an_infinite_upper_confidence() -> None:
    # with 100 draws the bound on δ is at least 1 − 0.005^{1/100} ≈ 0.052 whatever ε is
    got = balls_in_bins_epsilon(1e-3, 1.0, 2, samples=100, seed=SEED)
    assert math.isinf(got.upper_confidence)
    assert math.isfinite(got.estimate)


def test_zero_epsilon_where_the_target_is_met_at_zero() -> None:
    got = balls_in_bins_epsilon(0.9, 10.0, 4, samples=10_000, seed=SEED)
    assert got.estimate == 0.0 == got.upper_confidence


@pytest.mark.parametrize(
    ("call", "parameter"),
    [
        (lambda: balls_in_bins_delta(-1.0, 1.0, 2, samples=10, seed=0), "epsilon"),
        (lambda: balls_in_bins_delta(math.inf, 1.0, 2, samples=10, seed=0), "epsilon"),
        (lambda: balls_in_bins_delta(1.0, 0.0, 2, samples=10, seed=0), "noise_multiplier"),
        (lambda: balls_in_bins_delta(1.0, 1.0, 0, samples=10, seed=0), "num_batches"),
        (lambda: balls_in_bins_delta(1.0, 1.0, 2.0, samples=10, seed=0), "num_batches"),
        (lambda: balls_in_bins_delta(1.0, 1.0, 2, epochs=0, samples=10, seed=0), "epochs"),
        (lambda: balls_in_bins_delta(1.0, 1.0, 2, samples=1, seed=0), "samples"),
        (lambda: balls_in_bins_delta(1.0, 1.0, 2, samples=10, seed=-1), "seed"),
        (lambda: balls_in_bins_delta(1.0, 1.0, 2, samples=10, seed=1.5), "seed"),
        (
            lambda: balls_in_bins_delta(1.0, 1.0, 2, samples=10, seed=0, confidence=1.0),
            "confidence",
        ),
        (lambda: balls_in_bins_epsilon(0.0, 1.0, 2, samples=10, seed=0), "delta"),
        (lambda: balls_in_bins_epsilon(1.0, 1.0, 2, samples=10, seed=0), "delta"),
    ],
)
def test_bad_input_is_refused_with_a_typed_error(
    call: Callable[[], object], parameter: str
) -> None:
    with pytest.raises(InvalidParameterError) as info:
        call()
    assert info.value.parameter == parameter


def test_result_is_frozen() -> None:
    got = balls_in_bins_delta(1.0, 1.0, 2, samples=100, seed=0)
    assert isinstance(got, BallsInBinsEstimate)
    with pytest.raises(AttributeError):
        got.estimate = 0.0  # type: ignore[misc]
