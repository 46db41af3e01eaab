"""The PRV accountant: certified (lower, estimate, upper) ε and δ for ledgers.

Gopi, Lee & Wutschitz (2021), "Numerical composition of differential privacy": discretise each
step's privacy loss random variable (PRV) on a mesh hℤ, compose by FFT, and bound the error. This
implementation keeps their structure (one self-composition per distinct run, composition across
runs, error bounds giving a (lower, estimate, upper) triple) with three changes that make every
bound hold without conditions on the regime:

* the discretisation "connects the dots" (see :mod:`.discretisation`), so the discrete pair
  dominates the true pair and the **upper bound needs no error term** for the mesh at all; the
  lower bound uses the coupling of the same discretisation (a Chernoff bound on the rounding,
  which plays the role of Gopi et al.'s Theorem 5.5);
* the mean is never shifted, so there is no "Discrete mean differs…" failure, and δ(ε) is
  evaluated with e^{ε−s} ≤ 1 only, so there is no overflow at large ε;
* every truncation (of each step, of the FFT window, of the spectrum) is bounded and charged to δ
  in the direction that keeps the bound valid (see :mod:`.composition`).

For the Poisson-subsampled Gaussian under add/remove both the remove pair (P, Q) and the add pair
(Q, P) are composed and the larger δ is kept. Full-batch steps are composed exactly as one
Gaussian mechanism. The replace-one relation uses the pair of mixtures with means ±1 (sensitivity
2S), not the add/remove pair with a doubled-but-unaccounted sensitivity.

The mesh is chosen from ``eps_error``: h = eps_error/√(k·log(1/η)/2) for k subsampled steps makes
the lower bound's shift about eps_error, so upper − lower ≤ 2·eps_error in the regimes we test.
``delta_error`` (default δ/1000) is the δ budget the truncations may use.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from dpledger.accountants.base import Accountant, Answer, ResultKind
from dpledger.accountants.bucketing import conservative_buckets
from dpledger.accountants.prv.composition import ComposedLoss, compose
from dpledger.accountants.prv.discretisation import DiscreteSteps, discretise_steps
from dpledger.accountants.prv.fallback import rdp_epsilon
from dpledger.accountants.prv.gaussian import gaussian_delta, gaussian_epsilon
from dpledger.accountants.prv.pairs import StepPair
from dpledger.errors import DPLedgerError, InvalidParameterError
from dpledger.ledger.events import NeighboringRelation
from dpledger.ledger.steps import CompressedLedger

__all__ = ["PrvAccountant", "PrvNumericalError"]

logger = logging.getLogger(__name__)

_REPORTS = ("upper", "estimate")
_DELTA_QUERY_ERROR = 1e-12
_MAX_COARSENINGS = 6
_SHIFT_SHARE = 1.2  # the mesh aims at a lower-bound shift t of about 1.4 eps_error


class PrvNumericalError(DPLedgerError, ArithmeticError):
    """A numerical check of the PRV accountant failed and no certified fallback applies."""


@attrs.frozen
class _Plan:
    """A ledger reduced to what the PRV needs: the subsampled runs and the Gaussian part."""

    runs: tuple[tuple[float, float, int], ...]  # distinct (q, z, count), 0 < q < 1
    gaussian: tuple[tuple[float, int], ...]  # (z, count) of full-batch runs, in ledger order
    replace_one: bool
    # ledger order: ("run", index into runs, count) or ("gaussian", index into gaussian, count)
    sequence: tuple[tuple[str, int, int], ...] = ()

    @property
    def steps(self) -> int:
        return sum(count for _, _, count in self.runs)

    @property
    def sensitivity(self) -> float:
        return 2.0 if self.replace_one else 1.0

    def gaussian_mu(self, counts: Sequence[int] | None = None) -> float:
        s = self.sensitivity
        zs = [z for z, _ in self.gaussian]
        used = [c for _, c in self.gaussian] if counts is None else list(counts)
        return math.sqrt(sum(c * (s / z) ** 2 for z, c in zip(zs, used, strict=True)))


def _plan(ledger: CompressedLedger) -> _Plan:
    replace = ledger.neighboring is NeighboringRelation.REPLACE_ONE
    index: dict[tuple[float, float], int] = {}
    counts: list[int] = []
    sequence: list[tuple[str, int, int]] = []
    gaussian: list[tuple[float, int]] = []
    for run in ledger.runs:
        q, z = run.sampling_probability, run.noise_multiplier
        if run.releases_nothing:
            sequence.append(("none", 0, run.count))
            continue
        if q == 1.0:
            sequence.append(("gaussian", len(gaussian), run.count))
            gaussian.append((z, run.count))
            continue
        key = (q, z)
        if key not in index:
            index[key] = len(counts)
            counts.append(0)
        counts[index[key]] += run.count
        sequence.append(("run", index[key], run.count))
    runs = tuple((q, z, counts[i]) for (q, z), i in index.items())
    return _Plan(runs=runs, gaussian=tuple(gaussian), replace_one=replace, sequence=tuple(sequence))


@attrs.frozen
class _Tuning:
    """What sets the mesh: the δ budget of the truncations, the target shift t, coarsening."""

    budget: float
    shift: float
    coarsen: int = 0


@attrs.frozen(eq=False)
class _Mesh:
    """The mesh and the discretised runs (remove and add directions)."""

    h: float
    remove: DiscreteSteps
    add: DiscreteSteps | None


@attrs.frozen
class _Bounds:
    """The composed laws of each direction for one ledger (or prefix)."""

    directions: tuple[ComposedLoss, ...]
    mesh_width: float

    def estimate(self, eps: float) -> float:
        return max(d.delta(eps) for d in self.directions)

    def upper(self, eps: float) -> float:
        return max(d.delta(eps) + d.upper_slack for d in self.directions)

    def top(self) -> float:
        return max(d.top for d in self.directions)


class PrvAccountant(Accountant):
    """Privacy random variable accountant (Gopi, Lee & Wutschitz 2021) with certified bounds.

    Every answer carries a certified lower and upper bound; by default the reported ε (or δ) is
    the upper bound (kind ``upper_bound``), with ``report="estimate"`` the estimate (kind
    ``estimate``). ``details`` holds the estimate, the mesh, the window sizes and every error term.

    Args:
        eps_error: target half-width of the certified ε interval: the mesh is chosen so that
            upper − lower ≤ 2·eps_error (a warning says when a memory limit forced a coarser
            mesh).
        delta_error: δ budget for truncation errors; None means δ/1000 for ε queries and 1e-12
            for δ queries.
        report: ``"upper"`` (default) or ``"estimate"``.
        bucketing: None, or a relative precision r in (0, 1): round q up and z down onto a
            geometric grid of ratio 1 + r first (:func:`conservative_buckets`), which keeps the
            upper bound valid and makes ledgers with a new noise multiplier every step cheap.
        max_points: the largest FFT window (mesh points) a full-spectrum composition may use.
    """

    name = "prv"
    default_kind = ResultKind.UPPER_BOUND
    supports_replace_one = True

    def __init__(
        self,
        *,
        eps_error: float = 0.01,
        delta_error: float | None = None,
        report: str = "upper",
        bucketing: float | None = None,
        max_points: int = 1 << 23,
    ) -> None:
        if (
            isinstance(eps_error, bool)
            or not isinstance(eps_error, (int, float))
            or not 0.0 < eps_error <= 1.0
        ):
            raise InvalidParameterError("eps_error", eps_error, "a number in (0, 1]")
        if delta_error is not None and (
            isinstance(delta_error, bool)
            or not isinstance(delta_error, (int, float))
            or not 0.0 < delta_error < 1.0
        ):
            raise InvalidParameterError("delta_error", delta_error, "None or a number in (0, 1)")
        if report not in _REPORTS:
            raise InvalidParameterError("report", report, "one of 'upper', 'estimate'")
        if bucketing is not None and (
            isinstance(bucketing, bool)
            or not isinstance(bucketing, (int, float))
            or not 0.0 < bucketing < 1.0
        ):
            raise InvalidParameterError(
                "bucketing", bucketing, "None or a relative precision in (0, 1)"
            )
        if isinstance(max_points, bool) or not isinstance(max_points, int) or max_points < 1024:
            raise InvalidParameterError("max_points", max_points, "an integer >= 1024")
        self.eps_error = float(eps_error)
        self.delta_error = None if delta_error is None else float(delta_error)
        self.report = report
        self.bucketing = None if bucketing is None else float(bucketing)
        self.max_points = max_points

    def settings(self) -> dict[str, Any]:
        """The accountant's settings."""
        return {
            "eps_error": self.eps_error,
            "delta_error": self.delta_error,
            "report": self.report,
            "bucketing": self.bucketing,
            "max_points": self.max_points,
        }

    @property
    def _kind(self) -> ResultKind:
        return ResultKind.UPPER_BOUND if self.report == "upper" else ResultKind.ESTIMATE

    # ------------------------------------------------------------------ preparation
    def _prepare(self, ledger: CompressedLedger) -> tuple[_Plan, dict[str, Any]]:
        info: dict[str, Any] = {}
        if self.bucketing is not None:
            before = len(ledger.distinct())
            ledger = conservative_buckets(ledger, relative_precision=self.bucketing)
            info["distinct_before_bucketing"] = before
            info["distinct_after_bucketing"] = len(ledger.distinct())
        return _plan(ledger), info

    def _mesh(self, plan: _Plan, tuning: _Tuning) -> _Mesh:
        k = plan.steps
        eta_shift, eta_out = 0.5 * tuning.budget, 0.2 * tuning.budget
        log_eta = math.log(1 / eta_shift)
        h = tuning.shift / math.sqrt(k * log_eta / 2)
        h = min(h, self.eps_error / 4) * (2.0**tuning.coarsen)
        lam = math.sqrt(8 * log_eta / k) / h  # where the lower bound's Chernoff bound is tight
        remove, add = discretise_steps(
            [StepPair(q, z, plan.replace_one) for q, z, _ in plan.runs],
            [c for _, _, c in plan.runs],
            h=h,
            out_mass=eta_out / k,
            shift_lambda=lam,
        )
        return _Mesh(h=h, remove=remove, add=add)

    def _compose(
        self,
        mesh: _Mesh,
        counts: Sequence[int],
        mu: float,
        budget: float,
        precise: bool = False,
    ) -> _Bounds:
        directions = []
        counts_array = np.asarray(counts, dtype=np.int64)
        for steps in (mesh.remove, mesh.add):
            if steps is None:
                continue
            directions.append(
                compose(
                    steps,
                    counts_array,
                    gaussian_mu=mu,
                    eta_wrap=0.05 * budget,
                    eta_band=0.1 * budget,
                    eta_shift=0.5 * budget,
                    max_points=self.max_points,
                    precise=precise,
                )
            )
        return _Bounds(directions=tuple(directions), mesh_width=mesh.h)

    def _checked_compose(
        self, mesh: _Mesh, counts: Sequence[int], mu: float, budget: float, target: float
    ) -> _Bounds:
        """Compose; redo in extended precision when the float64 rounding estimate is not small
        against ``target`` (the δ of interest); raise when even that does not suffice."""
        bounds = self._compose(mesh, counts, mu, budget)
        if max(d.float_error for d in bounds.directions) > 0.05 * target:
            bounds = self._compose(mesh, counts, mu, budget, precise=True)
        worst = max(d.float_error for d in bounds.directions)
        if worst > 0.25 * target:
            raise PrvNumericalError(
                f"floating-point error estimate {worst:.3g} is not small against {target:g}"
            )
        return bounds

    def _solve(
        self, plan: _Plan, tuning: _Tuning, run: Callable[[_Mesh, _Tuning], Any]
    ) -> tuple[Any, _Mesh, _Tuning]:
        """Build the mesh and run ``run`` on it, coarsening the mesh if memory limits demand."""
        for coarsen in range(_MAX_COARSENINGS + 1):
            tried = attrs.evolve(tuning, coarsen=coarsen)
            mesh = self._mesh(plan, tried)
            try:
                return run(mesh, tried), mesh, tried
            except MemoryError as exc:
                logger.info("PRV mesh %.3g too fine (%s); coarsening", mesh.h, exc)
        raise PrvNumericalError(
            "the PRV composition needs more than max_points="
            f"{self.max_points} mesh points even on a {2**_MAX_COARSENINGS}x coarser mesh"
        )

    def _initial_tuning(self, delta: float) -> _Tuning:
        budget = self.delta_error if self.delta_error is not None else delta * 1e-3
        return _Tuning(budget=min(budget, 0.5 * delta), shift=_SHIFT_SHARE * self.eps_error)

    # ------------------------------------------------------------------ ε
    def _epsilon(self, ledger: CompressedLedger, delta: float) -> Answer:
        plan, info = self._prepare(ledger)
        return self._epsilon_plan(plan, delta, info)

    def _epsilon_plan(self, plan: _Plan, delta: float, info: dict[str, Any]) -> Answer:
        mu = plan.gaussian_mu()
        if not plan.runs:
            lower, upper = gaussian_epsilon(delta, mu)
            details = {**info, "estimate": upper, "method": "gaussian_closed_form", "mu": mu}
            return Answer(upper, lower=lower, upper=upper, kind=self._kind, details=details)
        counts = [c for _, _, c in plan.runs]
        tuning = self._initial_tuning(delta)

        def run(mesh: _Mesh, tried: _Tuning) -> tuple[_Bounds, dict[str, float]]:
            return self._epsilon_on_mesh(mesh, counts, mu, delta, tried.budget)

        try:
            for _ in range(4):
                (bounds, found), mesh, used = self._solve(plan, tuning, run)
                retuned = self._retune(used, bounds, found, delta)
                if retuned is None:
                    break
                tuning = retuned
        except PrvNumericalError as exc:
            return self._fallback(plan, mu, delta, info, str(exc))
        return self._answer(found, bounds, mesh, used, info)

    def _retune(
        self, used: _Tuning, bounds: _Bounds, found: dict[str, float], delta: float
    ) -> _Tuning | None:
        """A finer tuning when the certified interval is wider than 2·eps_error, else None.

        The width is the lower bound's shift t plus the effect of the δ budget; each is
        shrunk in proportion. Not retuned when memory limits already coarsened the mesh.
        """
        width = found["upper"] - found["lower"]
        if width <= 2 * self.eps_error or used.coarsen > 0:
            return None
        shift = max(d.shift for d in bounds.directions)
        rest = max(width - shift, 0.0)
        budget = used.budget
        if self.delta_error is None and rest > 0.2 * self.eps_error:
            budget = used.budget * max(1e-4, 0.15 * self.eps_error / rest)
            rest = 0.15 * self.eps_error
        target = max(0.2 * self.eps_error, 1.9 * self.eps_error - rest)
        new_shift = used.shift * min(1.0, target / max(shift, 1e-300))
        if budget == used.budget and new_shift >= used.shift * 0.999:
            return None
        return _Tuning(budget=budget, shift=new_shift)

    def _epsilon_on_mesh(
        self, mesh: _Mesh, counts: Sequence[int], mu: float, delta: float, budget: float
    ) -> tuple[_Bounds, dict[str, float]]:
        bounds = self._checked_compose(mesh, counts, mu, budget, delta)
        return bounds, _search_epsilon(bounds, delta)

    def _answer(
        self,
        found: dict[str, float],
        bounds: _Bounds,
        mesh: _Mesh,
        used: _Tuning,
        info: dict[str, Any],
    ) -> Answer:
        lower, estimate, upper = found["lower"], found["estimate"], found["upper"]
        warnings: list[str] = []
        if upper - lower > 2 * self.eps_error * (1 + 1e-9):
            why = (
                f"the mesh was coarsened {2**used.coarsen}x to stay within max_points"
                if used.coarsen
                else "the delta_error budget given limits it"
                if self.delta_error is not None
                else "refining the mesh further did not narrow it"
            )
            warnings.append(
                f"the certified interval [{lower:.6g}, {upper:.6g}] is wider than "
                f"2*eps_error={2 * self.eps_error:g}: {why}"
            )
        value = upper if self.report == "upper" else estimate
        details = {**info, **_describe(bounds, mesh, used), "estimate": estimate}
        return Answer(
            value, lower=lower, upper=upper, kind=self._kind, warnings=warnings, details=details
        )

    def _fallback(
        self, plan: _Plan, mu: float, delta: float, info: dict[str, Any], reason: str
    ) -> Answer:
        if plan.replace_one:
            raise PrvNumericalError(
                f"{reason}; no certified fallback exists for the replace-one relation"
            )
        eps, order = rdp_epsilon(plan.runs, mu, delta)
        message = (
            f"PRV numerical check failed ({reason}); reporting the RDP upper bound instead "
            f"(order {order:g})"
        )
        logger.warning(message)
        return Answer(
            eps,
            lower=None,
            upper=eps,
            kind=ResultKind.UPPER_BOUND,
            warnings=(message,),
            details={**info, "method": "rdp_fallback", "rdp_order": order},
        )

    # ------------------------------------------------------------------ curve
    def _epsilon_curve(
        self, ledger: CompressedLedger, delta: float, steps: Sequence[int]
    ) -> list[Answer]:
        """ε after each prefix, on one mesh: the steps are discretised once for the whole ledger
        (a mesh fine enough for the last prefix is fine enough for every earlier one) and each
        prefix only recomposes in the Fourier domain. A point whose interval comes out wider
        than 2·eps_error is recomputed on its own, with the adaptive mesh of a single call.
        """
        plan, info = self._prepare(ledger)
        if not plan.runs:
            return [self._epsilon_plan(_prefix_plan(plan, t), delta, info) for t in steps]
        tuning = self._initial_tuning(delta)

        def run(mesh: _Mesh, tried: _Tuning) -> list[Answer | None]:
            answers: list[Answer | None] = []
            for t in steps:
                counts, gaussian_counts = _prefix_counts(plan, t)
                if not any(counts):
                    answers.append(None)
                    continue
                mu = plan.gaussian_mu(gaussian_counts)
                bounds, found = self._epsilon_on_mesh(mesh, counts, mu, delta, tried.budget)
                answer = self._answer(found, bounds, mesh, tried, info)
                answers.append(None if answer.warnings else answer)
            return answers

        try:
            computed, _, _ = self._solve(plan, tuning, run)
        except PrvNumericalError:
            computed = [None] * len(steps)
        return [
            a if a is not None else self._epsilon_plan(_prefix_plan(plan, t), delta, info)
            for a, t in zip(computed, steps, strict=True)
        ]

    # ------------------------------------------------------------------ δ
    def _delta(self, ledger: CompressedLedger, epsilon: float) -> Answer:
        plan, info = self._prepare(ledger)
        mu = plan.gaussian_mu()
        if not plan.runs:
            value = float(gaussian_delta(epsilon, mu))
            details = {**info, "estimate": value, "method": "gaussian_closed_form", "mu": mu}
            return Answer(value, lower=value, upper=value, kind=self._kind, details=details)
        budget = self.delta_error if self.delta_error is not None else _DELTA_QUERY_ERROR
        tuning = _Tuning(budget=budget, shift=_SHIFT_SHARE * self.eps_error)
        counts = [c for _, _, c in plan.runs]
        bounds, mesh, used = self._solve(
            plan, tuning, lambda m, tried: self._compose(m, counts, mu, tried.budget)
        )
        estimate = min(bounds.estimate(epsilon), 1.0)
        upper = min(bounds.upper(epsilon), 1.0)
        lower = max(0.0, max(d.delta(epsilon + d.shift) - d.lower_slack for d in bounds.directions))
        lower = min(lower, estimate)
        value = upper if self.report == "upper" else estimate
        details = {**info, **_describe(bounds, mesh, used), "estimate": estimate}
        return Answer(value, lower=lower, upper=upper, kind=self._kind, details=details)


