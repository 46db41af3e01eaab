"""Calibration: the noise multiplier, sampling probability or number of steps that meets (ε, δ).

For a training run of T identical Poisson-subsampled Gaussian steps (q, z), the ε an accountant
certifies at a fixed δ decreases in z and increases in q and T. Calibration finds the boundary
value — the smallest z, the largest q, the largest T — whose ε meets a target ε:

* z and q: Brent's method (``scipy.optimize.brentq``) on ε(x) − target over a bracketing interval,
  in log x (tolerance 10⁻⁶ in log x, i.e. relative 10⁻⁶ in x), then a final evaluation at the
  returned value; if floating point or discretisation put it on the wrong side, it is nudged
  to the safe side (z up, q down) in steps of 10⁻⁵ until ε ≤ target holds, so the value provably
  meets the target and lies within 0.1% of the boundary;
* T: steps are integers, so the largest T with ε(T) ≤ target is found exactly by doubling and
  then bisection on the integers (Brent's method needs a continuous function).

Which ε counts: a calibration must rest on a valid upper bound. For an accountant whose result has
a certified ``upper`` (the PRV accountant's upper bound) that is used; otherwise the result's ε is
used only if its kind is ``upper_bound``. An ``approximation`` or ``estimate`` without an upper
bound (GDP through the central limit theorem) is refused unless ``allow_approximation=True``, and
then the result says so in its kind and warnings.

If no value in the bracket reaches the target, :class:`~dpledger.errors.InvalidParameterError`
names the target and the bracket.

Work is bounded: the bracket search doubles at most ~24 times, Brent's method converges in a few
dozen evaluations and the step search in about 2·log₂(max_steps); every evaluation is one
accountant call under that accountant's own memory and time budgets. On top of that the whole
calibration stops with :class:`~dpledger.errors.ComputationBudgetError` once ``time_budget_s``
(default 60 s) has passed, naming the evaluations done and a faster accountant.

A planned run's length is given as ``steps=`` or as ``epochs=`` of :func:`steps_per_epoch`
(round(1/q)) steps each, the length of the PyTorch Poisson data loader.

This module is a little over 500 lines because it is one concept: the three calibrations share
their objective, bracket checks, safe-side finish and the planned run's length.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import attrs

from dpledger.accountants.base import (
    Accountant,
    PrivacyResult,
    ResultKind,
    make_accountant,
)
from dpledger.accountants.budget import DEFAULT_TIME_BUDGET_S, check_time_budget
from dpledger.accountants.result import _warnings_tuple
from dpledger.errors import ComputationBudgetError, InvalidParameterError
from dpledger.ledger.events import NeighboringRelation, SamplingEvent
from dpledger.ledger.steps import CompressedLedger, StepRun
from dpledger.sampling.validation import check_sampling_probability, default_steps
from dpledger.validation import (
    check_delta,
    check_positive_finite,
    check_positive_int,
    check_probability,
    warn_if_delta_too_large,
)

__all__ = [
    "CalibrationResult",
    "calibrate_noise_multiplier",
    "calibrate_sampling_probability",
    "calibrate_steps",
    "steps_per_epoch",
]

_BRENT_RTOL = 1e-6
_NUDGE = 1e-5
_MAX_NUDGES = 100  # 100 nudges of 1e-5 stay within 0.1%
_NOISE_LIMITS = (1e-3, 1e4)
_DEFAULT_MAX_STEPS = 10**8


@attrs.frozen
class CalibrationResult:
    """The calibrated value and the ε it gives.

    Attributes:
        parameter: ``"noise_multiplier"``, ``"sampling_probability"`` or ``"steps"``.
        value: the calibrated value (an int for steps).
        epsilon: the ε used for the decision at ``value`` (≤ ``target_epsilon``).
        delta: δ.
        target_epsilon: the target ε.
        accountant: the accountant's name.
        kind: the kind of ``epsilon`` (``upper_bound`` unless approximations were allowed).
        noise_multiplier: z of the calibrated run.
        sampling_probability: q of the calibrated run.
        steps: T of the calibrated run.
        evaluations: number of ε computations.
        seconds: wall time.
        warnings: plain-language warnings.
    """

    parameter: str
    value: float | int
    epsilon: float
    delta: float
    target_epsilon: float
    accountant: str
    kind: ResultKind
    noise_multiplier: float
    sampling_probability: float
    steps: int
    evaluations: int
    seconds: float
    warnings: tuple[str, ...] = attrs.field(default=(), converter=_warnings_tuple)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready values."""
        out = attrs.asdict(self, recurse=False)
        out["kind"] = self.kind.value
        out["warnings"] = list(self.warnings)
        return out


