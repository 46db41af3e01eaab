"""From raw attack scores to a valid ε lower bound: choosing the threshold without cheating.

A distinguishing attack turns each run's score into a guess: "the canary was included" when the
score is at or above a threshold t. Sweeping t over the observed scores and reporting the best bound
*on the same scores* voids the confidence (it is a maximum over many tests, each at level α).
:func:`epsilon_bound_from_scores` therefore requires one of three selection rules, and there is no
fourth:

* :class:`FixedThreshold` — a threshold fixed before these runs (e.g. from a pilot audit whose runs
  are then discarded, as in Tramèr et al. 2022, §3.1).
* :class:`HeldOutSplit` — the runs of each side are split at random (seeded); the threshold (or the
  k best thresholds) is chosen on the selection part and the bound is computed on the other part
  only, with a Bonferroni correction over the k thresholds carried over.
* :class:`BonferroniThresholds` — a list of K thresholds fixed in advance; the bound at each is
  computed at confidence 1 − α/K and the largest is reported (union bound: all K hold together with
  probability ≥ 1 − α).

The same applies to the one-run audit (Steinke et al. 2023), where the "threshold" is the number of
guesses: :func:`one_run_epsilon_bound_from_scores` takes guess counts fixed in advance, with a
Bonferroni correction when there are several.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from dpledger.audit.privacy_bounds import (
    BoundMethod,
    ConfusionCounts,
    EpsilonLowerBound,
    _as_scores,
    _check_audit_delta,
    _check_confidence,
    _epsilon_from_rates,
    _mu_from_rates,
    bound_from_counts,
    clopper_pearson_upper,
    one_run_epsilon_bound,
)
from dpledger.errors import InvalidParameterError

__all__ = [
    "BonferroniThresholds",
    "FixedThreshold",
    "HeldOutSplit",
    "ThresholdSelection",
    "epsilon_bound_from_scores",
    "one_run_epsilon_bound_from_scores",
]


def _finite_threshold(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise InvalidParameterError("threshold", value, "a real number (not NaN)")
    return float(value)


def _threshold_tuple(values: Any) -> tuple[float, ...]:
    try:
        items = tuple(values)
    except TypeError:
        raise InvalidParameterError(
            "thresholds", values, "a non-empty sequence of numbers"
        ) from None
    if not items:
        raise InvalidParameterError("thresholds", values, "a non-empty sequence of numbers")
    return tuple(_finite_threshold(v) for v in items)


def _fraction(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 < value < 1.0:
        raise InvalidParameterError("selection_fraction", value, "a number in (0, 1)")
    return float(value)


def _seed(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise InvalidParameterError("seed", value, "an integer >= 0")
    return int(value)


def _positive(name: str) -> Any:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise InvalidParameterError(name, value, "an integer >= 1")
        return int(value)

    return check


@attrs.frozen
class FixedThreshold:
    """A threshold fixed before the runs it is applied to were seen.

    Use it only for a threshold that does not depend on these scores (from theory, or from a pilot
    audit whose runs are not reused). Choosing it by looking at these scores voids the confidence.

    Attributes:
        threshold: guess "included" when score ≥ threshold.
    """

    threshold: float = attrs.field(converter=_finite_threshold)

    def describe(self) -> str:
        """The rule in words, as stored in the result's ``selection``."""
        return f"fixed threshold {self.threshold:g} chosen in advance"


@attrs.frozen
class HeldOutSplit:
    """Choose the threshold on a random part of the runs, bound on the rest.

    Each side's runs are split at random (``numpy.random.default_rng(seed)``) into a selection part
    (a fraction ``selection_fraction``) and an evaluation part. On the selection part the
    candidate thresholds (midpoints between consecutive distinct scores) are ranked by the bound
    they would give there (ties broken by TPR − FPR); the best ``num_candidates`` are kept, and the
    bound is computed on the evaluation part with a Bonferroni correction over them.

    Attributes:
        selection_fraction: fraction of each side used to choose, in (0, 1).
        seed: seed of the random split.
        num_candidates: how many thresholds to carry over to the evaluation part.
    """

    selection_fraction: float = attrs.field(default=0.5, converter=_fraction)
    seed: int = attrs.field(default=0, converter=_seed)
    num_candidates: int = attrs.field(default=1, converter=_positive("num_candidates"))

    def describe(self) -> str:
        """The rule in words, as stored in the result's ``selection``."""
        extra = (
            f", Bonferroni over its {self.num_candidates} best thresholds"
            if self.num_candidates > 1
            else ""
        )
        return (
            f"threshold chosen on a held-out {self.selection_fraction:.0%} of the runs "
            f"(seed {self.seed}), bound on the rest{extra}"
        )