# ---------------------------------------------------------------------------- helpers
def _prefix_counts(plan: _Plan, t: int) -> tuple[list[int], list[int]]:
    """Counts per distinct subsampled run and per full-batch run after ``t`` ledger steps."""
    counts = [0] * len(plan.runs)
    gaussian_counts = [0] * len(plan.gaussian)
    left = t
    for kind, i, c in plan.sequence:
        if left <= 0:
            break
        take = min(left, c)
        if kind == "run":
            counts[i] += take
        elif kind == "gaussian":
            gaussian_counts[i] += take
        left -= take
    return counts, gaussian_counts


def _prefix_plan(plan: _Plan, t: int) -> _Plan:
    counts, gaussian_counts = _prefix_counts(plan, t)
    runs = tuple((q, z, c) for (q, z, _), c in zip(plan.runs, counts, strict=True) if c > 0)
    gaussian = tuple((z, c) for (z, _), c in zip(plan.gaussian, gaussian_counts, strict=True) if c)
    return _Plan(runs=runs, gaussian=gaussian, replace_one=plan.replace_one)


def _bisect(pred: Callable[[int], bool], lo: int, hi: int) -> tuple[int, int | None]:
    """(j, last_false): the smallest j in [lo, hi] with pred(j), given pred(hi) holds.

    ``last_false`` is an index where pred was evaluated False (j − 1), or None if pred(lo).
    """
    if pred(lo):
        return lo, None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if pred(mid):
            hi = mid
        else:
            lo = mid
    return hi, lo


