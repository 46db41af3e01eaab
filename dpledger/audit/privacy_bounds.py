"""Statistically valid lower bounds on ε from the outcomes of a privacy audit.

This module is over 500 lines because its three bounds share one result type, one set of input
checks and the derivations written out below, which a reader checking one bound needs beside the
others; the f-DP one-run bound, which only reuses the checks and the result type, lives in
:mod:`dpledger.audit.fdp_one_run`.

An accountant gives an *upper* bound on ε; an audit gives a *lower* bound that holds with a stated
confidence: "with probability at least ``confidence`` over the audit's randomness, the mechanism is
not (ε', δ)-DP for any ε' below the reported bound". Three methods are implemented, each returning
an :class:`EpsilonLowerBound` that names the method, the confidence and the counts it used.

**Clopper–Pearson** (Jagielski et al. 2020; Tramèr et al. 2022, "Debugging Differential Privacy",
Eq. 1). A distinguishing attack that guesses "the canary was included" is summarised by its counts
(TP, FP, FN, TN). If the mechanism is (ε, δ)-DP then every such test satisfies (Kairouz et al.
2015) FPR + e^ε·FNR ≥ 1 − δ and FNR + e^ε·FPR ≥ 1 − δ, hence

    ε ≥ max( ln((1 − δ − FNR) / FPR), ln((1 − δ − FPR) / FNR) ).

The rates are replaced by one-sided Clopper–Pearson upper confidence bounds (exact binomial, from
the beta distribution), each at level 1 − α/2 where α = 1 − confidence (Bonferroni), so the bound
holds at confidence 1 − α. Substituting upper bounds for the rates can only lower the right-hand
side, which keeps the bound valid.

**One run** (Steinke, Nasr & Jagielski 2023, "Privacy auditing with one (1) training run",
Corollary 5.4 and Appendix D). m canaries are each included independently with probability ½ in a
single training run; the auditor makes r guesses (abstaining on the rest) of which v are correct.
Under (ε, δ)-DP, with q = e^ε / (1 + e^ε) and X ~ Binomial(r, q),

    P[≥ v correct] ≤ p(ε) = P[X ≥ v] + 2·m·δ · max_{i = 1..v} P[v − i ≤ X < v] / i ,

and the bound is the largest ε with p(ε) < 1 − confidence (found with
:func:`scipy.optimize.brentq`). p is non-decreasing in ε whenever 2mδ ≤ 1 (each term of the max
has derivative in q at least f_v·(1 − 2mδ/i) ≥ 0, f_v the derivative of the Binomial tail), so the
rejected ε form an interval and the root is the bound. For 2mδ > 1 the analysis is not monotone
and this implementation reports 0.

**Gaussian DP** (Nasr et al. 2023, "Tight auditing of differentially private machine learning").
A μ-GDP mechanism has trade-off curve FNR ≥ Φ(Φ⁻¹(1 − FPR) − μ), so any test gives

    μ ≥ Φ⁻¹(1 − FPR) − Φ⁻¹(FNR) ≥ Φ⁻¹(1 − FPR_upper) − Φ⁻¹(FNR_upper),

with the same Clopper–Pearson upper bounds as above. The lower bound on μ is turned into ε at δ
with the exact μ-GDP privacy profile (Dong, Roth & Su 2019, Corollary 2.13)

    δ(ε) = Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2),

solved for ε by :func:`scipy.optimize.brentq`. This ε is a valid lower bound only under the
*assumption* that the mechanism's trade-off curve has the Gaussian shape (true for the Gaussian
mechanism and, approximately, for DP-SGD); the result records that assumption.

The f-DP one-run bound of Mahloujifar, Melis & Chaudhuri (2024), on the same guesses as the
one-run bound above, is in :mod:`dpledger.audit.fdp_one_run`.

The functions here take counts at *one* threshold chosen independently of the data that produced
the counts. To go from raw scores to a bound (choosing the threshold without voiding the
confidence), use :mod:`dpledger.audit.threshold_selection`.
"""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np
from scipy import optimize, special, stats

from dpledger.errors import InvalidParameterError
from dpledger.validation import check_enum

