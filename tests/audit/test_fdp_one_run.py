"""Tests of the f-DP one-run bound (Mahloujifar, Melis & Chaudhuri 2024, arXiv:2410.22235).

No table of the paper gives (m, r, v) → μ values that could be checked here, so the references are
independent computations:

* the recursion re-derived in 50-digit arithmetic with mpmath, written out as the paper's two
  sequences (r_i, h_i) without the early stop of the implementation;
* closed forms: at μ = 0 (a mechanism that reveals nothing) the guesses are fair coins, so the tail
  bound can never be below P[Binomial(r, ½) ≥ v];
* Monte Carlo: m independent canaries, each released as μ·b + N(0, 1) (exactly μ-GDP with respect
  to each canary's bit b), guessed by their top (and bottom) scores; the empirical tail of the
  number of correct guesses must stay below the bound, and the bound must exceed the true μ with
  probability at most α (tolerances: 4 binomial standard deviations of the Monte-Carlo estimate).
"""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
from scipy import stats

from dpledger.audit.fdp_one_run import (
    _margin,
    fdp_one_run_epsilon_bound,
    fdp_one_run_mu_bound,
    fdp_one_run_p_value,
    fdp_one_run_rejects,
)
from dpledger.audit.privacy_bounds import (
    GAUSSIAN_TRADEOFF_ASSUMPTION,
    BoundMethod,
    gaussian_dp_epsilon,
    one_run_epsilon_bound,
)
from dpledger.errors import InvalidParameterError

mpmath.mp.dps = 50


def margin_mpmath(m: int, r: int, v: int, mu: float, tau: float) -> mpmath.mpf:
    """r_0 + h_0 − r/m with f̄(x) = Φ(Φ⁻¹(x) − μ), every step of the recursion, 50 digits."""
    mu = mpmath.mpf(mu)
    rs = [mpmath.mpf(0)] * (v + 1)
    hs = [mpmath.mpf(0)] * (v + 1)
    rs[v] = mpmath.mpf(tau) * v / m
    hs[v] = mpmath.mpf(tau) * (r - v) / m
    for i in range(v - 1, -1, -1):
        x = rs[i + 1]
        blow = mpmath.ncdf(-mpmath.sqrt(2) * mpmath.erfinv(1 - 2 * x) - mu) if x < 1 else 1
        hs[i] = max(hs[i + 1], blow)
        rs[i] = min(rs[i + 1] + mpmath.mpf(i) / (r - i) * (hs[i] - hs[i + 1]), 1)
    return rs[0] + hs[0] - mpmath.mpf(r) / m


@pytest.mark.parametrize(
    ("m", "r", "v", "mu", "tau"),
    [
        (20, 10, 9, 1.0, 0.05),
        (50, 50, 40, 0.5, 0.05),
        (100, 20, 18, 1.3, 0.2),
        (8, 4, 4, 2.0, 0.01),
    ],
)
def test_recursion_matches_a_50_digit_evaluation(m, r, v, mu, tau):
    got = _margin(m, r, v, mu, tau)
    want = float(margin_mpmath(m, r, v, mu, tau))
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize(("m", "r", "v"), [(100, 20, 19), (1000, 100, 95), (200, 200, 150)])
def test_mu_bound_is_where_the_50_digit_recursion_changes_sign(m, r, v):
    mu = fdp_one_run_mu_bound(num_canaries=m, num_guesses=r, num_correct=v, confidence=0.95)
    assert mu > 0
    assert margin_mpmath(m, r, v, mu * (1 - 1e-6), 0.05) > 0
    assert margin_mpmath(m, r, v, mu * (1 + 1e-6), 0.05) < 0
    # Every smaller μ is rejected too (the bound is not past a gap in the rejected set).
    for u in np.linspace(0.0, mu * (1 - 1e-6), 40):
        assert fdp_one_run_rejects(
            num_canaries=m, num_guesses=r, num_correct=v, mu=float(u), confidence=0.95
        )


@pytest.mark.parametrize(("r", "v"), [(10, 8), (20, 15), (40, 30), (100, 62)])
def test_at_mu_zero_the_tail_bound_is_at_least_the_fair_coin_tail(r, v):
    """Closed form: a mechanism that reveals nothing makes each guess a fair coin."""
    p = fdp_one_run_p_value(num_canaries=2 * r, num_guesses=r, num_correct=v, mu=0.0)
    assert p >= stats.binom.sf(v - 1, r, 0.5) * (1 - 1e-9)


def _simulate(mu, m, n_pos, n_neg, trials, seed):
    """Correct guesses of the top-n_pos ("included") and bottom-n_neg ("excluded") guesses."""
    rng = np.random.default_rng(seed)
    included = rng.random((trials, m)) < 0.5
    scores = mu * included + rng.standard_normal((trials, m))
    order = np.argsort(-scores, axis=1)
    top = np.take_along_axis(included, order[:, :n_pos], axis=1).sum(axis=1)
    bottom = (~np.take_along_axis(included, order[:, m - n_neg :], axis=1)).sum(axis=1)
    return top + bottom if n_neg else top


