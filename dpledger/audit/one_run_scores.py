"""One-run ε lower bounds from the scores of member and non-member canaries, every threshold tried.

The one-run audits (Steinke, Nasr & Jagielski 2023, an (ε, δ) test:
:func:`~dpledger.audit.privacy_bounds.one_run_epsilon_bound`; Mahloujifar, Melis & Chaudhuri
2024, a test of the Gaussian trade-off curve:
:func:`~dpledger.audit.fdp_one_run.fdp_one_run_epsilon_bound`) take the number of guesses r and
of correct guesses v. Given the scores of the m canaries of one run, split into members (included)
and non-members, this module makes one-sided guesses, "included" for every canary whose score is
at least a threshold t and an abstention on the rest (r = TP + FP, v = TP at t), and reports the
largest bound over a set of K thresholds, each tested at level α/K (Bonferroni), so the reported
bound holds at confidence 1 − α.

Which thresholds (``thresholds=``):

* ``"all"`` (default): every distinct score and +∞. The family of guess rules "the canaries
  scoring at least the k-th largest distinct score" is a function of the scores alone, fixed
  before the labels are looked at, so the Bonferroni correction is over a family chosen in
  advance.
* ``"roc_hull"``: the thresholds on the upper concave hull of the empirical ROC curve (the
  vertices of the curve TN(FN), collinear points dropped), K of them, as in JAX Privacy's
  ``CanaryScoreAuditor.epsilon_one_run`` / ``epsilon_one_run_fdp`` with its default
  ``Bonferroni()`` strategy (``jax_privacy/auditing.py``: ``_get_tn_fn_counts``,
  ``_pareto_frontier`` and ``_audit_with_threshold_strategy``). This reproduces that library's
  numbers. The hull is computed with the labels, so K, the size of the family corrected for, is
  itself chosen from the data; the bound is then a little larger than under ``"all"`` and the
  Bonferroni argument does not cover the choice of family. Use it to compare with JAX Privacy.

Thresholds are visited in order of decreasing precision TP/(TP + FP), and a threshold whose
guesses do not reject the hypothesis at the best bound found so far is skipped without a root
search: the rejected ε of the (ε, δ) test form an interval [0, ε*) (its p-value is non-decreasing
in ε), and the f-DP bound μ⁻ exceeds μ only if μ is rejected, so a skipped threshold's bound is at
most the best one. The answer is the maximum over all K thresholds, computed faster.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np
from scipy import special, stats

from dpledger.audit.fdp_one_run import _margin, fdp_one_run_epsilon_bound
from dpledger.audit.privacy_bounds import (
    BoundMethod,
    EpsilonLowerBound,
    _as_scores,
    _check_audit_delta,
    _check_confidence,
    _one_run_p,
    one_run_epsilon_bound,
)
from dpledger.errors import InvalidParameterError

__all__ = ["one_run_epsilon_bound_from_member_scores", "roc_hull_indices"]

_THRESHOLD_SETS = ("all", "roc_hull")


def roc_hull_indices(false_negatives: Any, true_negatives: Any) -> np.ndarray:
    """Indices of the vertices of the upper concave hull of the points (FN_i, TN_i).

    The points are the empirical ROC curve in the coordinates (false negatives, true negatives)
    at increasing thresholds, so both sequences are non-decreasing. A point is kept when the
    piecewise-linear curve turns strictly downwards (concavely) at it: points on or below the
    chord of their neighbours on the hull are dropped, the first and last always kept. This is
    the set JAX Privacy's ``_pareto_frontier`` computes.

    Args:
        false_negatives: FN at each threshold, non-decreasing.
        true_negatives: TN at each threshold, non-decreasing.

    Returns:
        The kept indices, increasing.

    Raises:
        InvalidParameterError: if the sequences differ in length, have fewer than two points or
            are not non-decreasing.
    """
    x = np.asarray(false_negatives, dtype=np.float64).reshape(-1)
    y = np.asarray(true_negatives, dtype=np.float64).reshape(-1)
    if x.size != y.size or x.size < 2 or np.any(np.diff(x) < 0) or np.any(np.diff(y) < 0):
        raise InvalidParameterError(
            "false_negatives, true_negatives",
            (x.size, y.size),
            "two non-decreasing sequences of the same length, at least 2",
        )
    hull: list[int] = []
    for i in range(x.size):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # b is kept only if the slope from a to b is strictly above the slope from b to i.
            turn = (y[b] - y[a]) * (x[i] - x[b]) - (y[i] - y[b]) * (x[b] - x[a])
            if turn > 0:
                break
            hull.pop()
        hull.append(i)
    return np.asarray(hull, dtype=np.int64)


def _threshold_counts(
    members: np.ndarray, non_members: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Thresholds (distinct scores and +∞) with FN and TN of "guess included if score ≥ t"."""
    thresholds = np.concatenate([np.union1d(members, non_members), [math.inf]])
    fn = np.searchsorted(np.sort(members), thresholds, side="left")
    tn = np.searchsorted(np.sort(non_members), thresholds, side="left")
    return thresholds, fn, tn