__all__ = [
    "BoundMethod",
    "ConfusionCounts",
    "EpsilonLowerBound",
    "bound_from_counts",
    "clopper_pearson_epsilon_bound",
    "clopper_pearson_upper",
    "gaussian_dp_delta",
    "gaussian_dp_epsilon",
    "gaussian_dp_epsilon_bound",
    "gaussian_dp_mu_bound",
    "one_run_epsilon_bound",
    "one_run_p_value",
]

GAUSSIAN_TRADEOFF_ASSUMPTION = (
    "the mechanism's trade-off curve is Gaussian (μ-GDP); the ε is derived from the μ lower bound "
    "through the μ-GDP privacy profile and is not a lower bound for other curve shapes"
)


# ---------------------------------------------------------------------------------- validators
def _check_count(name: str, value: Any) -> int:
    """A count: an integer ≥ 0 (bool and floats refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise InvalidParameterError(name, value, "an integer >= 0")
    return int(value)


def _check_confidence(value: Any, name: str = "confidence") -> float:
    """A confidence level in the open interval (0, 1)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 < value < 1.0:
        raise InvalidParameterError(name, value, "a number in the open interval (0, 1)")
    return float(value)


def _check_audit_delta(value: Any, name: str = "delta") -> float:
    """δ of the hypothesis under test: a number in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value < 1.0:
        raise InvalidParameterError(name, value, "a number in the half-open interval [0, 1)")
    return float(value)


def _clean_json(x: Any) -> Any:
    if isinstance(x, enum.Enum):
        return x.value
    if isinstance(x, float) and not math.isfinite(x):
        return "inf" if x > 0 else ("-inf" if x < 0 else "nan")
    if isinstance(x, Mapping):
        return {str(k): _clean_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean_json(v) for v in x]
    if isinstance(x, np.generic):
        return _clean_json(x.item())
    return x


def _frozen_mapping(value: Mapping[str, Any] | None) -> dict[str, Any]:
    return dict(value or {})


# ---------------------------------------------------------------------------------- results
class BoundMethod(str, enum.Enum):
    """How a lower bound on ε was computed."""

    CLOPPER_PEARSON = "clopper_pearson"
    ONE_RUN = "one_run"
    GAUSSIAN_DP = "gaussian_dp"
    FDP_ONE_RUN = "fdp_one_run"

    @classmethod
    def parse(cls, value: BoundMethod | str) -> BoundMethod:
        """The method named by ``value`` (a member or its string value)."""
        return check_enum("method", value, cls)


@attrs.frozen
class ConfusionCounts:
    """Outcome counts of a distinguishing attack at one threshold.

    Positives are runs *with* the canary. The attack guesses "included" when the score is at or
    above the threshold.

    Attributes:
        tp: runs with the canary guessed "included".
        fp: runs without the canary guessed "included".
        fn: runs with the canary guessed "not included".
        tn: runs without the canary guessed "not included".
    """

    tp: int = attrs.field(converter=lambda v: _check_count("tp", v))
    fp: int = attrs.field(converter=lambda v: _check_count("fp", v))
    fn: int = attrs.field(converter=lambda v: _check_count("fn", v))
    tn: int = attrs.field(converter=lambda v: _check_count("tn", v))

    @classmethod
    def from_scores(
        cls,
        scores_with_canary: Any,
        scores_without_canary: Any,
        *,
        threshold: float,
    ) -> ConfusionCounts:
        """Counts of the rule "included iff score ≥ threshold" on the two sets of scores."""
        s_in = _as_scores("scores_with_canary", scores_with_canary)
        s_out = _as_scores("scores_without_canary", scores_without_canary)
        t = float(threshold)
        if math.isnan(t):
            raise InvalidParameterError("threshold", threshold, "a number (not NaN)")
        tp = int(np.count_nonzero(s_in >= t))
        fp = int(np.count_nonzero(s_out >= t))
        return cls(tp=tp, fp=fp, fn=s_in.size - tp, tn=s_out.size - fp)

    @property
    def positives(self) -> int:
        """Number of runs with the canary (TP + FN)."""
        return self.tp + self.fn

    @property
    def negatives(self) -> int:
        """Number of runs without the canary (FP + TN)."""
        return self.fp + self.tn

    def as_dict(self) -> dict[str, int]:
        """``{"tp": …, "fp": …, "fn": …, "tn": …}``."""
        return {"tp": self.tp, "fp": self.fp, "fn": self.fn, "tn": self.tn}


def _as_scores(name: str, values: Any) -> np.ndarray:
    try:
        arr = np.asarray(values, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise InvalidParameterError(name, values, "a 1-D sequence of finite numbers") from None
    if not np.all(np.isfinite(arr)):
        raise InvalidParameterError(name, values, "a 1-D sequence of finite numbers")
    return arr


@attrs.frozen
class EpsilonLowerBound:
    """A lower bound on ε at a given δ, with the confidence it holds at.

    Reading: with probability at least ``confidence`` over the randomness of the audit, the audited
    mechanism is not (ε', δ)-DP for any ε' < ``epsilon``. ``epsilon`` is never negative and never
    NaN; 0 means the audit showed nothing.

    Attributes:
        epsilon: the lower bound (≥ 0; ∞ only for the Gaussian-DP method at δ = 0).
        delta: δ of the (ε, δ) hypotheses that were tested.
        confidence: 1 − α, the probability with which the bound holds.
        method: how the bound was computed.
        counts: the counts the bound was computed from (``tp, fp, fn, tn`` or ``m, r, v``).
        threshold: the score threshold the counts came from, when scores were given.
        selection: how the threshold (or the counts) were chosen, in words.
        assumption: an assumption the bound rests on beyond the audit itself (Gaussian DP), or
            None.
        details: method-specific numbers (rate upper bounds, μ, p-values, per-test confidence).
    """

    epsilon: float
    delta: float
    confidence: float
    method: BoundMethod
    counts: dict[str, int] = attrs.field(factory=dict, converter=_frozen_mapping)
    threshold: float | None = None
    selection: str = "counts given at a threshold fixed in advance"
    assumption: str | None = None
    details: dict[str, Any] = attrs.field(factory=dict, converter=_frozen_mapping)

    @property
    def alpha(self) -> float:
        """1 − confidence: the probability that the bound is wrong."""
        return 1.0 - self.confidence

    @property
    def vacuous(self) -> bool:
        """True when the bound is 0 (the audit showed nothing)."""
        return self.epsilon == 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready values (∞ as the string ``"inf"``)."""
        return _clean_json(attrs.asdict(self, recurse=False))


# ---------------------------------------------------------------------------------- Clopper–Pearson
def clopper_pearson_upper(successes: Any, trials: Any, *, confidence: float) -> Any:
    """One-sided Clopper–Pearson upper confidence bound on a binomial proportion.

    For k successes in n trials the bound at level 1 − a is the (1 − a)-quantile of
    Beta(k + 1, n − k), and 1 when k = n (in particular when n = 0). Works element-wise on arrays.

    Args:
        successes: k (integer or array of integers, 0 ≤ k ≤ n).
        trials: n (integer or array of integers ≥ 0).
        confidence: 1 − a, the one-sided coverage.

    Returns:
        The upper bound (a float, or an array like the inputs).
    """
    confidence = _check_confidence(confidence)
    k = np.asarray(successes)
    n = np.asarray(trials)
    if k.dtype.kind not in "iu" or n.dtype.kind not in "iu":
        raise InvalidParameterError("successes/trials", (successes, trials), "integers")
    if np.any(k < 0) or np.any(k > n):
        raise InvalidParameterError(
            "successes", successes, "integers with 0 <= successes <= trials"
        )
    k_f = k.astype(np.float64)
    n_f = n.astype(np.float64)
    full = k_f >= n_f
    # Beta(k+1, n-k) is undefined for k = n; the bound there is 1.
    b = np.where(full, 1.0, n_f - k_f)
    upper = np.where(full, 1.0, stats.beta.ppf(confidence, k_f + 1.0, b))
    if upper.ndim == 0:
        return float(upper)
    return upper


def _epsilon_from_rates(fpr: Any, fnr: Any, delta: float) -> Any:
    """max(ln((1−δ−FNR)/FPR), ln((1−δ−FPR)/FNR), 0), element-wise, 0 where vacuous."""
    fpr = np.asarray(fpr, dtype=np.float64)
    fnr = np.asarray(fnr, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.where(
            (1.0 - delta - fnr > 0) & (fpr > 0), np.log((1.0 - delta - fnr) / fpr), -np.inf
        )
        b = np.where(
            (1.0 - delta - fpr > 0) & (fnr > 0), np.log((1.0 - delta - fpr) / fnr), -np.inf
        )
    eps = np.maximum(np.maximum(a, b), 0.0)
    return eps


def _rate_upper_bounds(counts: ConfusionCounts, per_rate_confidence: float) -> tuple[float, float]:
    fpr_u = clopper_pearson_upper(counts.fp, counts.negatives, confidence=per_rate_confidence)
    fnr_u = clopper_pearson_upper(counts.fn, counts.positives, confidence=per_rate_confidence)
    return fpr_u, fnr_u


def clopper_pearson_epsilon_bound(
    counts: ConfusionCounts, *, delta: float, confidence: float
) -> EpsilonLowerBound:
    """Clopper–Pearson lower bound on ε from the counts of a distinguishing attack.

    ε ≥ max(ln((1 − δ − FNR⁺)/FPR⁺), ln((1 − δ − FPR⁺)/FNR⁺)) where FPR⁺ and FNR⁺ are one-sided
    Clopper–Pearson upper bounds, each at level 1 − α/2 (Bonferroni), α = 1 − confidence
    (Tramèr et al. 2022, Eq. 1 with Clopper & Pearson 1934). Returns 0 when the bound is vacuous.

    With N runs per side and perfect separation (FP = FN = 0) the bound reaches its ceiling
    ln((1 − δ − u)/u) with u = 1 − (α/2)^(1/N).

    Args:
        counts: the attack's (TP, FP, FN, TN) at one threshold chosen without these runs.
        delta: δ of the tested hypotheses, in [0, 1).
        confidence: 1 − α, in (0, 1).
    """
    if not isinstance(counts, ConfusionCounts):
        raise InvalidParameterError("counts", counts, "a ConfusionCounts")
    delta = _check_audit_delta(delta)
    confidence = _check_confidence(confidence)
    per_rate = 1.0 - (1.0 - confidence) / 2.0
    fpr_u, fnr_u = _rate_upper_bounds(counts, per_rate)
    eps = float(_epsilon_from_rates(fpr_u, fnr_u, delta))
    return EpsilonLowerBound(
        epsilon=eps,
        delta=delta,
        confidence=confidence,
        method=BoundMethod.CLOPPER_PEARSON,
        counts=counts.as_dict(),
        details={"fpr_upper": fpr_u, "fnr_upper": fnr_u, "per_rate_confidence": per_rate},
    )


# ---------------------------------------------------------------------------------- Gaussian DP
def gaussian_dp_delta(epsilon: float, *, mu: float) -> float:
    """δ(ε) of a μ-GDP mechanism: Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2) (Dong, Roth & Su 2019).

    Args:
        epsilon: ε ≥ 0.
        mu: μ ≥ 0 (μ = 0 gives δ = 0).
    """
    if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real) or not epsilon >= 0:
        raise InvalidParameterError("epsilon", epsilon, "a number >= 0")
    if isinstance(mu, bool) or not isinstance(mu, numbers.Real) or not 0 <= mu < math.inf:
        raise InvalidParameterError("mu", mu, "a finite number >= 0")
    mu = float(mu)
    eps = float(epsilon)
    if mu == 0.0 or math.isinf(eps):
        return 0.0
    first = stats.norm.cdf(-eps / mu + mu / 2.0)
    # e^ε·Φ(x) computed in log space so that large ε does not overflow.
    second = math.exp(eps + stats.norm.logcdf(-eps / mu - mu / 2.0))
    return float(min(max(first - second, 0.0), 1.0))


def gaussian_dp_epsilon(mu: float, *, delta: float) -> float:
    """The smallest ε with δ(ε) ≤ δ for a μ-GDP mechanism (0 if δ(0) ≤ δ; ∞ if δ = 0 < μ).

    Solves Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2) = δ with :func:`scipy.optimize.brentq`; δ(ε) is
    decreasing in ε.
    """
    if isinstance(mu, bool) or not isinstance(mu, numbers.Real) or not 0 <= mu < math.inf:
        raise InvalidParameterError("mu", mu, "a finite number >= 0")
    delta = _check_audit_delta(delta)
    mu = float(mu)
    if mu == 0.0:
        return 0.0
    if delta == 0.0:
        return math.inf
    if gaussian_dp_delta(0.0, mu=mu) <= delta:
        return 0.0
    hi = max(1.0, mu * mu)
    while gaussian_dp_delta(hi, mu=mu) > delta:
        hi *= 2.0
    return float(
        optimize.brentq(
            lambda e: gaussian_dp_delta(e, mu=mu) - delta, 0.0, hi, xtol=1e-12, rtol=1e-12
        )
    )


def _mu_from_rates(fpr: Any, fnr: Any) -> Any:
    """max(Φ⁻¹(1 − FPR) − Φ⁻¹(FNR), 0), element-wise."""
    fpr = np.asarray(fpr, dtype=np.float64)
    fnr = np.asarray(fnr, dtype=np.float64)
    mu = stats.norm.isf(fpr) - stats.norm.ppf(fnr)
    mu = np.where(np.isnan(mu), 0.0, mu)  # only when a rate is exactly 0 and the other 1
    return np.clip(mu, 0.0, np.inf)


def gaussian_dp_mu_bound(counts: ConfusionCounts, *, confidence: float) -> tuple[float, dict]:
    """Lower bound on μ: Φ⁻¹(1 − FPR⁺) − Φ⁻¹(FNR⁺), each rate bound at level 1 − α/2.

    Returns:
        (μ lower bound ≥ 0, details with the rate bounds).
    """
    if not isinstance(counts, ConfusionCounts):
        raise InvalidParameterError("counts", counts, "a ConfusionCounts")
    confidence = _check_confidence(confidence)
    per_rate = 1.0 - (1.0 - confidence) / 2.0
    fpr_u, fnr_u = _rate_upper_bounds(counts, per_rate)
    mu = float(_mu_from_rates(fpr_u, fnr_u))
    return mu, {"fpr_upper": fpr_u, "fnr_upper": fnr_u, "per_rate_confidence": per_rate}


def gaussian_dp_epsilon_bound(
    counts: ConfusionCounts, *, delta: float, confidence: float
) -> EpsilonLowerBound:
    """Gaussian-DP lower bound on ε (Nasr et al. 2023), valid if the trade-off curve is Gaussian.

    μ⁻ = max(Φ⁻¹(1 − FPR⁺) − Φ⁻¹(FNR⁺), 0) with Clopper–Pearson upper bounds at level 1 − α/2 each,
    then ε = the ε of μ⁻-GDP at δ (:func:`gaussian_dp_epsilon`). ``details["mu"]`` holds μ⁻.

    Args:
        counts: the attack's (TP, FP, FN, TN) at one threshold chosen without these runs.
        delta: δ, in [0, 1). At δ = 0 any μ⁻ > 0 gives ε = ∞.
        confidence: 1 − α, in (0, 1).
    """
    delta = _check_audit_delta(delta)
    mu, details = gaussian_dp_mu_bound(counts, confidence=confidence)
    eps = gaussian_dp_epsilon(mu, delta=delta)
    details["mu"] = mu
    return EpsilonLowerBound(
        epsilon=eps,
        delta=delta,
        confidence=float(confidence),
        method=BoundMethod.GAUSSIAN_DP,
        counts=counts.as_dict(),
        assumption=GAUSSIAN_TRADEOFF_ASSUMPTION,
        details=details,
    )


# ---------------------------------------------------------------------------------- one run
def _one_run_inputs(m: Any, r: Any, v: Any) -> tuple[int, int, int]:
    m = _check_count("num_canaries", m)
    r = _check_count("num_guesses", r)
    v = _check_count("num_correct", v)
    if r > m:
        raise InvalidParameterError("num_guesses", r, f"at most num_canaries = {m}")
    if v > r:
        raise InvalidParameterError("num_correct", v, f"at most num_guesses = {r}")
    return m, r, v


def _one_run_p(m: int, r: int, v: int, eps: float, delta: float) -> float:
    q = float(special.expit(eps))
    beta = float(stats.binom.sf(v - 1, r, q))  # P[X >= v]
    if delta == 0.0 or v == 0:
        return min(beta, 1.0)
    i = np.arange(1, v + 1)
    # P[v - i <= X < v] = P[X >= v - i] - P[X >= v]
    window = stats.binom.sf(v - i - 1, r, q) - beta
    alpha = float(np.max(window / i))
    return min(beta + alpha * 2.0 * m * delta, 1.0)


def one_run_p_value(
    *, num_canaries: int, num_guesses: int, num_correct: int, epsilon: float, delta: float
) -> float:
    """p-value of ≥ v correct guesses out of r under (ε, δ)-DP (Steinke et al. 2023, Cor. 5.4).

    p = P[X ≥ v] + 2·m·δ·max_{i=1..v} P[v − i ≤ X < v]/i with X ~ Binomial(r, e^ε/(1 + e^ε)),
    capped at 1.

    Args:
        num_canaries: m, canaries each included independently with probability ½.
        num_guesses: r ≤ m, guesses made (abstentions excluded).
        num_correct: v ≤ r, correct guesses.
        epsilon: ε ≥ 0 of the null hypothesis.
        delta: δ in [0, 1) of the null hypothesis.
    """
    m, r, v = _one_run_inputs(num_canaries, num_guesses, num_correct)
    if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real) or not epsilon >= 0:
        raise InvalidParameterError("epsilon", epsilon, "a number >= 0")
    delta = _check_audit_delta(delta)
    return _one_run_p(m, r, v, float(epsilon), delta)