class _Objective:
    """ε of a one-run ledger as a function of the parameter being calibrated."""

    def __init__(
        self,
        accountant: Accountant,
        *,
        delta: float,
        neighboring: NeighboringRelation,
        allow_approximation: bool,
        build: Callable[[float], tuple[float, float, int]],
        time_budget_s: float = DEFAULT_TIME_BUDGET_S,
        sampling: SamplingEvent | None = None,
    ) -> None:
        self.accountant = accountant
        self.sampling = sampling
        self.time_budget_s = time_budget_s
        self.started = time.perf_counter()
        self.delta = delta
        self.neighboring = neighboring
        self.allow_approximation = allow_approximation
        self.build = build
        self.evaluations = 0
        self.kind = ResultKind.UPPER_BOUND
        self.cache: dict[float, float] = {}

    def certified(self, result: PrivacyResult) -> float:
        if result.upper is not None:
            return float(result.upper)
        if result.kind is ResultKind.UPPER_BOUND:
            return float(result.epsilon)
        if not self.allow_approximation:
            raise InvalidParameterError(
                "accountant",
                self.accountant.name,
                "an accountant whose ε is a valid upper bound for this ledger (its result here is "
                f"an {result.kind.value} without one); pass allow_approximation=True to calibrate "
                "on it anyway, with the result labelled as such",
            )
        self.kind = result.kind
        return float(result.epsilon)

    def __call__(self, x: float) -> float:
        if x in self.cache:
            return self.cache[x]
        elapsed = time.perf_counter() - self.started
        if elapsed > self.time_budget_s:
            raise ComputationBudgetError(
                parameter="time_budget_s",
                value=self.time_budget_s,
                estimated_bytes=0.0,
                budget_bytes=0.0,
                estimated_seconds=elapsed,
                budget_seconds=self.time_budget_s,
                accountant=self.accountant.name,
                suggestion=(
                    f"calibration stopped after {self.evaluations} evaluations; pass a larger "
                    "time_budget_s, a narrower bracket, or a faster accountant (rdp)"
                ),
            )
        q, z, t = self.build(x)
        run = StepRun(q, z, t, sampling=self.sampling)
        ledger = CompressedLedger.from_runs([run], neighboring=self.neighboring)
        value = self.certified(self.accountant.epsilon(ledger, delta=self.delta))
        self.evaluations += 1
        self.cache[x] = value
        return value


def _check_population(delta: float, population_size: Any) -> None:
    """Check n (when given) and warn when δ ≥ 1/n, pointing at the calibration's caller."""
    if population_size is not None:
        n = check_positive_int("population_size", population_size)
        warn_if_delta_too_large(delta=delta, population_size=n, stacklevel=3)


def _resolve(accountant: str | Accountant) -> Accountant:
    if isinstance(accountant, Accountant):
        return accountant
    return make_accountant(accountant)


def _check_target(target_epsilon: Any) -> float:
    expected = "a finite number > 0 (at most 1e300)"
    if isinstance(target_epsilon, bool) or not isinstance(target_epsilon, (int, float)):
        raise InvalidParameterError("target_epsilon", target_epsilon, expected)
    try:
        x = float(target_epsilon)
    except OverflowError:
        raise InvalidParameterError("target_epsilon", target_epsilon, expected) from None
    if not 0.0 < x <= 1e300:
        raise InvalidParameterError("target_epsilon", target_epsilon, expected)
    return x


def _check_bracket(bracket: Any, lo_limit: float, hi_limit: float) -> tuple[float, float]:
    try:
        lo, hi = (float(b) for b in bracket)
    except (TypeError, ValueError, OverflowError):
        raise InvalidParameterError("bracket", bracket, "a pair (low, high)") from None
    if not (lo_limit <= lo < hi <= hi_limit) or any(isinstance(b, bool) for b in bracket):
        raise InvalidParameterError(
            "bracket", bracket, f"a pair low < high within [{lo_limit:g}, {hi_limit:g}]"
        )
    return lo, hi