@attrs.frozen
class BonferroniThresholds:
    """Try each of K thresholds fixed in advance, at confidence 1 − α/K each; report the best.

    Attributes:
        thresholds: the K thresholds (fixed before seeing the scores).
    """

    thresholds: tuple[float, ...] = attrs.field(converter=_threshold_tuple)

    def describe(self) -> str:
        """The rule in words, as stored in the result's ``selection``."""
        return f"best of {len(self.thresholds)} thresholds fixed in advance, Bonferroni-corrected"


ThresholdSelection = FixedThreshold | HeldOutSplit | BonferroniThresholds


def _counts_at(s_in_sorted: np.ndarray, s_out_sorted: np.ndarray, thresholds: np.ndarray):
    """(tp, fp, fn, tn) arrays for "included iff score ≥ t" at each t (inputs sorted)."""
    fn = np.searchsorted(s_in_sorted, thresholds, side="left")
    tn = np.searchsorted(s_out_sorted, thresholds, side="left")
    tp = s_in_sorted.size - fn
    fp = s_out_sorted.size - tn
    return tp, fp, fn, tn


def _ranking_value(tp, fp, fn, tn, method: BoundMethod, delta: float, confidence: float):
    """The bound each candidate would give (vectorised); for GDP the monotone proxy μ."""
    per_rate = 1.0 - (1.0 - confidence) / 2.0
    fpr_u = clopper_pearson_upper(fp, fp + tn, confidence=per_rate)
    fnr_u = clopper_pearson_upper(fn, tp + fn, confidence=per_rate)
    if method is BoundMethod.GAUSSIAN_DP:
        return _mu_from_rates(fpr_u, fnr_u)  # ε(μ) is non-decreasing in μ
    return _epsilon_from_rates(fpr_u, fnr_u, delta)


def _best_of(
    s_in: np.ndarray,
    s_out: np.ndarray,
    thresholds: Sequence[float],
    *,
    method: BoundMethod,
    delta: float,
    per_test_confidence: float,
) -> tuple[EpsilonLowerBound, float]:
    best: EpsilonLowerBound | None = None
    best_t = float("nan")
    for t in thresholds:
        counts = ConfusionCounts.from_scores(s_in, s_out, threshold=t)
        b = bound_from_counts(counts, method=method, delta=delta, confidence=per_test_confidence)
        if best is None or b.epsilon > best.epsilon:
            best, best_t = b, float(t)
    assert best is not None
    return best, best_t


def epsilon_bound_from_scores(
    scores_with_canary: Any,
    scores_without_canary: Any,
    *,
    selection: ThresholdSelection,
    delta: float,
    confidence: float,
    method: BoundMethod | str = BoundMethod.CLOPPER_PEARSON,
) -> EpsilonLowerBound:
    """A valid ε lower bound from the scores of runs with and without the canary.

    Higher scores must mean "more likely included" (e.g. the negative loss on the canary, or the
    inner product of a gradient canary with the update). The attack guesses "included" iff
    score ≥ threshold; the threshold comes from ``selection`` (see the module docstring).

    Args:
        scores_with_canary: one score per run trained with the canary.
        scores_without_canary: one score per run trained without it.
        selection: :class:`FixedThreshold`, :class:`HeldOutSplit` or
            :class:`BonferroniThresholds` (required: there is no best-threshold-on-the-same-data
            option).
        delta: δ of the tested hypotheses, in [0, 1).
        confidence: 1 − α of the reported bound, in (0, 1).
        method: ``"clopper_pearson"`` (default) or ``"gaussian_dp"``.

    Returns:
        The bound, with ``threshold`` the threshold used (None if no threshold could be chosen)
        and ``counts`` the counts at it (on the evaluation part for a held-out split).
    """
    s_in = _as_scores("scores_with_canary", scores_with_canary)
    s_out = _as_scores("scores_without_canary", scores_without_canary)
    delta = _check_audit_delta(delta)
    confidence = _check_confidence(confidence)
    method = BoundMethod.parse(method)
    if method in (BoundMethod.ONE_RUN, BoundMethod.FDP_ONE_RUN):
        raise InvalidParameterError(
            "method",
            method.value,
            "'clopper_pearson' or 'gaussian_dp' (for the one-run audits "
            "use one_run_epsilon_bound_from_scores)",
        )
    alpha = 1.0 - confidence

    if isinstance(selection, FixedThreshold):
        counts = ConfusionCounts.from_scores(s_in, s_out, threshold=selection.threshold)
        b = bound_from_counts(counts, method=method, delta=delta, confidence=confidence)
        return attrs.evolve(b, threshold=selection.threshold, selection=selection.describe())

    if isinstance(selection, BonferroniThresholds):
        k = len(selection.thresholds)
        per_test = 1.0 - alpha / k
        best, t = _best_of(
            s_in,
            s_out,
            selection.thresholds,
            method=method,
            delta=delta,
            per_test_confidence=per_test,
        )
        details = dict(best.details, num_thresholds=k, per_threshold_confidence=per_test)
        return attrs.evolve(
            best,
            confidence=confidence,
            threshold=t,
            selection=selection.describe(),
            details=details,
        )

    if isinstance(selection, HeldOutSplit):
        return _held_out(s_in, s_out, selection, method=method, delta=delta, confidence=confidence)

    raise InvalidParameterError(
        "selection", selection, "FixedThreshold, HeldOutSplit or BonferroniThresholds"
    )


