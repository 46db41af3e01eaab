"""The PRV accountant: certified (lower, estimate, upper) ε and δ for ledgers.

Gopi, Lee & Wutschitz (2021), "Numerical composition of differential privacy": discretise each
step's privacy loss random variable (PRV) on a mesh hℤ, compose by FFT, and bound the error. This
implementation keeps their structure (one self-composition per distinct run, composition across
runs, error bounds giving a (lower, estimate, upper) triple) with changes that make every bound
hold without conditions on the regime:

* the discretisation "connects the dots" (see :mod:`.discretisation`), so the discrete pair
  dominates the true pair and the **upper bound needs no error term** for the mesh at all; the
  lower bound uses the coupling of the same discretisation (a Chernoff bound on the rounding,
  which plays the role of Gopi et al.'s Theorem 5.5);
* the mean is never shifted, so there is no "Discrete mean differs…" failure, and δ(ε) is
  evaluated with e^{ε−s} ≤ 1 only, so there is no overflow at large ε;
* every truncation (of each step, of the FFT window, of the spectrum) is bounded and charged to δ
  in the direction that keeps the bound valid (see :mod:`.composition`); float64 rounding is
  estimated, the spectra are recomputed in extended precision when it is not small against δ,
  and if even that fails the answer is the RDP bound of :mod:`.fallback`, labelled as such;
* the spectra are band-limited when that is certified, so a ledger's cost grows with the number
  of atoms of its distinct steps, not with the FFT window.

For the Poisson-subsampled Gaussian under add/remove both the remove pair (P, Q) and the add pair
(Q, P) are composed and the larger δ is kept. Full-batch steps are composed exactly as one
Gaussian mechanism. The replace-one relation uses the pair of mixtures with means ±1 (sensitivity
2S), not the add/remove pair with a doubled-but-unaccounted sensitivity.

The mesh is chosen from ``eps_error``: h ≈ 1.2·eps_error/√(k·log(1/η)/2) for k subsampled steps
makes the lower bound's shift about 1.4·eps_error, so upper − lower ≤ 2·eps_error; when it is
not, the δ budget and the mesh are refined (a few times at most) and a warning says why if it
still is not. ``delta_error`` (default δ/1000) is the δ budget the truncations may use.

This module is over 500 lines because it is one class, :class:`PrvAccountant`: the plan of a
ledger, the mesh and the δ budget, the coarsening a memory limit forces and the retuning that
narrows the certified interval are shared by its ε, ε-curve and δ paths, which differ only in
what they compose and solve. The numerics it drives have their own modules: the discretisation
(:mod:`.discretisation`), the composition (:mod:`.composition`), the search for ε
(:mod:`.epsilon_search`), the Gaussian part (:mod:`.gaussian`) and the fallback
(:mod:`.fallback`).

Why we write our own rather than call a peer, measured with benchmarks/prv_bench.py on a
2-core Xeon (numbers in benchmarks/RESULTS.md): for q = 256/60000, z = 1.1, 14,062 steps,
δ = 1e-5 this accountant takes 4.9 ms with a certified width of 0.014, Opacus's float64 PRV
0.27–0.31 s (width 0.020), microsoft prv_accountant's float128 PRV 1.8 s (width 0.020) and
dp-accounting's PLD 0.27 s; on 100 distinct noise multipliers it takes 0.1 s against 23 s for
Opacus's PRV, 214 s for prv_accountant and 17.5 s for the PLD, and on 1,000 of them 1.6–3.2 s
(depending on the machine's load) against about 175 s for the PLD. Both PRV peers fail on
ledgers this accountant certifies (q = 0.5, z = 0.5, 1,000 steps: prv_accountant raises
"Discrete mean differs from continuous mean significantly", Opacus returns ε = ∞), and both
use the remove pair only.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from dpledger.accountants.base import Accountant, Answer, ResultKind
from dpledger.accountants.bucketing import conservative_buckets
from dpledger.accountants.budget import (
    DEFAULT_MEMORY_BUDGET,
    DEFAULT_TIME_BUDGET_S,
    check_memory_budget,
    check_time_budget,
    composed_points,
)
from dpledger.accountants.prv.composition import (
    MAX_MESH_INDEX,
    ComposedLoss,
    compose,
    compose_prefixes,
)
from dpledger.accountants.prv.deadline import (
    _DEADLINE,
    PrvNumericalError,
    _check_deadline,
    _time_budget,
)
from dpledger.accountants.prv.discretisation import DiscreteSteps, discretise_steps
from dpledger.accountants.prv.epsilon_search import _Bounds, _search_epsilon
from dpledger.accountants.prv.fallback import rdp_epsilon
from dpledger.accountants.prv.gaussian import gaussian_delta_bounds, gaussian_epsilon
from dpledger.accountants.prv.pairs import StepPair
from dpledger.errors import (
    ComputationBudgetError,
    InvalidParameterError,
    UnsupportedLedgerError,
)
from dpledger.ledger.events import NeighboringRelation
from dpledger.ledger.steps import CompressedLedger

__all__ = ["MAX_DISTINCT_STEPS", "PrvAccountant", "PrvNumericalError"]

logger = logging.getLogger(__name__)

_REPORTS = ("upper", "estimate")
_DELTA_QUERY_ERROR = 1e-12
_MAX_COARSENINGS = 6
_SHIFT_SHARE = 1.2  # the mesh aims at a lower-bound shift t of about 1.4 eps_error
MAX_DISTINCT_STEPS = 10_000  # about 0.4 MB of atoms each
_BYTES_PER_SEGMENT = 256.0  # edges, tails, masses, widths and atoms of one 256-point segment
_BYTES_PER_ATOM = 320.0  # positions, masses, tails and temporaries of one atom (~200 measured)
_REACH_MARGIN = 4.0  # the reach estimate may overstate; compose checks the exact window
_BYTES_PER_WINDOW_POINT = 32  # complex128 spectrum and one temporary per FFT window point
_BYTES_PER_CURVE_CELL = 256.0  # per (curve point, distinct step): counts, spectra powers
_TINY_BUDGET = 1e-300  # a truncation budget below this underflows the mesh arithmetic


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
        """μ of the full-batch part: √(Σ count·(sensitivity/z)²), ∞ when that overflows."""
        s = self.sensitivity
        zs = [z for z, _ in self.gaussian]
        used = [c for _, c in self.gaussian] if counts is None else list(counts)
        total = 0.0
        for z, c in zip(zs, used, strict=True):
            if c == 0:
                continue
            try:
                total += float(c) * max((s / z) ** 2, 5e-324)
            except OverflowError:
                return math.inf
        return math.sqrt(total)


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
        memory_budget: bytes the discretisation and composition may use by their up-front
            estimates (default :data:`~dpledger.accountants.budget.DEFAULT_MEMORY_BUDGET`,
            256 MiB): the truncated loss ranges may span at most ``memory_budget / 256``
            segments of 256 mesh points, and the FFT window at most
            min(``max_points``, ``memory_budget / 32``) points. Where even a 64× coarser mesh
            does not fit, ε queries fall back to the RDP bound (labelled in the details and
            warnings) and δ queries raise :class:`PrvNumericalError` naming these settings.
        time_budget_s: wall-clock seconds one question may take (default 60): checked before
            each discretisation and composition (each bounded by ``memory_budget``); when it
            has passed, ε queries fall back to the RDP bound (labelled) and δ queries raise
            :class:`PrvNumericalError`.
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
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
        time_budget_s: float = DEFAULT_TIME_BUDGET_S,
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
        self.memory_budget = check_memory_budget(memory_budget)
        self.time_budget_s = check_time_budget(time_budget_s)

    def settings(self) -> dict[str, Any]:
        """The accountant's settings."""
        return {
            "eps_error": self.eps_error,
            "delta_error": self.delta_error,
            "report": self.report,
            "bucketing": self.bucketing,
            "max_points": self.max_points,
            "memory_budget": self.memory_budget,
            "time_budget_s": self.time_budget_s,
        }

    def check_supported(self, ledger: CompressedLedger) -> None:
        """Also refuse ledgers with more than MAX_DISTINCT_STEPS distinct subsampled steps
        when bucketing is off (memory grows with them; bucketing collapses them)."""
        super().check_supported(ledger)
        if self.bucketing is None:
            distinct = sum(
                1 for (q, z) in ledger.distinct() if 0.0 < q < 1.0 and 0.0 < z < math.inf
            )
            if distinct > MAX_DISTINCT_STEPS:
                raise UnsupportedLedgerError(
                    f"the ledger has {distinct} distinct subsampled steps; the prv accountant "
                    f"handles at most {MAX_DISTINCT_STEPS} without bucketing: use "
                    "PrvAccountant(bucketing=1e-3), which keeps the upper bound valid"
                )

    @property
    def _window_limit(self) -> int:
        """The largest FFT window: max_points, and at most memory_budget / 32 points."""
        return max(1024, min(self.max_points, int(self.memory_budget // _BYTES_PER_WINDOW_POINT)))

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
        # the composed loss's reach in mesh widths, estimated before anything is allocated: a
        # mesh on which it lies far beyond exact index arithmetic cannot be composed
        reach = sum(
            composed_points(q, z / plan.sensitivity, float(c), h)[1] for q, z, c in plan.runs
        )
        if not reach <= _REACH_MARGIN * MAX_MESH_INDEX:
            raise MemoryError(
                f"the composed privacy loss reaches about {reach:.3g} mesh widths of {h!r} "
                f"(limit {MAX_MESH_INDEX:.3g})"
            )
        remove, add = discretise_steps(
            [StepPair(q, z, plan.replace_one) for q, z, _ in plan.runs],
            [c for _, _, c in plan.runs],
            h=h,
            out_mass=eta_out / k,
            shift_lambda=lam,
            max_segments=self.memory_budget / _BYTES_PER_SEGMENT,
            max_atoms=self.memory_budget / _BYTES_PER_ATOM,
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
                    max_points=self._window_limit,
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
            _check_deadline(self.time_budget_s)
            tried = attrs.evolve(tuning, coarsen=coarsen)
            try:
                mesh = self._mesh(plan, tried)
                return run(mesh, tried), mesh, tried
            except MemoryError as exc:
                logger.info("PRV mesh too fine at coarsening %d (%s); coarsening", coarsen, exc)
        raise PrvNumericalError(
            f"the PRV discretisation and composition need more than memory_budget="
            f"{self.memory_budget} bytes (FFT window limit {self._window_limit} points) even on "
            f"a {2**_MAX_COARSENINGS}x coarser mesh; use a larger eps_error (now "
            f"{self.eps_error!r}), a larger memory_budget, or the rdp accountant"
        )

    def _initial_tuning(self, delta: float) -> _Tuning:
        budget = self.delta_error if self.delta_error is not None else delta * 1e-3
        return _Tuning(budget=min(budget, 0.5 * delta), shift=_SHIFT_SHARE * self.eps_error)

    # ------------------------------------------------------------------ ε
    def _epsilon(self, ledger: CompressedLedger, delta: float) -> Answer:
        plan, info = self._prepare(ledger)
        with _time_budget(self.time_budget_s):
            return self._epsilon_plan(plan, delta, info)

    def _epsilon_plan(self, plan: _Plan, delta: float, info: dict[str, Any]) -> Answer:
        mu = plan.gaussian_mu()
        if not plan.runs:
            lower, upper = gaussian_epsilon(delta, mu)
            details = {**info, "estimate": upper, "method": "gaussian_closed_form", "mu": mu}
            return Answer(upper, lower=lower, upper=upper, kind=self._kind, details=details)
        counts = [c for _, _, c in plan.runs]
        tuning = self._initial_tuning(delta)
        if not 0.05 * tuning.budget > _TINY_BUDGET:
            return self._fallback(
                plan, mu, delta, info, f"δ={delta!r} is too small for a truncation budget"
            )

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
        # the answer carries the warning; whoever shows the answer shows it (once)
        logger.info(message)
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
        """ε after each prefix, incrementally: the steps are discretised once for the whole
        ledger (a mesh fine enough for the last prefix is fine enough for every earlier one),
        each direction's window, MGFs and per-step spectra are computed once
        (:func:`compose_prefixes`), and each prefix only raises the spectra to its counts and
        searches its ε. A prefix that this shared computation cannot certify as tightly as a
        single call (its wrap or band, its float error, or an interval wider than 2·eps_error)
        is computed on its own.
        """
        with _time_budget(self.time_budget_s):
            return self._epsilon_curve_within_budget(ledger, delta, steps)

    def _epsilon_curve_within_budget(
        self, ledger: CompressedLedger, delta: float, steps: Sequence[int]
    ) -> list[Answer]:
        plan, info = self._prepare(ledger)
        cells = float(len(steps)) * max(1, len(plan.runs))
        if cells * _BYTES_PER_CURVE_CELL > self.memory_budget:
            raise ComputationBudgetError(
                parameter="steps",
                value=f"<{len(steps)} step counts over {len(plan.runs)} distinct steps>",
                estimated_bytes=cells * _BYTES_PER_CURVE_CELL,
                budget_bytes=self.memory_budget,
                accountant=self.name,
                suggestion=(
                    "ask for fewer curve points, use PrvAccountant(bucketing=1e-3) to collapse "
                    "distinct steps, or a larger memory_budget"
                ),
            )
        if not plan.runs:
            return [self._epsilon_plan(_prefix_plan(plan, t), delta, info) for t in steps]
        tuning = self._initial_tuning(delta)
        if not 0.05 * tuning.budget > _TINY_BUDGET:
            return [self._epsilon_plan(_prefix_plan(plan, t), delta, info) for t in steps]
        rows = [_prefix_counts(plan, t) for t in steps]
        live = [i for i, (counts, _) in enumerate(rows) if any(counts)]
        answers: list[Answer | None] = [None] * len(steps)
        if live:
            counts = np.array([rows[i][0] for i in live], dtype=np.int64)
            mus = np.array([plan.gaussian_mu(rows[i][1]) for i in live])
            budget = tuning.budget
            try:
                mesh = self._mesh(plan, tuning)
                sides = [
                    _compose_in_groups(side, counts, mus, budget, self._window_limit)
                    for side in (mesh.remove, mesh.add)
                    if side is not None
                ]
            except MemoryError:  # each prefix on its own (coarsening or falling back)
                return [self._epsilon_point(plan, t, delta, info) for t in steps]
            hint, previous = None, None
            for j, i in enumerate(live):
                directions = tuple(side[j] for side in sides)
                if time.perf_counter() > _DEADLINE.get():
                    break  # the remaining points each fall back on their own
                try:
                    composed = tuple(d for d in directions if d is not None)
                    if len(composed) < len(directions):  # composed on its own window
                        bounds = self._checked_compose(
                            mesh, rows[i][0], float(mus[j]), budget, delta
                        )
                    else:
                        bounds = _Bounds(directions=composed, mesh_width=mesh.h)
                        if max(d.float_error for d in composed) > 0.05 * delta:
                            continue
                    found = _search_epsilon(bounds, delta, hint)
                except (PrvNumericalError, MemoryError):
                    continue
                # ε grows with the steps: the next crossings lie just above this one's
                step = max(found["upper"] - previous, 0.0) if previous is not None else 0.05
                previous = found["upper"]
                low = found["lower"] + max(d.shift for d in bounds.directions)
                hint = (max(low - 4 * self.eps_error, 0.0), previous + 3 * step + 0.01)
                answer = self._answer(found, bounds, mesh, tuning, info)
                if not answer.warnings:
                    answers[i] = answer
        return [
            a if a is not None else self._epsilon_point(plan, t, delta, info)
            for a, t in zip(answers, steps, strict=True)
        ]

    def _epsilon_point(self, plan: _Plan, t: int, delta: float, info: dict[str, Any]) -> Answer:
        """One curve point on its own; refused once the curve's time budget has passed (a
        fallback per point could take as long again for every remaining point)."""
        if time.perf_counter() > _DEADLINE.get():
            raise ComputationBudgetError(
                parameter="time_budget_s",
                value=self.time_budget_s,
                estimated_bytes=0.0,
                budget_bytes=float(self.memory_budget),
                estimated_seconds=self.time_budget_s,
                budget_seconds=self.time_budget_s,
                accountant=self.name,
                suggestion=(
                    "the curve ran out of time before every point was certified: ask for fewer "
                    "points, use a larger eps_error or time_budget_s, or the rdp accountant"
                ),
            )
        return self._epsilon_plan(_prefix_plan(plan, t), delta, info)

    # ------------------------------------------------------------------ δ
    def _delta(self, ledger: CompressedLedger, epsilon: float) -> Answer:
        with _time_budget(self.time_budget_s):
            return self._delta_within_budget(ledger, epsilon)

    def _delta_within_budget(self, ledger: CompressedLedger, epsilon: float) -> Answer:
        plan, info = self._prepare(ledger)
        mu = plan.gaussian_mu()
        if not plan.runs:
            lower, upper = gaussian_delta_bounds(epsilon, mu)  # certified, like ε's closed form
            details = {**info, "estimate": upper, "method": "gaussian_closed_form", "mu": mu}
            return Answer(upper, lower=lower, upper=upper, kind=self._kind, details=details)
        budget = self.delta_error if self.delta_error is not None else _DELTA_QUERY_ERROR
        tuning = _Tuning(budget=budget, shift=_SHIFT_SHARE * self.eps_error)
        counts = [c for _, _, c in plan.runs]
        bounds, mesh, used = self._solve(
            plan, tuning, lambda m, tried: self._compose(m, counts, mu, tried.budget)
        )
        warnings: list[str] = []
        scale = max(bounds.estimate(epsilon), used.budget)
        if max(d.float_error for d in bounds.directions) > 0.05 * scale:
            bounds = self._compose(mesh, counts, mu, used.budget, precise=True)
            worst = max(d.float_error for d in bounds.directions)
            if worst > 0.25 * max(bounds.estimate(epsilon), used.budget):
                warnings.append(
                    f"floating-point error estimate {worst:.3g} is not small against the "
                    "computed delta; it is included in the bounds, which are therefore wide"
                )
        estimate = min(bounds.estimate(epsilon), 1.0)
        upper = min(bounds.upper(epsilon), 1.0)
        lower = max(0.0, max(d.delta(epsilon + d.shift) - d.lower_slack for d in bounds.directions))
        lower = min(lower, estimate)
        value = upper if self.report == "upper" else estimate
        details = {**info, **_describe(bounds, mesh, used), "estimate": estimate}
        return Answer(
            value, lower=lower, upper=upper, kind=self._kind, warnings=warnings, details=details
        )


# ---------------------------------------------------------------------------- helpers
def _compose_in_groups(
    steps: DiscreteSteps, counts: np.ndarray, mus: np.ndarray, budget: float, max_points: int
) -> list[ComposedLoss | None]:
    """:func:`compose_prefixes` on all prefixes, then again on those it left out (the earliest,
    which need their own narrower window), up to three rounds."""
    out: list[ComposedLoss | None] = [None] * len(counts)
    todo = np.arange(len(counts))
    for _ in range(3):
        if todo.size == 0:
            break
        done = compose_prefixes(
            steps,
            counts[todo],
            gaussian_mu=mus[todo],
            eta_wrap=0.05 * budget,
            eta_band=0.1 * budget,
            eta_shift=0.5 * budget,
            max_points=max_points,
        )
        for index, loss in zip(todo, done, strict=True):
            out[index] = loss
        left = np.array([i for i, loss in zip(todo, done, strict=True) if loss is None])
        if left.size == todo.size:
            break
        todo = left.astype(np.int64)
    return out


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
