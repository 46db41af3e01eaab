"""One-run audits from member and non-member scores against JAX Privacy's stated values.

Reference: google-deepmind/jax_privacy, ``tests/auditing_test.py``,
``CanaryScoreAuditorTest.test_epsilon_one_run_close``: 10,000 member and 10,000 non-member
canaries with deterministic scores Φ⁻¹((i + ½)/n) (+ shift for members), significance 0.05,
δ = 1e-6, one-sided guesses, Bonferroni over the thresholds of the ROC hull (the default
``Bonferroni()`` strategy of ``jax_privacy/auditing.py``), rtol 1e-5. Expected ε: Steinke et al.
(``epsilon_one_run``) 0, 1.13346, 2.311945, 4.395568 and f-DP (``epsilon_one_run_fdp``,
Mahloujifar et al.) 0, 2.164749, 4.7218075, 9.133752 at shifts 0, 1, 2, 4.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy import stats

from dpledger.audit.one_run_scores import (
    one_run_epsilon_bound_from_member_scores,
    roc_hull_indices,
)
from dpledger.errors import InvalidParameterError


def _deterministic_normal(shift: float, n: int) -> np.ndarray:
    """Scores Φ⁻¹((i + ½)/n) + shift, i = 0..n−1 (the reference's ``_deterministic_normal``)."""
    return stats.norm.ppf((np.arange(n) + 0.5) / n) + shift


@pytest.mark.parametrize(
    ("method", "shift", "expected"),
    [
        ("one_run", 0, 0.0),
        ("fdp_one_run", 0, 0.0),
        pytest.param("one_run", 1, 1.13346, marks=pytest.mark.slow),
        ("fdp_one_run", 1, 2.164749),
        pytest.param("one_run", 2, 2.311945, marks=pytest.mark.slow),
        ("fdp_one_run", 2, 4.7218075),
        pytest.param("one_run", 4, 4.395568, marks=pytest.mark.slow),
        ("fdp_one_run", 4, 9.133752),
    ],
)
def test_epsilon_one_run_close(method: str, shift: int, expected: float) -> None:
    """google-deepmind/jax_privacy, tests/auditing_test.py, test_epsilon_one_run_close: the same
    scores, significance 0.05 (confidence 0.95), δ = 1e-6 and threshold procedure (one-sided,
    Bonferroni over the ROC hull's thresholds) give the stated ε to rtol 1e-5."""
    n = 10_000
    bound = one_run_epsilon_bound_from_member_scores(
        _deterministic_normal(shift, n),
        _deterministic_normal(0, n),
        delta=1e-6,
        confidence=0.95,
        method=method,
        thresholds="roc_hull",
    )
    if expected == 0.0:
        assert bound.epsilon == 0.0
    else:
        assert bound.epsilon == pytest.approx(expected, rel=1e-5)
    assert bound.counts["m"] == 2 * n


def test_every_threshold_is_never_above_the_hull_procedure() -> None:
    """Bonferroni over every distinct score (a family fixed by the scores alone) corrects for
    more tests than the ROC hull's, so its bound is at most the hull's, and the f-DP bound at
    shift 1 stays positive."""
    members, non_members = _deterministic_normal(1, 2000), _deterministic_normal(0, 2000)
    kwargs = {"delta": 1e-6, "confidence": 0.95, "method": "fdp_one_run"}
    every = one_run_epsilon_bound_from_member_scores(members, non_members, **kwargs)
    hull = one_run_epsilon_bound_from_member_scores(
        members, non_members, thresholds="roc_hull", **kwargs
    )
    assert 0.0 < every.epsilon <= hull.epsilon
    assert every.details["num_thresholds"] == 4001
    assert hull.details["num_thresholds"] < 4001


def test_skipping_thresholds_gives_the_maximum_over_all_of_them() -> None:
    """The search skips thresholds that cannot beat the best so far; the answer must equal the
    plain maximum of the per-threshold bounds (each at confidence 1 − α/K)."""
    from dpledger.audit.privacy_bounds import one_run_epsilon_bound

    rng = np.random.default_rng(7)
    members, non_members = rng.normal(2.0, 1.0, 60), rng.normal(0.0, 1.0, 60)
    got = one_run_epsilon_bound_from_member_scores(members, non_members, delta=1e-4, confidence=0.9)
    thresholds = np.concatenate([np.union1d(members, non_members), [np.inf]])
    per_test = 1.0 - 0.1 / thresholds.size
    best = max(
        one_run_epsilon_bound(
            num_canaries=120,
            num_guesses=int(np.sum(members >= t) + np.sum(non_members >= t)),
            num_correct=int(np.sum(members >= t)),
            delta=1e-4,
            confidence=per_test,
        ).epsilon
        for t in thresholds
    )
    assert best > 0.0
    assert got.epsilon == best


def _brute_force_hull(x: np.ndarray, y: np.ndarray) -> list[int]:
    """Points not weakly below the chord of some pair of points on either side (cubic time)."""
    dominated = set()
    for i, j, k in itertools.combinations(range(len(x)), 3):
        if (x[j] - x[i]) * (y[k] - y[i]) - (y[j] - y[i]) * (x[k] - x[i]) >= 0:
            dominated.add(j)
    return sorted(set(range(len(x))) - dominated)


@pytest.mark.parametrize("seed", range(5))
def test_roc_hull_matches_the_cubic_definition(seed: int) -> None:
    """The hull's vertices are the points that no pair of outer points dominates (the definition
    JAX Privacy's ``_pareto_frontier`` documents), on random ROC curves with ties."""
    rng = np.random.default_rng(seed)
    members, non_members = rng.integers(0, 12, 30), rng.integers(-3, 9, 25)
    thresholds = np.concatenate([np.union1d(members, non_members), [np.inf]])
    fn = np.searchsorted(np.sort(members), thresholds, side="left")
    tn = np.searchsorted(np.sort(non_members), thresholds, side="left")
    got = roc_hull_indices(fn, tn).tolist()
    assert got == _brute_force_hull(fn.astype(float), tn.astype(float))


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"member_scores": [1.0, np.nan]}, "member_scores"),
        ({"non_member_scores": "abc"}, "non_member_scores"),
        ({"member_scores": [], "non_member_scores": []}, "member_scores"),
        ({"thresholds": "best"}, "thresholds"),
        ({"method": "clopper_pearson"}, "method"),
        ({"delta": 1.5}, "delta"),
        ({"confidence": 1.0}, "confidence"),
    ],
)
def test_bad_input_is_refused(kwargs: dict, name: str) -> None:
    args = {
        "member_scores": [1.0, 2.0],
        "non_member_scores": [0.0, 0.5],
        "delta": 1e-5,
        "confidence": 0.95,
        **kwargs,
    }
    with pytest.raises(InvalidParameterError, match=name):
        one_run_epsilon_bound_from_member_scores(
            args.pop("member_scores"), args.pop("non_member_scores"), **args
        )


def test_bad_roc_points_are_refused() -> None:
    with pytest.raises(InvalidParameterError, match="false_negatives"):
        roc_hull_indices([0, 2, 1], [0, 1, 2])