def _split(scores: np.ndarray, fraction: float, rng: np.random.Generator):
    perm = rng.permutation(scores.size)
    n_sel = math.floor(fraction * scores.size)
    return scores[perm[:n_sel]], scores[perm[n_sel:]]


def _held_out(
    s_in: np.ndarray,
    s_out: np.ndarray,
    selection: HeldOutSplit,
    *,
    method: BoundMethod,
    delta: float,
    confidence: float,
) -> EpsilonLowerBound:
    rng = np.random.default_rng(selection.seed)
    sel_in, eval_in = _split(s_in, selection.selection_fraction, rng)
    sel_out, eval_out = _split(s_out, selection.selection_fraction, rng)
    sizes = {
        "selection_with_canary": int(sel_in.size),
        "selection_without_canary": int(sel_out.size),
        "evaluation_with_canary": int(eval_in.size),
        "evaluation_without_canary": int(eval_out.size),
    }
    pooled = np.unique(np.concatenate([sel_in, sel_out]))
    if pooled.size < 2:
        # Nothing to choose from: no threshold, no evidence.
        return EpsilonLowerBound(
            epsilon=0.0,
            delta=delta,
            confidence=confidence,
            method=method,
            threshold=None,
            selection=selection.describe(),
            details=dict(sizes, note="fewer than two distinct scores in the selection part"),
        )
    candidates = (pooled[:-1] + pooled[1:]) / 2.0
    tp, fp, fn, tn = _counts_at(np.sort(sel_in), np.sort(sel_out), candidates)
    value = _ranking_value(tp, fp, fn, tn, method, delta, confidence)
    with np.errstate(divide="ignore", invalid="ignore"):
        tpr = np.where(tp + fn > 0, tp / np.maximum(tp + fn, 1), 0.0)
        fpr = np.where(fp + tn > 0, fp / np.maximum(fp + tn, 1), 0.0)
    # Sort by value, then by TPR − FPR, both descending; stable on ties (lower threshold first).
    order = np.lexsort((-(tpr - fpr), -value))
    chosen = [float(t) for t in candidates[order[: selection.num_candidates]]]
    k = len(chosen)
    per_test = 1.0 - (1.0 - confidence) / k
    best, t = _best_of(
        eval_in, eval_out, chosen, method=method, delta=delta, per_test_confidence=per_test
    )
    details = dict(best.details, **sizes, num_thresholds=k, per_threshold_confidence=per_test)
    return attrs.evolve(
        best, confidence=confidence, threshold=t, selection=selection.describe(), details=details
    )


def _guess_pairs(values: Any) -> tuple[tuple[int, int], ...]:
    expected = "a non-empty sequence of (num_positive, num_negative) pairs of integers >= 0"
    try:
        pairs = tuple(tuple(p) for p in values)
    except TypeError:
        raise InvalidParameterError("guess_counts", values, expected) from None
    if not pairs:
        raise InvalidParameterError("guess_counts", values, expected)
    out = []
    for p in pairs:
        if len(p) != 2 or any(
            isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 0 for x in p
        ):
            raise InvalidParameterError("guess_counts", values, expected)
        out.append((int(p[0]), int(p[1])))
    return tuple(out)