def _log_brent(objective: _Objective, target: float, lo: float, hi: float) -> float:
    """Brent's method on log x: ε(x) spans orders of magnitude in x, and the first trial points
    fall at geometric (not arithmetic) midpoints, where accountants are cheap to evaluate."""
    from scipy.optimize import brentq  # imported here: scipy.optimize takes ~1 s to import

    root = brentq(
        lambda u: objective(math.exp(u)) - target,
        math.log(lo),
        math.log(hi),
        xtol=_BRENT_RTOL,
        rtol=4 * 2.220446049250313e-16,
    )
    return math.exp(root)


def _finish(
    parameter: str,
    value: float | int,
    objective: _Objective,
    target: float,
    start: float,
    warnings: list[str],
) -> CalibrationResult:
    q, z, t = objective.build(value)
    if objective.kind is not ResultKind.UPPER_BOUND:
        warnings.append(
            f"calibrated on the {objective.accountant.name} accountant's {objective.kind.value}, "
            "which is not a valid upper bound: the returned value may not meet the target"
        )
    return CalibrationResult(
        parameter=parameter,
        value=value,
        epsilon=objective(value),
        delta=objective.delta,
        target_epsilon=target,
        accountant=objective.accountant.name,
        kind=objective.kind,
        noise_multiplier=z,
        sampling_probability=q,
        steps=t,
        evaluations=objective.evaluations,
        seconds=time.perf_counter() - start,
        warnings=tuple(warnings),
    )


def steps_per_epoch(sampling_probability: float) -> int:
    """round(1/q) (at least 1): the steps in which Poisson sampling sees n records on average,
    the length of an *epoch* of a planned run (and of the PyTorch Poisson data loader).

    Raises:
        InvalidParameterError: q outside (0, 1].
    """
    return default_steps(1.0 / check_sampling_probability(sampling_probability))


def _planned_steps(sampling_probability: float, steps: Any, epochs: Any) -> int:
    """T from ``steps``, or from ``epochs`` as max(1, round(epochs·round(1/q)))."""
    if (steps is None) == (epochs is None):
        raise InvalidParameterError(
            "steps", steps, "exactly one of steps= and epochs= (the length of the run)"
        )
    if steps is not None:
        return check_positive_int("steps", steps)
    e = check_positive_finite("epochs", epochs)
    return max(1, round(e * steps_per_epoch(sampling_probability)))


def _planned_sampling(
    sampling_probability: Any, num_batches: Any, population_size: Any
) -> tuple[float, SamplingEvent | None]:
    """(q, the balls-in-bins event or None for Poisson) of a planned run."""
    if (sampling_probability is None) == (num_batches is None):
        raise InvalidParameterError(
            "sampling_probability",
            sampling_probability,
            "exactly one of sampling_probability= (Poisson) and num_batches= (balls-in-bins)",
        )
    if num_batches is None:
        q = check_probability("sampling_probability", sampling_probability)
        if q == 0.0:
            raise InvalidParameterError("sampling_probability", sampling_probability, "q in (0, 1]")
        return q, None
    k = check_positive_int("num_batches", num_batches)
    n = k if population_size is None else int(population_size)
    event = SamplingEvent.balls_in_bins(k, n)
    return event.sampling_probability, event