def one_run_epsilon_bound(
    *,
    num_canaries: int,
    num_guesses: int,
    num_correct: int,
    delta: float,
    confidence: float,
) -> EpsilonLowerBound:
    """One-run lower bound on ε (Steinke, Nasr & Jagielski 2023): the largest ε rejected.

    The bound is the ε at which :func:`one_run_p_value` reaches α = 1 − confidence (0 when even
    ε = 0 is not rejected). p is non-decreasing in ε for 2mδ ≤ 1, so the root is unique; for
    2mδ > 1 the bound is reported as 0. Example: m = 1000, r = v = 100, δ = 1e-5, 95% → ≈ 3.47.

    Args:
        num_canaries: m, canaries each included independently with probability ½.
        num_guesses: r ≤ m, guesses made (fixed before seeing which canaries were included).
        num_correct: v ≤ r, correct guesses.
        delta: δ in [0, 1).
        confidence: 1 − α in (0, 1).
    """
    m, r, v = _one_run_inputs(num_canaries, num_guesses, num_correct)
    delta = _check_audit_delta(delta)
    confidence = _check_confidence(confidence)
    alpha = 1.0 - confidence
    counts = {"m": m, "r": r, "v": v}
    details: dict[str, Any] = {}
    p0 = _one_run_p(m, r, v, 0.0, delta) if r > 0 else 1.0
    details["p_value_at_zero"] = p0
    if 2.0 * m * delta > 1.0:
        eps = 0.0
        details["note"] = "2·m·δ > 1: the one-run p-value is not monotone in ε; bound set to 0"
    elif p0 >= alpha:
        eps = 0.0
    else:
        hi = 1.0
        while _one_run_p(m, r, v, hi, delta) < alpha:
            hi *= 2.0
        eps = float(
            optimize.brentq(
                lambda e: _one_run_p(m, r, v, e, delta) - alpha, 0.0, hi, xtol=1e-12, rtol=1e-12
            )
        )
    return EpsilonLowerBound(
        epsilon=eps,
        delta=delta,
        confidence=confidence,
        method=BoundMethod.ONE_RUN,
        counts=counts,
        selection="guesses fixed in advance",
        details=details,
    )


def bound_from_counts(
    counts: ConfusionCounts, *, method: BoundMethod | str, delta: float, confidence: float
) -> EpsilonLowerBound:
    """The ε lower bound of a two-sided method (Clopper–Pearson or Gaussian DP) at given counts."""
    method = BoundMethod.parse(method)
    if method is BoundMethod.CLOPPER_PEARSON:
        return clopper_pearson_epsilon_bound(counts, delta=delta, confidence=confidence)
    if method is BoundMethod.GAUSSIAN_DP:
        return gaussian_dp_epsilon_bound(counts, delta=delta, confidence=confidence)
    raise InvalidParameterError(
        "method",
        method.value,
        "'clopper_pearson' or 'gaussian_dp' for runs with and without "
        "the canary (the one-run method takes canary guesses: one_run_epsilon_bound)",
    )