def _crossing(ok: Callable[[float], bool], h: float, hi: int) -> tuple[float | None, float]:
    """(a, b) with ok(b) and not ok(a) (a is None when ok(0)), b − a tiny, given ok(hi·h).

    First a bisection over mesh points, then over the reals inside the last mesh cell.
    """
    j, last_false = _bisect(lambda i: ok(i * h), 0, hi)
    if last_false is None:
        return None, 0.0
    a, b = last_false * h, j * h
    for _ in range(60):
        if b - a <= 1e-13 * max(1.0, b):
            break
        mid = 0.5 * (a + b)
        if ok(mid):
            b = mid
        else:
            a = mid
    return a, b


def _search_epsilon(bounds: _Bounds, delta: float) -> dict[str, float]:
    """Certified lower and upper ε and the estimate (see the module docstring)."""
    h = bounds.mesh_width
    extra = 0.0
    mu = bounds.directions[0].gaussian_mu
    if mu > 0:
        extra = gaussian_epsilon(delta / 4, mu)[1]
    hi = math.ceil((max(bounds.top(), 0.0) + extra) / h) + 2
    while bounds.upper(hi * h) > delta:
        hi = 2 * hi + 16
    _, upper = _crossing(lambda e: bounds.upper(e) <= delta, h, hi)
    a, b = _crossing(lambda e: bounds.estimate(e) <= delta, h, hi)
    estimate = b if a is None else 0.5 * (a + b)
    lower = 0.0
    for d in bounds.directions:
        a, _ = _crossing(lambda e, d=d: d.delta(e) - d.lower_slack <= delta, h, hi)
        if a is not None:
            lower = max(lower, a - d.shift)
    return {"lower": min(lower, estimate), "estimate": estimate, "upper": max(upper, estimate)}


def _describe(bounds: _Bounds, mesh: _Mesh, used: _Tuning) -> dict[str, Any]:
    names = ("remove", "add")
    out: dict[str, Any] = {
        "method": "prv",
        "mesh_width": mesh.h,
        "delta_budget": used.budget,
        "mesh_coarsened": 2**used.coarsen,
    }
    for name, d in zip(names, bounds.directions, strict=False):
        out[name] = {
            "window_points": d.size,
            "band": d.band,
            "spectrum": d.method,
            "lower_shift": d.shift,
            "upper_slack": d.upper_slack,
            "lower_slack": d.lower_slack,
            "wrap": d.wrap_below + d.wrap_above,
            "band_error": d.band_error,
            "float_error": d.float_error,
            "out_of_range": d.out_probability,
        }
    return out
