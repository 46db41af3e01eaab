"""Tests of the ε lower bounds against values computed independently here."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_mechanism
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from dpledger.audit.privacy_bounds import (
    BoundMethod,
    ConfusionCounts,
    EpsilonLowerBound,
    bound_from_counts,
    clopper_pearson_epsilon_bound,
    clopper_pearson_upper,
    gaussian_dp_delta,
    gaussian_dp_epsilon,
    gaussian_dp_epsilon_bound,
    gaussian_dp_mu_bound,
    one_run_epsilon_bound,
    one_run_p_value,
)
from dpledger.errors import InvalidParameterError

# ------------------------------------------------------------------ independent reference values


def cp_upper_by_hand(k: int, n: int, level: float) -> float:
    """Clopper–Pearson one-sided upper bound: the level-quantile of Beta(k + 1, n − k)."""
    if k == n:
        return 1.0
    return stats.beta(k + 1, n - k).ppf(level)


def cp_epsilon_by_hand(tp, fp, fn, tn, delta, confidence) -> float:
    level = 1 - (1 - confidence) / 2
    fpr = cp_upper_by_hand(fp, fp + tn, level)
    fnr = cp_upper_by_hand(fn, tp + fn, level)
    candidates = [0.0]
    if 1 - delta - fnr > 0:
        candidates.append(math.log((1 - delta - fnr) / fpr))
    if 1 - delta - fpr > 0:
        candidates.append(math.log((1 - delta - fpr) / fnr))
    return max(candidates)


def one_run_eps_by_hand(m, r, v, delta, confidence) -> float:
    """Steinke et al. (2023) Appendix D, written out as a loop and a bisection."""

    def p_value(eps):
        q = 1 / (1 + math.exp(-eps))
        beta = sum(stats.binom.pmf(k, r, q) for k in range(v, r + 1))
        alpha, acc = 0.0, 0.0
        for i in range(1, v + 1):
            acc += stats.binom.pmf(v - i, r, q)
            alpha = max(alpha, acc / i)
        return min(beta + alpha * delta * 2 * m, 1.0)

    p = 1 - confidence
    lo, hi = 0.0, 1.0
    while p_value(hi) < p:
        hi += 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if p_value(mid) < p:
            lo = mid
        else:
            hi = mid
    return lo


# ------------------------------------------------------------------ Clopper–Pearson


@pytest.mark.parametrize(
    ("tp", "fp", "fn", "tn"),
    [(480, 20, 20, 480), (50, 5, 450, 495), (300, 100, 200, 400), (7, 0, 3, 10), (0, 0, 10, 10)],
)
@pytest.mark.parametrize("delta", [0.0, 1e-5, 0.01])
@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.999])
def test_clopper_pearson_matches_beta_quantiles(tp, fp, fn, tn, delta, confidence):
    b = clopper_pearson_epsilon_bound(
        ConfusionCounts(tp=tp, fp=fp, fn=fn, tn=tn), delta=delta, confidence=confidence
    )
    assert b.epsilon == pytest.approx(
        cp_epsilon_by_hand(tp, fp, fn, tn, delta, confidence), rel=1e-12, abs=1e-12
    )
    assert b.method is BoundMethod.CLOPPER_PEARSON
    assert b.confidence == confidence
    assert b.delta == delta
    assert b.counts == {"tp": tp, "fp": fp, "fn": fn, "tn": tn}
    level = 1 - (1 - confidence) / 2
    assert b.details["fpr_upper"] == pytest.approx(cp_upper_by_hand(fp, fp + tn, level))
    assert b.details["per_rate_confidence"] == pytest.approx(level)


def test_tramer_case_study_numbers():
    # Tramèr et al. 2022, §3: 174 false positives and 4,922 true positives out of 100,000 models
    # per side; at a joint p < 1e-10 the paper reports FPR ≲ 274/1e5, TPR > 4491/1e5 (both
    # rounded to whole counts) and ε > 2.79.
    counts = ConfusionCounts(tp=4922, fp=174, fn=100_000 - 4922, tn=100_000 - 174)
    b = clopper_pearson_epsilon_bound(counts, delta=1e-5, confidence=1 - 1e-10)
    assert round(b.details["fpr_upper"] * 1e5) == 274
    assert math.floor((1 - b.details["fnr_upper"]) * 1e5) == 4491
    assert 2.79 < b.epsilon < 2.80


@pytest.mark.parametrize("n", [10, 100, 1000])
@pytest.mark.parametrize("confidence", [0.95, 0.99])
def test_perfect_separation_gives_the_clopper_pearson_ceiling(n, confidence):
    delta = 1e-5
    alpha = 1 - confidence
    u = 1 - (alpha / 2) ** (1 / n)  # closed form of Beta(1, n).ppf(1 − α/2)
    ceiling = math.log((1 - delta - u) / u)
    b = clopper_pearson_epsilon_bound(
        ConfusionCounts(tp=n, fp=0, fn=0, tn=n), delta=delta, confidence=confidence
    )
    assert b.epsilon == pytest.approx(ceiling, rel=1e-10)


def test_zero_counts_and_one_sided_data_are_vacuous():
    for counts in [
        ConfusionCounts(tp=0, fp=0, fn=0, tn=0),
        ConfusionCounts(tp=100, fp=0, fn=0, tn=0),  # no runs without the canary
        ConfusionCounts(tp=0, fp=0, fn=0, tn=100),  # no runs with it
    ]:
        b = clopper_pearson_epsilon_bound(counts, delta=1e-5, confidence=0.95)
        assert b.epsilon == 0.0
        assert b.vacuous
        g = gaussian_dp_epsilon_bound(counts, delta=1e-5, confidence=0.95)
        assert g.epsilon == 0.0


def test_large_delta_makes_the_bound_vacuous_not_negative():
    counts = ConfusionCounts(tp=60, fp=40, fn=40, tn=60)
    b = clopper_pearson_epsilon_bound(counts, delta=0.9, confidence=0.95)
    assert b.epsilon == 0.0
    assert not math.isnan(b.epsilon)
    # Even perfect separation is vacuous once δ exceeds 1 − 2·u.
    b = clopper_pearson_epsilon_bound(
        ConfusionCounts(tp=50, fp=0, fn=0, tn=50), delta=0.99, confidence=0.95
    )
    assert b.epsilon == 0.0


def test_bound_is_below_the_empirical_ratio():
    counts = ConfusionCounts(tp=900, fp=100, fn=100, tn=900)
    b = clopper_pearson_epsilon_bound(counts, delta=0.0, confidence=0.95)
    assert 0 < b.epsilon < math.log(0.9 / 0.1)


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        ({"tp": -1, "fp": 0, "fn": 0, "tn": 0}, "tp"),
        ({"tp": 0, "fp": -3, "fn": 0, "tn": 0}, "fp"),
        ({"tp": 0, "fp": 0, "fn": 1.0, "tn": 0}, "fn"),
        ({"tp": 0, "fp": 0, "fn": 0, "tn": True}, "tn"),
    ],
)
def test_bad_counts_are_refused(kwargs, parameter):
    with pytest.raises(InvalidParameterError) as info:
        ConfusionCounts(**kwargs)
    assert info.value.parameter == parameter


@pytest.mark.parametrize("confidence", [0.0, 1.0, 1.5, -0.1, float("nan"), True, "0.95"])
def test_bad_confidence_is_refused(confidence):
    counts = ConfusionCounts(tp=1, fp=1, fn=1, tn=1)
    for fn in (clopper_pearson_epsilon_bound, gaussian_dp_epsilon_bound):
        with pytest.raises(InvalidParameterError) as info:
            fn(counts, delta=1e-5, confidence=confidence)
        assert info.value.parameter == "confidence"
    with pytest.raises(InvalidParameterError):
        one_run_epsilon_bound(
            num_canaries=10, num_guesses=5, num_correct=5, delta=0.0, confidence=confidence
        )


@pytest.mark.parametrize("delta", [-1e-9, 1.0, 2.0, float("nan"), None])
def test_bad_delta_is_refused(delta):
    counts = ConfusionCounts(tp=1, fp=1, fn=1, tn=1)
    for fn in (clopper_pearson_epsilon_bound, gaussian_dp_epsilon_bound):
        with pytest.raises(InvalidParameterError) as info:
            fn(counts, delta=delta, confidence=0.95)
        assert info.value.parameter == "delta"
    with pytest.raises(InvalidParameterError) as info:
        one_run_epsilon_bound(
            num_canaries=10, num_guesses=5, num_correct=5, delta=delta, confidence=0.95
        )
    assert info.value.parameter == "delta"


def test_counts_must_be_confusion_counts():
    with pytest.raises(InvalidParameterError):
        clopper_pearson_epsilon_bound((1, 2, 3, 4), delta=0.0, confidence=0.9)


def test_clopper_pearson_upper_vectorised_and_edges():
    k = np.array([0, 3, 10])
    n = np.array([10, 10, 10])
    got = clopper_pearson_upper(k, n, confidence=0.9)
    want = [cp_upper_by_hand(int(a), int(b), 0.9) for a, b in zip(k, n, strict=True)]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert clopper_pearson_upper(0, 0, confidence=0.9) == 1.0
    with pytest.raises(InvalidParameterError):
        clopper_pearson_upper(5, 3, confidence=0.9)
    with pytest.raises(InvalidParameterError):
        clopper_pearson_upper(0.5, 3, confidence=0.9)


def test_confusion_counts_from_scores():
    s_in = [3.0, 2.0, 1.0, 0.5]
    s_out = [0.0, 1.0, -1.0]
    c = ConfusionCounts.from_scores(s_in, s_out, threshold=1.0)
    assert c.as_dict() == {"tp": 3, "fn": 1, "fp": 1, "tn": 2}
    assert c.positives == 4 and c.negatives == 3
    with pytest.raises(InvalidParameterError):
        ConfusionCounts.from_scores([1.0, float("inf")], s_out, threshold=0.0)
    with pytest.raises(InvalidParameterError):
        ConfusionCounts.from_scores(s_in, s_out, threshold=float("nan"))


def test_result_is_frozen_and_serialisable():
    b = clopper_pearson_epsilon_bound(
        ConfusionCounts(tp=10, fp=0, fn=0, tn=10), delta=1e-5, confidence=0.95
    )
    with pytest.raises(AttributeError):
        b.epsilon = 10.0  # type: ignore[misc]
    d = b.to_dict()
    assert d["method"] == "clopper_pearson"
    assert d["counts"] == {"tp": 10, "fp": 0, "fn": 0, "tn": 10}
    assert b.alpha == pytest.approx(0.05)


# ------------------------------------------------------------------ monotonicity (hypothesis)

count = st.integers(min_value=0, max_value=400)


@settings(max_examples=60, deadline=None)
@given(tp=count, fp=count, fn=count, tn=count, extra=st.integers(1, 50))
@pytest.mark.parametrize("method", ["clopper_pearson", "gaussian_dp"])
def test_bounds_are_monotone_in_the_counts(method, tp, fp, fn, tn, extra):
    def eps(**c):
        return bound_from_counts(
            ConfusionCounts(**c), method=method, delta=1e-5, confidence=0.95
        ).epsilon

    base = eps(tp=tp, fp=fp, fn=fn, tn=tn)
    tol = 1e-9 * max(1.0, base)
    assert base >= 0.0
    # More correct guesses can only raise the bound, more errors only lower it.
    assert eps(tp=tp + extra, fp=fp, fn=fn, tn=tn) >= base - tol
    assert eps(tp=tp, fp=fp, fn=fn, tn=tn + extra) >= base - tol
    assert eps(tp=tp, fp=fp + extra, fn=fn, tn=tn) <= base + tol
    assert eps(tp=tp, fp=fp, fn=fn + extra, tn=tn) <= base + tol


@settings(max_examples=40, deadline=None)
@given(r=st.integers(1, 200), frac=st.floats(0.0, 1.0), extra=st.integers(1, 20))
def test_one_run_bound_is_monotone(r, frac, extra):
    m = 1000
    v = round(frac * r)

    def eps(m=m, r=r, v=v):
        return one_run_epsilon_bound(
            num_canaries=m, num_guesses=r, num_correct=v, delta=1e-5, confidence=0.95
        ).epsilon

    base = eps()
    tol = 1e-8
    if v + extra <= r:
        assert eps(v=v + extra) >= base - tol  # more correct guesses
    assert eps(r=r + extra) <= base + tol  # more guesses, as many correct
    assert eps(m=m + 100 * extra) <= base + tol  # more canaries: larger δ term


# ------------------------------------------------------------------ one run


def test_one_run_acceptance_value():
    # m = 1000 canaries, 100 guesses all correct, δ = 1e-5, 95% confidence: about 3.47.
    b = one_run_epsilon_bound(
        num_canaries=1000, num_guesses=100, num_correct=100, delta=1e-5, confidence=0.95
    )
    assert round(b.epsilon, 2) == 3.47
    assert b.epsilon == pytest.approx(one_run_eps_by_hand(1000, 100, 100, 1e-5, 0.95), abs=1e-9)
    assert b.method is BoundMethod.ONE_RUN
    assert b.counts == {"m": 1000, "r": 100, "v": 100}


@pytest.mark.parametrize(
    ("m", "r", "v", "delta"),
    [(1000, 100, 90, 1e-5), (200, 50, 40, 1e-3), (1000, 300, 200, 0.0), (5000, 500, 450, 1e-6)],
)
@pytest.mark.slow
def test_one_run_matches_appendix_d(m, r, v, delta):
    b = one_run_epsilon_bound(
        num_canaries=m, num_guesses=r, num_correct=v, delta=delta, confidence=0.95
    )
    assert b.epsilon == pytest.approx(one_run_eps_by_hand(m, r, v, delta, 0.95), abs=1e-8)


def test_one_run_p_value_without_delta_is_a_binomial_tail():
    p = one_run_p_value(num_canaries=100, num_guesses=20, num_correct=15, epsilon=1.0, delta=0.0)
    q = math.exp(1.0) / (1 + math.exp(1.0))
    assert p == pytest.approx(stats.binom.sf(14, 20, q), rel=1e-12)


def test_one_run_edge_cases():
    # No guesses, or chance-level guesses: nothing shown.
    for r, v in [(0, 0), (100, 50), (100, 0)]:
        b = one_run_epsilon_bound(
            num_canaries=1000, num_guesses=r, num_correct=v, delta=1e-5, confidence=0.95
        )
        assert b.epsilon == 0.0
    # 2mδ > 1: the analysis is not monotone; reported as 0, with a note.
    b = one_run_epsilon_bound(
        num_canaries=1000, num_guesses=100, num_correct=100, delta=0.01, confidence=0.95
    )
    assert b.epsilon == 0.0
    assert "2·m·δ" in b.details["note"]
    with pytest.raises(InvalidParameterError) as info:
        one_run_epsilon_bound(
            num_canaries=10, num_guesses=11, num_correct=5, delta=0.0, confidence=0.9
        )
    assert info.value.parameter == "num_guesses"
    with pytest.raises(InvalidParameterError) as info:
        one_run_epsilon_bound(
            num_canaries=10, num_guesses=5, num_correct=6, delta=0.0, confidence=0.9
        )
    assert info.value.parameter == "num_correct"
    with pytest.raises(InvalidParameterError):
        one_run_p_value(num_canaries=10, num_guesses=5, num_correct=5, epsilon=-1.0, delta=0.0)


# ------------------------------------------------------------------ Gaussian DP


@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0, 5.0])
@pytest.mark.parametrize("eps", [0.0, 0.5, 2.0, 6.0])
def test_gdp_delta_matches_dp_accounting_gaussian(sigma, eps):
    oracle = privacy_loss_mechanism.GaussianPrivacyLoss(standard_deviation=sigma, sensitivity=1.0)
    assert gaussian_dp_delta(eps, mu=1 / sigma) == pytest.approx(
        oracle.get_delta_for_epsilon(eps), rel=1e-9, abs=1e-15
    )


@pytest.mark.parametrize("mu", [0.1, 0.5, 1.0, 3.0])
@pytest.mark.parametrize("delta", [1e-6, 1e-5, 1e-3])
def test_gdp_epsilon_inverts_delta(mu, delta):
    eps = gaussian_dp_epsilon(mu, delta=delta)
    if eps > 0:
        assert gaussian_dp_delta(eps, mu=mu) == pytest.approx(delta, rel=1e-7)
    else:
        assert gaussian_dp_delta(0.0, mu=mu) <= delta


def test_gdp_epsilon_special_cases():
    assert gaussian_dp_epsilon(0.0, delta=1e-5) == 0.0
    assert gaussian_dp_epsilon(1.0, delta=0.0) == math.inf
    # δ(0) = 2Φ(μ/2) − 1: at or above it, ε = 0.
    mu = 0.2
    assert gaussian_dp_epsilon(mu, delta=2 * stats.norm.cdf(mu / 2) - 1 + 1e-12) == 0.0
    with pytest.raises(InvalidParameterError):
        gaussian_dp_epsilon(-1.0, delta=1e-5)
    with pytest.raises(InvalidParameterError):
        gaussian_dp_delta(-1.0, mu=1.0)


def test_gdp_mu_bound_closed_form():
    counts = ConfusionCounts(tp=450, fp=60, fn=50, tn=440)
    mu, _ = gaussian_dp_mu_bound(counts, confidence=0.95)
    fpr = cp_upper_by_hand(60, 500, 0.975)
    fnr = cp_upper_by_hand(50, 500, 0.975)
    assert mu == pytest.approx(stats.norm.ppf(1 - fpr) - stats.norm.ppf(fnr), rel=1e-12)
    b = gaussian_dp_epsilon_bound(counts, delta=1e-5, confidence=0.95)
    assert b.details["mu"] == pytest.approx(mu)
    assert b.epsilon == pytest.approx(gaussian_dp_epsilon(mu, delta=1e-5))
    assert b.assumption is not None and "Gaussian" in b.assumption
    assert b.method is BoundMethod.GAUSSIAN_DP


def test_gdp_perfect_separation_ceiling():
    n = 500
    u = 1 - 0.025 ** (1 / n)
    b = gaussian_dp_epsilon_bound(
        ConfusionCounts(tp=n, fp=0, fn=0, tn=n), delta=1e-5, confidence=0.95
    )
    assert b.details["mu"] == pytest.approx(2 * stats.norm.isf(u), rel=1e-10)


def test_bound_from_counts_dispatch():
    counts = ConfusionCounts(tp=90, fp=10, fn=10, tn=90)
    assert isinstance(
        bound_from_counts(counts, method="clopper_pearson", delta=0.0, confidence=0.9),
        EpsilonLowerBound,
    )
    with pytest.raises(InvalidParameterError):
        bound_from_counts(counts, method="one_run", delta=0.0, confidence=0.9)
    with pytest.raises(InvalidParameterError):
        bound_from_counts(counts, method="magic", delta=0.0, confidence=0.9)