def calibrate_noise_multiplier(
    *,
    target_epsilon: float,
    delta: float,
    sampling_probability: float | None = None,
    steps: int | None = None,
    epochs: float | None = None,
    accountant: str | Accountant | None = None,
    bracket: tuple[float, float] | None = None,
    neighboring: NeighboringRelation | str = NeighboringRelation.ADD_REMOVE,
    allow_approximation: bool = False,
    time_budget_s: float = DEFAULT_TIME_BUDGET_S,
    population_size: int | None = None,
    num_batches: int | None = None,
) -> CalibrationResult:
    """The smallest noise multiplier z (to 0.1%) whose ε at δ is at most ``target_epsilon``.

    The planned run samples its batches by Poisson sampling with rate ``sampling_probability``
    or, with ``num_batches`` = k instead, by balls-in-bins sampling with k batches per epoch
    (each record in one batch per epoch, chosen uniformly; certified with amplification by the
    ``random_allocation`` accountant).

    Args:
        target_epsilon: the ε to meet.
        delta: δ in (0, 1).
        sampling_probability: q of every Poisson-sampled step, in (0, 1]; or
        num_batches: k ≥ 1, the balls-in-bins batches per epoch (q = 1/k).
        steps: T, the number of steps; or
        epochs: the number of epochs of the planned run (T = max(1, round(epochs·E)) with
            E = :func:`steps_per_epoch` = round(1/q) steps per epoch, k for balls-in-bins).
        accountant: an accountant or its name (default: ``"prv"``, the PRV accountant's
            certified upper bound, the tightest valid ε for Poisson sampling; for balls-in-bins
            ``"random_allocation"``, its certified bound with amplification; or ``"rdp"``,
            ``"pld"``, ``"gdp"``).
        bracket: (low, high) to search; None searches from (0.5, 4), doubling or halving within
            [1e-3, 1e4] until the boundary is bracketed.
        neighboring: the neighboring relation of the ledger being planned.
        allow_approximation: accept an accountant's approximation (labelled in the result).
        time_budget_s: wall-clock seconds the calibration may take (default 60); checked
            before each evaluation.
        population_size: n, the number of records the run protects, if known: δ ≥ 1/n is
            warned about (:class:`~dpledger.errors.DeltaTooLargeWarning`); it does not change
            the calibration.

    Returns:
        A :class:`CalibrationResult` with ``value`` = z, ε(z) ≤ target, and ε(z / 1.001) > target
        up to the accountant's own numerical precision.

    Raises:
        InvalidParameterError: bad arguments, or no z in the bracket reaches the target.
        ComputationBudgetError: the time budget ran out, or an evaluation exceeded the
            accountant's budget.
    """
    start = time.perf_counter()
    target = _check_target(target_epsilon)
    delta = check_delta("delta", delta)
    _check_population(delta, population_size)
    q, sampling = _planned_sampling(sampling_probability, num_batches, population_size)
    t = _planned_steps(q, steps, epochs)
    relation = NeighboringRelation.parse(neighboring)
    if accountant is None:
        accountant = "prv" if sampling is None else "random_allocation"
    objective = _Objective(
        _resolve(accountant),
        delta=delta,
        neighboring=relation,
        allow_approximation=bool(allow_approximation),
        time_budget_s=check_time_budget(time_budget_s),
        build=lambda z: (q, z, t),
        sampling=sampling,
    )
    warnings: list[str] = []
    if bracket is None:
        lo, hi = 0.5, 4.0
        while objective(hi) > target:
            lo, hi = hi, hi * 2.0
            if hi > _NOISE_LIMITS[1]:
                raise InvalidParameterError(
                    "target_epsilon",
                    target_epsilon,
                    f"a target some noise multiplier ≤ {_NOISE_LIMITS[1]:g} reaches "
                    f"(q = {q}, {t} steps, δ = {delta})",
                )
        while objective(lo) <= target:
            lo, hi = lo / 2.0, lo
            if lo < _NOISE_LIMITS[0]:
                warnings.append(
                    f"every noise multiplier ≥ {hi:g} meets the target; returning {hi:g}"
                )
                return _finish("noise_multiplier", hi, objective, target, start, warnings)
    else:
        lo, hi = _check_bracket(bracket, 1e-6, 1e9)
        if objective(hi) > target:
            raise InvalidParameterError(
                "target_epsilon",
                target_epsilon,
                f"a target reached by a noise multiplier in the bracket [{lo:g}, {hi:g}] "
                f"(ε at {hi:g} is {objective(hi):.6g})",
            )
        if objective(lo) <= target:
            warnings.append(
                f"the lower end {lo:g} of the bracket already meets the target; the boundary "
                "lies below the bracket"
            )
            return _finish("noise_multiplier", lo, objective, target, start, warnings)
    z = min(hi, _log_brent(objective, target, lo, hi) * (1.0 + 2.0 * _BRENT_RTOL))
    for _ in range(_MAX_NUDGES):
        if objective(z) <= target:
            break
        z = min(hi, z * (1.0 + _NUDGE))
    else:  # pragma: no cover - only for an accountant whose ε is not monotone in z
        raise InvalidParameterError(
            "target_epsilon", target_epsilon, "a target the accountant meets monotonically in z"
        )
    return _finish("noise_multiplier", z, objective, target, start, warnings)