def one_run_epsilon_bound_from_member_scores(
    member_scores: Any,
    non_member_scores: Any,
    *,
    delta: float,
    confidence: float,
    method: BoundMethod | str = BoundMethod.ONE_RUN,
    thresholds: str = "all",
) -> EpsilonLowerBound:
    """One-run ε lower bound, one-sided guesses, the best of K thresholds (Bonferroni).

    At each threshold t the auditor guesses "included" for every canary scoring ≥ t and abstains
    on the rest; the bound at t is computed at confidence 1 − α/K and the largest is reported
    (see the module docstring for the two threshold sets).

    Args:
        member_scores: scores of the canaries that were included (higher = more likely included).
        non_member_scores: scores of the canaries that were not.
        delta: δ in [0, 1).
        confidence: 1 − α in (0, 1).
        method: ``"one_run"`` (Steinke et al. 2023) or ``"fdp_one_run"`` (Mahloujifar et al.
            2024, the Gaussian trade-off curve; the ε rests on that assumption).
        thresholds: ``"all"`` (every distinct score, fixed by the scores alone) or
            ``"roc_hull"`` (the ROC hull's vertices, as JAX Privacy).

    Returns:
        The bound; ``threshold`` is the best threshold, ``details`` holds K and the per-test
        confidence.

    Raises:
        InvalidParameterError: for scores that are not finite numbers, no canaries at all, or an
            argument outside the ranges above.
    """
    method = BoundMethod.parse(method)
    if method not in (BoundMethod.ONE_RUN, BoundMethod.FDP_ONE_RUN):
        raise InvalidParameterError("method", method.value, "'one_run' or 'fdp_one_run'")
    if thresholds not in _THRESHOLD_SETS:
        raise InvalidParameterError("thresholds", thresholds, "'all' or 'roc_hull'")
    members = _as_scores("member_scores", member_scores)
    non_members = _as_scores("non_member_scores", non_member_scores)
    m = members.size + non_members.size
    if m == 0:
        raise InvalidParameterError(
            "member_scores", member_scores, "at least one canary in the two score arrays"
        )
    delta = _check_audit_delta(delta)
    confidence = _check_confidence(confidence)
    values, fn, tn = _threshold_counts(members, non_members)
    chosen = roc_hull_indices(fn, tn) if thresholds == "roc_hull" else np.arange(values.size)
    k = int(chosen.size)
    per_test = 1.0 - (1.0 - confidence) / k
    tp = members.size - fn[chosen]
    guesses = tp + (non_members.size - tn[chosen])
    precision = np.divide(tp, guesses, out=np.zeros(k), where=guesses > 0)
    bound_of = (
        fdp_one_run_epsilon_bound if method is BoundMethod.FDP_ONE_RUN else one_run_epsilon_bound
    )
    # No guess: the bound of r = v = 0, which is 0 (the fallback when nothing is rejected).
    best = bound_of(num_canaries=m, num_guesses=0, num_correct=0, delta=delta, confidence=per_test)
    best_threshold = math.inf
    best_value = 0.0  # ε (one run) or μ (f-DP) of the best bound so far
    for j in np.argsort(-precision, kind="stable"):
        r, v = int(guesses[j]), int(tp[j])
        if v == 0 or not _rejects(method, m, r, v, best_value, delta, per_test):
            continue  # its bound is at most best_value (see the module docstring)
        b = bound_of(num_canaries=m, num_guesses=r, num_correct=v, delta=delta, confidence=per_test)
        value = b.details["mu"] if method is BoundMethod.FDP_ONE_RUN else b.epsilon
        if value > best_value:
            best, best_value, best_threshold = b, value, float(values[chosen[j]])
    details = dict(best.details, num_thresholds=k, per_test_confidence=per_test)
    selection = (
        f"best of {k} one-sided thresholds "
        f"({'ROC hull' if thresholds == 'roc_hull' else 'every distinct score'}), "
        "Bonferroni-corrected"
    )
    return attrs.evolve(
        best,
        confidence=confidence,
        threshold=best_threshold,
        selection=selection,
        details=details,
    )


def _rejects(
    method: BoundMethod, m: int, r: int, v: int, value: float, delta: float, confidence: float
) -> bool:
    """Whether v correct guesses of r reject ε = value (one run) or μ = value (f-DP)."""
    alpha = 1.0 - confidence
    if method is BoundMethod.FDP_ONE_RUN:
        return _margin(m, r, v, value, alpha) > 0.0
    if 2.0 * m * delta > 1.0:
        return False  # the one-run bound is reported as 0 there
    # p ≥ P[X ≥ v] + 2mδ·max(P[X = v − 1], P[X < v]/v) (its first term and the max's terms
    # i = 1 and i = v): three Binomial values, a cheap test before the whole p-value.
    q = float(special.expit(value))
    tail = float(stats.binom.sf(v - 1, r, q))
    window = max(float(stats.binom.pmf(v - 1, r, q)), (1.0 - tail) / v)
    floor = tail + 2.0 * m * delta * window
    if floor >= alpha:
        return False
    return _one_run_p(m, r, v, value, delta) < alpha
