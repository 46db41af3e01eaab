"""Tests of threshold selection: fixed, held-out split and Bonferroni, and why they are needed."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from dpledger.audit.privacy_bounds import (
    BoundMethod,
    ConfusionCounts,
    clopper_pearson_epsilon_bound,
    clopper_pearson_upper,
    gaussian_dp_epsilon_bound,
    one_run_epsilon_bound,
)
from dpledger.audit.threshold_selection import (
    BonferroniThresholds,
    FixedThreshold,
    HeldOutSplit,
    epsilon_bound_from_scores,
    one_run_epsilon_bound_from_scores,
)
from dpledger.errors import InvalidParameterError


def scores(seed: int, n: int = 400, shift: float = 1.5):
    rng = np.random.default_rng(seed)
    return rng.normal(shift, 1.0, n), rng.normal(0.0, 1.0, n)


def test_fixed_threshold_equals_counts_at_that_threshold():
    s_in, s_out = scores(0)
    b = epsilon_bound_from_scores(
        s_in, s_out, selection=FixedThreshold(1.0), delta=1e-5, confidence=0.95
    )
    tp = int(np.sum(s_in >= 1.0))
    fp = int(np.sum(s_out >= 1.0))
    want = clopper_pearson_epsilon_bound(
        ConfusionCounts(tp=tp, fp=fp, fn=400 - tp, tn=400 - fp), delta=1e-5, confidence=0.95
    )
    assert b.epsilon == want.epsilon
    assert b.threshold == 1.0
    assert b.counts == {"tp": tp, "fp": fp, "fn": 400 - tp, "tn": 400 - fp}
    assert "fixed threshold" in b.selection


def test_bonferroni_is_the_best_of_k_at_confidence_one_minus_alpha_over_k():
    s_in, s_out = scores(1)
    thresholds = [0.0, 0.5, 1.0, 1.5, 2.0]
    b = epsilon_bound_from_scores(
        s_in,
        s_out,
        selection=BonferroniThresholds(thresholds),
        delta=1e-5,
        confidence=0.95,
        method="gaussian_dp",
    )
    per = 1 - 0.05 / 5
    by_hand = []
    for t in thresholds:
        c = ConfusionCounts.from_scores(s_in, s_out, threshold=t)
        by_hand.append(gaussian_dp_epsilon_bound(c, delta=1e-5, confidence=per).epsilon)
    assert b.epsilon == pytest.approx(max(by_hand), rel=1e-12)
    assert b.threshold == thresholds[int(np.argmax(by_hand))]
    assert b.confidence == 0.95  # the reported confidence is the joint one
    assert b.details["per_threshold_confidence"] == pytest.approx(per)
    assert b.details["num_thresholds"] == 5
    assert b.method is BoundMethod.GAUSSIAN_DP
    # The corrected bound is below the bound any single threshold would give uncorrected.
    best = ConfusionCounts.from_scores(s_in, s_out, threshold=b.threshold)
    assert b.epsilon < gaussian_dp_epsilon_bound(best, delta=1e-5, confidence=0.95).epsilon


def test_held_out_split_bounds_only_on_the_evaluation_part():
    s_in, s_out = scores(2, n=301)
    sel = HeldOutSplit(selection_fraction=0.3, seed=7)
    b = epsilon_bound_from_scores(s_in, s_out, selection=sel, delta=1e-5, confidence=0.95)
    n_sel = math.floor(0.3 * 301)
    assert b.details["selection_with_canary"] == n_sel
    assert b.details["evaluation_with_canary"] == 301 - n_sel
    assert b.counts["tp"] + b.counts["fn"] == 301 - n_sel
    assert b.counts["fp"] + b.counts["tn"] == 301 - n_sel
    # Recompute by hand: the same seeded split, the bound at the chosen threshold.
    rng = np.random.default_rng(7)
    perm_in = rng.permutation(301)
    perm_out = rng.permutation(301)
    ev_in, ev_out = s_in[perm_in[n_sel:]], s_out[perm_out[n_sel:]]
    sel_scores = np.concatenate([s_in[perm_in[:n_sel]], s_out[perm_out[:n_sel]]])
    c = ConfusionCounts.from_scores(ev_in, ev_out, threshold=b.threshold)
    assert b.counts == c.as_dict()
    assert b.epsilon == clopper_pearson_epsilon_bound(c, delta=1e-5, confidence=0.95).epsilon
    # The threshold is a midpoint between two consecutive distinct selection-part scores.
    u = np.unique(sel_scores)
    assert np.any(np.isclose((u[:-1] + u[1:]) / 2, b.threshold, rtol=0, atol=0))
    # Same seed, same answer.
    again = epsilon_bound_from_scores(s_in, s_out, selection=sel, delta=1e-5, confidence=0.95)
    assert again == b


def test_held_out_split_with_several_candidates_applies_bonferroni():
    s_in, s_out = scores(3)
    b = epsilon_bound_from_scores(
        s_in, s_out, selection=HeldOutSplit(num_candidates=4), delta=1e-5, confidence=0.9
    )
    assert b.details["num_thresholds"] == 4
    assert b.details["per_threshold_confidence"] == pytest.approx(1 - 0.1 / 4)
    assert b.confidence == 0.9
    assert "Bonferroni" in b.selection


def test_held_out_split_with_nothing_to_choose_is_vacuous():
    b = epsilon_bound_from_scores(
        [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0],
        selection=HeldOutSplit(), delta=1e-5, confidence=0.95,
    )  # fmt: skip
    assert b.epsilon == 0.0
    assert b.threshold is None


def test_a_selection_rule_is_required():
    s_in, s_out = scores(4)
    with pytest.raises(TypeError):
        epsilon_bound_from_scores(s_in, s_out, delta=1e-5, confidence=0.95)  # type: ignore[call-arg]
    for bad in (1.0, None, "best", [0.0, 1.0]):
        with pytest.raises(InvalidParameterError) as info:
            epsilon_bound_from_scores(s_in, s_out, selection=bad, delta=1e-5, confidence=0.95)
        assert info.value.parameter == "selection"
    with pytest.raises(InvalidParameterError):
        epsilon_bound_from_scores(
            s_in, s_out, selection=FixedThreshold(0.0), delta=1e-5, confidence=0.95,
            method="one_run",
        )  # fmt: skip


@pytest.mark.parametrize(
    ("factory", "parameter"),
    [
        (lambda: FixedThreshold(float("nan")), "threshold"),
        (lambda: HeldOutSplit(selection_fraction=0.0), "selection_fraction"),
        (lambda: HeldOutSplit(selection_fraction=1.0), "selection_fraction"),
        (lambda: HeldOutSplit(seed=-1), "seed"),
        (lambda: HeldOutSplit(num_candidates=0), "num_candidates"),
        (lambda: BonferroniThresholds([]), "thresholds"),
        (lambda: BonferroniThresholds(3.0), "thresholds"),
        (lambda: BonferroniThresholds([0.0, float("nan")]), "threshold"),
    ],
)
def test_bad_selection_rules_are_refused(factory, parameter):
    with pytest.raises(InvalidParameterError) as info:
        factory()
    assert info.value.parameter == parameter


def best_threshold_on_same_data(s_in, s_out, confidence):
    """The invalid rule: sweep every threshold and keep the best Clopper–Pearson bound (δ = 0)."""
    pooled = np.unique(np.concatenate([s_in, s_out]))
    t = (pooled[:-1] + pooled[1:]) / 2
    fn = np.searchsorted(np.sort(s_in), t)
    tn = np.searchsorted(np.sort(s_out), t)
    tp, fp = s_in.size - fn, s_out.size - tn
    level = 1 - (1 - confidence) / 2
    fpr = clopper_pearson_upper(fp, fp + tn, confidence=level)
    fnr = clopper_pearson_upper(fn, tp + fn, confidence=level)
    with np.errstate(divide="ignore", invalid="ignore"):
        eps = np.maximum(np.log((1 - fnr) / fpr), np.log((1 - fpr) / fnr))
    return float(np.max(np.maximum(eps, 0.0)))


@pytest.mark.slow
@pytest.mark.statistical
def test_held_out_and_bonferroni_keep_the_false_positive_rate_but_best_on_same_data_does_not():
    # Under the null (both sides draw from the same distribution) the mechanism is (0, 0)-DP, so
    # any bound > 0 is a false claim. A valid procedure at 90% confidence makes one in at most 10%
    # of audits; the count over 300 audits must stay below the 99.9% quantile of Bin(300, 0.1).
    # Reporting the best threshold on the same data (the rule this API refuses) does not.
    audits, n, confidence = 300, 500, 0.9
    limit = stats.binom.ppf(0.999, audits, 1 - confidence)
    held_out = bonferroni = naive = 0
    grid = np.linspace(-2.0, 2.0, 9)
    for seed in range(audits):
        rng = np.random.default_rng(10_000 + seed)
        s_in, s_out = rng.normal(size=n), rng.normal(size=n)
        kwargs = {"delta": 0.0, "confidence": confidence}
        split = HeldOutSplit(seed=seed)
        held_out += epsilon_bound_from_scores(s_in, s_out, selection=split, **kwargs).epsilon > 0
        fixed_grid = BonferroniThresholds(grid)
        bonferroni += (
            epsilon_bound_from_scores(s_in, s_out, selection=fixed_grid, **kwargs).epsilon > 0
        )
        naive += best_threshold_on_same_data(s_in, s_out, confidence) > 0
    assert held_out <= limit
    assert bonferroni <= limit
    assert naive > limit  # the check above has the power to catch an invalid selection


def test_one_run_from_scores_counts_correct_guesses():
    rng = np.random.default_rng(5)
    m = 1000
    included = rng.random(m) < 0.5
    s = np.where(included, 1.0, 0.0) + rng.normal(0.0, 0.3, m)
    b = one_run_epsilon_bound_from_scores(
        s, included, guess_counts=[(100, 0)], delta=1e-5, confidence=0.95
    )
    top = np.argsort(s, kind="stable")[-100:]
    v = int(included[top].sum())
    want = one_run_epsilon_bound(
        num_canaries=m, num_guesses=100, num_correct=v, delta=1e-5, confidence=0.95
    )
    assert b.epsilon == want.epsilon
    assert b.counts == {"m": m, "r": 100, "v": v}
    # Several guess counts: Bonferroni.
    pairs = [(50, 50), (100, 0), (100, 100)]
    multi = one_run_epsilon_bound_from_scores(
        s, included, guess_counts=pairs, delta=1e-5, confidence=0.95
    )
    per = 1 - 0.05 / 3
    order = np.argsort(s, kind="stable")
    by_hand = []
    for kp, kn in pairs:
        v = int(included[order[m - kp :]].sum()) + int((~included[order[:kn]]).sum())
        by_hand.append(
            one_run_epsilon_bound(
                num_canaries=m, num_guesses=kp + kn, num_correct=v, delta=1e-5, confidence=per
            ).epsilon
        )
    assert multi.epsilon == pytest.approx(max(by_hand))
    assert multi.details["per_test_confidence"] == pytest.approx(per)
    assert multi.confidence == 0.95
    with pytest.raises(InvalidParameterError):
        one_run_epsilon_bound_from_scores(
            s, included, guess_counts=[(600, 500)], delta=1e-5, confidence=0.95
        )
    with pytest.raises(InvalidParameterError):
        one_run_epsilon_bound_from_scores(
            s, included.astype(int), guess_counts=[(10, 0)], delta=1e-5, confidence=0.95
        )
    with pytest.raises(InvalidParameterError):
        one_run_epsilon_bound_from_scores(s, included, guess_counts=[], delta=0.0, confidence=0.9)


def test_one_run_from_scores_abstains_on_ties_at_the_cut():
    # Scores that carry no information (all equal) with the included canaries listed last:
    # breaking the tie by position would guess "included" for exactly the included ones.
    m = 200
    included = np.arange(m) >= m // 2
    flat = one_run_epsilon_bound_from_scores(
        np.zeros(m), included, guess_counts=[(50, 50)], delta=0.0, confidence=0.95
    )
    assert flat.counts == {"m": m, "r": 0, "v": 0}
    assert flat.epsilon == 0.0
    # A tie straddling the cut: scores 0, 1, 1, 2 with k₊ = 2 guesses only the unique top score;
    # a tie wholly inside the cut is guessed (k₊ = 3 takes the three scores ≥ 1).
    scores = np.array([0.0, 1.0, 1.0, 2.0])
    inc = np.array([False, True, True, True])
    two = one_run_epsilon_bound_from_scores(
        scores, inc, guess_counts=[(2, 1)], delta=0.0, confidence=0.5
    )
    assert two.counts == {"m": 4, "r": 2, "v": 2}
    three = one_run_epsilon_bound_from_scores(
        scores, inc, guess_counts=[(3, 1)], delta=0.0, confidence=0.5
    )
    assert three.counts == {"m": 4, "r": 4, "v": 4}