def calibrate_sampling_probability(
    *,
    target_epsilon: float,
    delta: float,
    noise_multiplier: float,
    steps: int,
    accountant: str | Accountant = "prv",
    bracket: tuple[float, float] = (1e-7, 1.0),
    neighboring: NeighboringRelation | str = NeighboringRelation.ADD_REMOVE,
    allow_approximation: bool = False,
    time_budget_s: float = DEFAULT_TIME_BUDGET_S,
    population_size: int | None = None,
) -> CalibrationResult:
    """The largest sampling probability q (to 0.1%) whose ε at δ is at most ``target_epsilon``.

    Returns q = the bracket's upper end (1.0 by default: full batch) when that already meets the
    target. See :func:`calibrate_noise_multiplier` for the arguments and guarantees.

    Raises:
        InvalidParameterError: bad arguments, or no q in the bracket reaches the target.
    """
    start = time.perf_counter()
    target = _check_target(target_epsilon)
    delta = check_delta("delta", delta)
    _check_population(delta, population_size)
    z = check_positive_finite("noise_multiplier", noise_multiplier)
    t = check_positive_int("steps", steps)
    relation = NeighboringRelation.parse(neighboring)
    lo, hi = _check_bracket(bracket, 0.0, 1.0)
    if lo == 0.0:
        raise InvalidParameterError("bracket", bracket, "a lower end > 0")
    objective = _Objective(
        _resolve(accountant),
        delta=delta,
        neighboring=relation,
        allow_approximation=bool(allow_approximation),
        time_budget_s=check_time_budget(time_budget_s),
        build=lambda q: (q, z, t),
    )
    if objective(hi) <= target:
        return _finish("sampling_probability", hi, objective, target, start, [])
    if objective(lo) > target:
        raise InvalidParameterError(
            "target_epsilon",
            target_epsilon,
            f"a target reached by a sampling probability in the bracket [{lo:g}, {hi:g}] "
            f"(ε at {lo:g} is {objective(lo):.6g})",
        )
    q = max(lo, _log_brent(objective, target, lo, hi) * (1.0 - 2.0 * _BRENT_RTOL))
    for _ in range(_MAX_NUDGES):
        if objective(q) <= target:
            break
        q = max(lo, q * (1.0 - _NUDGE))
    else:  # pragma: no cover - only for an accountant whose ε is not monotone in q
        raise InvalidParameterError(
            "target_epsilon", target_epsilon, "a target the accountant meets monotonically in q"
        )
    return _finish("sampling_probability", q, objective, target, start, [])


def calibrate_steps(
    *,
    target_epsilon: float,
    delta: float,
    noise_multiplier: float,
    sampling_probability: float,
    accountant: str | Accountant = "prv",
    max_steps: int = _DEFAULT_MAX_STEPS,
    neighboring: NeighboringRelation | str = NeighboringRelation.ADD_REMOVE,
    allow_approximation: bool = False,
    time_budget_s: float = DEFAULT_TIME_BUDGET_S,
    population_size: int | None = None,
) -> CalibrationResult:
    """The largest number of steps T ≤ ``max_steps`` whose ε at δ is at most ``target_epsilon``.

    Exact on the integers (doubling, then bisection). Returns ``max_steps`` with a warning when
    even that meets the target.

    Raises:
        InvalidParameterError: bad arguments, or a single step already exceeds the target.
    """
    start = time.perf_counter()
    target = _check_target(target_epsilon)
    delta = check_delta("delta", delta)
    _check_population(delta, population_size)
    z = check_positive_finite("noise_multiplier", noise_multiplier)
    q = check_probability("sampling_probability", sampling_probability)
    if q == 0.0:
        raise InvalidParameterError("sampling_probability", sampling_probability, "q in (0, 1]")
    cap = check_positive_int("max_steps", max_steps)
    relation = NeighboringRelation.parse(neighboring)
    objective = _Objective(
        _resolve(accountant),
        delta=delta,
        neighboring=relation,
        allow_approximation=bool(allow_approximation),
        time_budget_s=check_time_budget(time_budget_s),
        build=lambda t: (q, z, int(t)),
    )
    if objective(1) > target:
        raise InvalidParameterError(
            "target_epsilon",
            target_epsilon,
            f"a target one step already meets (one step gives ε = {objective(1):.6g})",
        )
    good, bad = 1, None
    probe = 2
    while probe <= cap:
        if objective(probe) <= target:
            good, probe = probe, probe * 2
        else:
            bad = probe
            break
    if bad is None:
        if objective(cap) <= target:
            warnings = [f"max_steps = {cap} steps still meet the target"]
            return _finish("steps", cap, objective, target, start, warnings)
        bad = cap
    while bad - good > 1:
        mid = (good + bad) // 2
        if objective(mid) <= target:
            good = mid
        else:
            bad = mid
    return _finish("steps", good, objective, target, start, [])