def _guesses(scores: np.ndarray, ranked: np.ndarray, count: int, *, highest: bool) -> np.ndarray:
    """Mask of the ``count`` highest (or lowest) scores, abstaining on a tie at the cut.

    When scores equal to the ``count``-th value lie on both sides of the cut, none of them is
    guessed: breaking the tie by position would let the canaries' order, rather than the run's
    output, decide the guesses (and a caller who lists included canaries last would be credited
    with correct guesses that the scores do not support).
    """
    if count == 0:
        return np.zeros(scores.shape, dtype=bool)
    if highest:
        cut = ranked[ranked.size - count]
        at_least = scores >= cut
        return at_least if np.count_nonzero(at_least) == count else scores > cut
    cut = ranked[count - 1]
    at_most = scores <= cut
    return at_most if np.count_nonzero(at_most) == count else scores < cut


def one_run_epsilon_bound_from_scores(
    scores: Any,
    included: Any,
    *,
    guess_counts: Sequence[tuple[int, int]],
    delta: float,
    confidence: float,
    method: BoundMethod | str = BoundMethod.ONE_RUN,
) -> EpsilonLowerBound:
    """One-run ε lower bound from the m canaries' scores in a single training run.

    For each (k₊, k₋) in ``guess_counts`` (fixed in advance) the auditor guesses "included" for the
    k₊ highest scores and "excluded" for the k₋ lowest, abstaining on the rest; with r = k₊ + k₋
    guesses and v correct, :func:`~dpledger.audit.privacy_bounds.one_run_epsilon_bound` gives the
    bound. With K pairs each is computed at confidence 1 − α/K and the largest is reported. Scores
    tied across a cut are not guessed (r is then smaller than k₊ + k₋): the guesses depend on the
    scores only, never on the canaries' order.

    Args:
        scores: one score per canary (higher = more likely included).
        included: one bool per canary: whether it was included (drawn with probability ½).
        guess_counts: the (k₊, k₋) pairs to try, with k₊ + k₋ ≤ m.
        delta: δ in [0, 1).
        confidence: 1 − α in (0, 1).
        method: ``"one_run"`` (Steinke et al. 2023, an (ε, δ) test) or ``"fdp_one_run"``
            (Mahloujifar et al. 2024, a test of the Gaussian trade-off curve:
            :func:`~dpledger.audit.fdp_one_run.fdp_one_run_epsilon_bound`), on the same guesses.
    """
    method = BoundMethod.parse(method)
    if method not in (BoundMethod.ONE_RUN, BoundMethod.FDP_ONE_RUN):
        raise InvalidParameterError("method", method.value, "'one_run' or 'fdp_one_run'")
    bound_of = one_run_epsilon_bound
    if method is BoundMethod.FDP_ONE_RUN:
        from dpledger.audit.fdp_one_run import fdp_one_run_epsilon_bound as bound_of
    s = _as_scores("scores", scores)
    inc = np.asarray(included)
    if inc.dtype != np.bool_ or inc.shape != s.shape:
        raise InvalidParameterError(
            "included", included, f"a boolean array with one entry per score ({s.size})"
        )
    pairs = _guess_pairs(guess_counts)
    delta = _check_audit_delta(delta)
    confidence = _check_confidence(confidence)
    m = s.size
    for kp, kn in pairs:
        if kp + kn > m:
            raise InvalidParameterError(
                "guess_counts", (kp, kn), f"pairs with num_positive + num_negative <= m = {m}"
            )
    ranked = np.sort(s)  # ascending
    k = len(pairs)
    per_test = 1.0 - (1.0 - confidence) / k
    best: EpsilonLowerBound | None = None
    best_pair = pairs[0]
    for kp, kn in pairs:
        top = _guesses(s, ranked, kp, highest=True)
        bottom = _guesses(s, ranked, kn, highest=False)
        v = int(np.count_nonzero(inc[top])) + int(np.count_nonzero(~inc[bottom]))
        b = bound_of(
            num_canaries=m,
            num_guesses=int(np.count_nonzero(top)) + int(np.count_nonzero(bottom)),
            num_correct=v,
            delta=delta,
            confidence=per_test,
        )
        if best is None or b.epsilon > best.epsilon:
            best, best_pair = b, (kp, kn)
    assert best is not None
    details = dict(
        best.details,
        num_positive_guesses=best_pair[0],
        num_negative_guesses=best_pair[1],
        num_guess_counts=k,
        per_test_confidence=per_test,
    )
    selection = (
        "guess counts fixed in advance"
        if k == 1
        else f"best of {k} guess counts fixed in advance, Bonferroni-corrected"
    )
    return attrs.evolve(best, confidence=confidence, selection=selection, details=details)