@pytest.mark.statistical
@pytest.mark.parametrize(("mu", "m", "n_pos", "n_neg"), [(1.0, 200, 40, 0), (2.0, 100, 10, 10)])
def test_tail_bound_holds_for_a_gaussian_mechanism(mu, m, n_pos, n_neg):
    trials = 20_000
    correct = _simulate(mu, m, n_pos, n_neg, trials, seed=7)
    r = n_pos + n_neg
    for v in range(r // 2, r + 1):
        p = fdp_one_run_p_value(num_canaries=m, num_guesses=r, num_correct=v, mu=mu)
        observed = float(np.mean(correct >= v))
        sd = math.sqrt(max(p * (1 - p), 1.0 / trials) / trials)
        assert observed <= p + 4 * sd, (v, observed, p)


@pytest.mark.statistical
def test_mu_bound_exceeds_the_true_mu_at_most_alpha_of_the_time():
    """The bound exceeds μ_true only if μ_true is rejected, i.e. when V ≥ v_crit."""
    mu, m, r, confidence = 1.0, 200, 40, 0.9
    v_crit = next(
        v
        for v in range(r + 1)
        if fdp_one_run_rejects(num_canaries=m, num_guesses=r, num_correct=v, mu=mu, confidence=0.9)
    )
    trials = 20_000
    correct = _simulate(mu, m, r, 0, trials, seed=11)
    alpha = 1 - confidence
    assert np.mean(correct >= v_crit) <= alpha + 4 * math.sqrt(alpha * (1 - alpha) / trials)
    # Spot check through the public bound: at v_crit it exceeds μ, just below it does not.
    above = fdp_one_run_mu_bound(num_canaries=m, num_guesses=r, num_correct=v_crit, confidence=0.9)
    below = fdp_one_run_mu_bound(
        num_canaries=m, num_guesses=r, num_correct=v_crit - 1, confidence=0.9
    )
    assert below <= mu < above


def test_epsilon_bound_is_the_gdp_epsilon_of_the_mu_bound():
    b = fdp_one_run_epsilon_bound(
        num_canaries=1000, num_guesses=100, num_correct=100, delta=1e-5, confidence=0.95
    )
    mu = fdp_one_run_mu_bound(num_canaries=1000, num_guesses=100, num_correct=100, confidence=0.95)
    assert b.details["mu"] == mu
    assert b.epsilon == gaussian_dp_epsilon(mu, delta=1e-5)
    assert b.method is BoundMethod.FDP_ONE_RUN
    assert b.assumption == GAUSSIAN_TRADEOFF_ASSUMPTION
    assert b.counts == {"m": 1000, "r": 100, "v": 100}
    # The same guesses give a larger ε than the (ε, δ) one-run bound (3.47, Steinke et al.).
    steinke = one_run_epsilon_bound(
        num_canaries=1000, num_guesses=100, num_correct=100, delta=1e-5, confidence=0.95
    )
    assert b.epsilon > steinke.epsilon


def test_no_correct_guess_and_chance_level_guesses_give_zero():
    assert fdp_one_run_mu_bound(num_canaries=10, num_guesses=0, num_correct=0, confidence=0.95) == 0
    assert (
        fdp_one_run_mu_bound(num_canaries=100, num_guesses=50, num_correct=25, confidence=0.95) == 0
    )
    assert fdp_one_run_p_value(num_canaries=10, num_guesses=4, num_correct=0, mu=3.0) == 1.0


def test_bad_inputs_are_refused():
    with pytest.raises(InvalidParameterError, match="num_correct"):
        fdp_one_run_mu_bound(num_canaries=10, num_guesses=4, num_correct=5, confidence=0.95)
    with pytest.raises(InvalidParameterError, match="num_guesses"):
        fdp_one_run_p_value(num_canaries=10, num_guesses=11, num_correct=5, mu=1.0)
    with pytest.raises(InvalidParameterError, match="mu"):
        fdp_one_run_p_value(num_canaries=10, num_guesses=4, num_correct=2, mu=-1.0)
    with pytest.raises(InvalidParameterError, match="confidence"):
        fdp_one_run_rejects(num_canaries=10, num_guesses=4, num_correct=2, mu=1.0, confidence=1)


def test_from_scores_uses_the_same_guesses_for_both_one_run_methods():
    """Guess "included" for the 3 highest of 8 scores: 3 guesses, 2 correct (counted by hand)."""
    from dpledger.audit.threshold_selection import one_run_epsilon_bound_from_scores

    scores = [9.0, 8.0, 7.0, 1.0, 0.5, 0.2, 0.1, 0.0]
    included = np.array([True, False, True, True, False, True, False, False])
    kwargs = {"guess_counts": [(3, 0)], "delta": 1e-5, "confidence": 0.95}
    fdp = one_run_epsilon_bound_from_scores(scores, included, method="fdp_one_run", **kwargs)
    steinke = one_run_epsilon_bound_from_scores(scores, included, method="one_run", **kwargs)
    assert fdp.counts == steinke.counts == {"m": 8, "r": 3, "v": 2}
    assert fdp.method is BoundMethod.FDP_ONE_RUN
    want = fdp_one_run_epsilon_bound(
        num_canaries=8, num_guesses=3, num_correct=2, delta=1e-5, confidence=0.95
    )
    assert fdp.epsilon == want.epsilon
    with pytest.raises(InvalidParameterError, match="method"):
        one_run_epsilon_bound_from_scores(scores, included, method="gaussian_dp", **kwargs)
