"""Privacy-loss-distribution accountant: a thin bridge to dp-accounting's PLD machinery.

This module is over 500 lines because each kind of step a ledger holds (Poisson, full batch,
truncated Poisson, fixed size, epochs reduced to full batches) needs its own PLD and budget entry
inside the one replay that composes them all; the fixed-size pair and its proof are in
:mod:`~dpledger.accountants.without_replacement_pld`.

The privacy loss distribution (PLD) of a mechanism is the distribution of the log-likelihood
ratio of its outputs on the worst-case neighbouring pair; PLDs of composed mechanisms convolve,
and δ(ε) = E[(1 − e^{ε − L})₊] is read off the composed PLD (Koskela, Jälkö & Honkela 2020;
Doroshenko, Ghazi, Kamath, Kumar & Manurangsi 2022, "Connect the Dots"). dp-accounting builds the
PLD of a Poisson-subsampled Gaussian for both the add and the remove direction, discretises it
pessimistically (every loss rounded so that the computed δ(ε) is an upper bound), and composes
by FFT. We use exactly that, with two changes in how a ledger is fed to it:

* each distinct (q, z) is built once and self-composed with its *total* count (composition is
  commutative), so a ledger with R runs of K distinct steps costs K PLD constructions, not R;
* all full-batch steps (q = 1) together form one Gaussian mechanism with
  μ = √(Σ count·(sensitivity / z)²) (Gaussian mechanisms compose exactly), built once; a ledger
  of full-batch steps only needs no PLD at all: its privacy curve is exactly that of μ-GDP,
  δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) (Dong, Roth & Su 2019), computed in closed form
  (a discretised PLD of a Gaussian with large μ would need hundreds of millions of points).

Extreme inputs. Before building anything the accountant estimates the grid points and seconds
the PLDs need (:mod:`dpledger.accountants.budget`) and raises
:class:`~dpledger.errors.ComputationBudgetError` when they exceed ``memory_budget`` (default
256 MiB) or ``time_budget_s`` (default 60 s), naming the discretisation interval that would fit
or, when none would, the RDP accountant. Two conservative clamps keep dp-accounting's arithmetic
in range, each of which can only raise ε (the privacy loss is non-decreasing in q and
non-increasing in z): q below 10⁻¹² is raised to 10⁻¹², and z above 10⁴ (μ below 10⁻⁴ for the
full-batch Gaussian) is lowered to 10⁴.

Results are upper bounds (pessimistic estimate). Discretisation slack: the pessimistic
discretisation rounds each step's privacy loss up by less than the interval h, so the reported ε
exceeds the exact ε of the (clamped) ledger by less than (number of subsampled steps)·h, besides
the at most 10⁻¹⁵ of tail mass per composition that is moved to an infinite loss. Comparisons
between two results (e.g. monotonicity in T, q or z) hold up to that slack.

Truncated Poisson: dp-accounting's truncated subsampled Gaussian PLD for both neighbours of the
recorded n records (the data set holding the differing record has n records when it is removed,
n + 1 when one is added); the larger δ(ε) counts (:meth:`PldAccountant.distributions`).

Replace-one: a full-batch step changes the sum by up to 2S, so it is a Gaussian with sensitivity 2
(handled). For Poisson-subsampled steps under replace-one dp-accounting uses the pair
(1 − q)N(0, z²) + qN(∓1, z²); this module does not rely on that pair without a proof it can cite
and test, so such ledgers are refused with :class:`~dpledger.errors.UnsupportedLedgerError`.
Fixed-size steps (sampling without replacement, replace-one only) use the dominating pair of
:mod:`~dpledger.accountants.without_replacement_pld`, whose proof is written out there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from dpledger.accountants.base import Accountant, Answer
from dpledger.accountants.bucketing import check_bucketing, maybe_bucket
from dpledger.accountants.budget import (
    BYTES_PER_POINT,
    DEFAULT_MEMORY_BUDGET,
    DEFAULT_TIME_BUDGET_S,
    SECONDS_PER_BUILT_POINT,
    SECONDS_PER_COMPOSED_POINT,
    check_memory_budget,
    check_time_budget,
    composed_points,
    gaussian_loss_width,
    refuse_if_over,
)
from dpledger.accountants.gdp import gdp_delta, gdp_epsilon
from dpledger.accountants.pld_composition import self_compose
from dpledger.accountants.sampling_reduction import (
    NO_AMPLIFICATION_NOTE,
    has_epochs,
    reduce_epochs,
)
from dpledger.accountants.without_replacement_pld import without_replacement_pld
from dpledger.errors import InvalidParameterError, UnsupportedLedgerError
from dpledger.ledger.events import NeighboringRelation, SamplingScheme
from dpledger.ledger.steps import CompressedLedger, StepRun

__all__ = ["PldAccountant"]

_Q_FLOOR = 1e-12  # q below this is raised to it (conservative)
_Z_CAP = 1e4  # z above this is lowered to it (conservative)


def _clamped(q: float, z: float) -> tuple[float, float]:
    """(q, z) moved conservatively into the range dp-accounting computes reliably."""
    return max(q, _Q_FLOOR), min(z, _Z_CAP)


def _float(count: int) -> float:
    """A step count as a float (∞ beyond the float range)."""
    try:
        return float(count)
    except OverflowError:
        return math.inf


def _gaussian_term(count: int, factor: float, z: float) -> float:
    """count · (factor / z)², the μ² of ``count`` full-batch steps: ∞ when it overflows, and
    never rounded down to 0 (a step that costs anything keeps a positive μ²)."""
    try:
        term = (factor / z) ** 2
    except OverflowError:
        return math.inf
    return _float(count) * max(term, 5e-324)


def _clamped_mu_squared(mu_squared: float) -> float:
    return max(mu_squared, 1.0 / (_Z_CAP * _Z_CAP))


class PldAccountant(Accountant):
    """dp-accounting's PLD accountant (pessimistic), fed distinct steps with their counts.

    Args:
        value_discretization_interval: the PLD grid spacing of privacy-loss values (smaller is
            tighter and slower; dp-accounting's default is 1e-4).
        bucketing: None, or a relative precision r: round q up and z down first (conservative).
        memory_budget: the most bytes a computation may need by the up-front estimate (default
            :data:`~dpledger.accountants.budget.DEFAULT_MEMORY_BUDGET`, 256 MiB); beyond it
            :class:`~dpledger.errors.ComputationBudgetError` names the interval that would fit.
        time_budget_s: the most seconds a computation may take by the up-front estimate
            (default 60).
    """

    name = "pld"
    supports_replace_one = True
    supported_schemes = frozenset(
        {
            SamplingScheme.POISSON,
            SamplingScheme.FULL,
            SamplingScheme.TRUNCATED_POISSON,
            SamplingScheme.BALLS_IN_BINS,
            SamplingScheme.SHUFFLE,
            SamplingScheme.FIXED_SIZE,
        }
    )
    scheme_notes: ClassVar[Mapping[SamplingScheme, str]] = {}

    def __init__(
        self,
        *,
        value_discretization_interval: float = 1e-4,
        bucketing: float | None = None,
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
        time_budget_s: float = DEFAULT_TIME_BUDGET_S,
    ) -> None:
        v = value_discretization_interval
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < v <= 1.0:
            raise InvalidParameterError(
                "value_discretization_interval", v, "a number in (0, 1], e.g. 1e-4"
            )
        self.value_discretization_interval = float(v)
        self.bucketing = check_bucketing(bucketing)
        self.memory_budget = check_memory_budget(memory_budget)
        self.time_budget_s = check_time_budget(time_budget_s)

    def settings(self) -> dict[str, Any]:
        """The discretisation interval and the bucketing precision."""
        return {
            "value_discretization_interval": self.value_discretization_interval,
            "pessimistic_estimate": True,
            "bucketing": self.bucketing,
            "memory_budget": self.memory_budget,
            "time_budget_s": self.time_budget_s,
        }

    def check_supported(self, ledger: CompressedLedger) -> None:
        """Refuse Poisson-subsampled steps (0 < q < 1) under the replace-one relation."""
        super().check_supported(ledger)
        if ledger.neighboring is NeighboringRelation.REPLACE_ONE:
            for run in ledger.runs:
                if run.scheme is not SamplingScheme.POISSON:
                    continue  # full batch, or a scheme whose relations the base class checked
                if not run.releases_nothing and run.sampling_probability < 1.0:
                    raise UnsupportedLedgerError(
                        "the pld accountant supports the replace-one relation only for full-batch "
                        f"steps (q = 1); this ledger has steps with q = {run.sampling_probability}"
                        " under replace-one; record the ledger under add_remove or use full batches"
                    )

    # ------------------------------------------------------------------ PLD construction
    def _factor(self, ledger: CompressedLedger) -> float:
        return 2.0 if ledger.neighboring is NeighboringRelation.REPLACE_ONE else 1.0

    def _check_budget(
        self, distinct: dict[tuple[float, float], int], factor: float, evaluations: int = 1
    ) -> None:
        # (truncated Poisson steps are budgeted as the Poisson steps of the same q and z, twice:
        # their PLD is the Poisson one mixed with a sensitivity-2 part of the same grid, built
        # for the removed and the added record)
        """Refuse (ComputationBudgetError) when the PLDs of ``distinct`` (q, z) → count would
        exceed the memory or time budget; ``evaluations`` compositions of the result follow
        (one per curve point)."""
        h = self.value_discretization_interval
        peak, seconds, mu_squared = 0.0, 0.0, 0.0
        worst: tuple[float, float] = (1.0, math.inf)
        for (q, z), count in distinct.items():
            if q == 0.0 or math.isinf(z):
                continue
            if q == 1.0:
                mu_squared += _gaussian_term(count, factor, z)
                continue
            single, composed = composed_points(*_clamped(q, z), _float(count), h)
            seconds += single * SECONDS_PER_BUILT_POINT + composed * SECONDS_PER_COMPOSED_POINT
            if composed > peak:
                peak, worst = composed, (q, z)
        if mu_squared > 0.0:
            mu = math.sqrt(_clamped_mu_squared(mu_squared))
            single = gaussian_loss_width(mu) / h + 1.0
            seconds += single * SECONDS_PER_BUILT_POINT
            if single > peak:
                peak, worst = single, (1.0, 1.0 / mu)
        total = peak + (peak if len(distinct) > 1 else 0.0)  # a composition holds two operands
        seconds += evaluations * total * SECONDS_PER_COMPOSED_POINT
        # the grid shrinks in proportion to the interval: the interval that would fit
        shrink = max(total * BYTES_PER_POINT / self.memory_budget, seconds / self.time_budget_s)
        coarser = h * shrink
        if coarser <= 0.05:
            suggestion = (
                f"use PldAccountant(value_discretization_interval={_round_up(coarser):g}) "
                "(coarser, still an upper bound), a larger budget, or the rdp accountant"
            )
        else:
            suggestion = (
                f"no discretisation interval fine enough to be useful fits (the largest costly "
                f"step is q={worst[0]!r}, z={worst[1]!r}); use the rdp accountant, which "
                "needs no grid"
            )
        refuse_if_over(
            accountant=self.name,
            points=total,
            seconds=seconds,
            memory_budget=self.memory_budget,
            time_budget_s=self.time_budget_s,
            parameter="value_discretization_interval",
            value=h,
            suggestion=suggestion,
        )

    def _subsampled(self, q: float, z: float) -> Any:
        from dp_accounting.pld import privacy_loss_distribution as pld_lib

        q, z = _clamped(q, z)
        return pld_lib.from_gaussian_mechanism(
            standard_deviation=z,
            sampling_prob=q,
            pessimistic_estimate=True,
            value_discretization_interval=self.value_discretization_interval,
        )

    def _without_replacement(self, q: float, z: float) -> Any:
        q, z = _clamped(q, z)
        return without_replacement_pld(
            q, z, value_discretization_interval=self.value_discretization_interval
        )

    def _gaussian(self, mu_squared: float) -> Any:
        from dp_accounting.pld import privacy_loss_distribution as pld_lib

        return pld_lib.from_gaussian_mechanism(
            standard_deviation=1.0 / math.sqrt(_clamped_mu_squared(mu_squared)),
            pessimistic_estimate=True,
            value_discretization_interval=self.value_discretization_interval,
        )

    def _truncated(self, run: StepRun, added: int) -> Any:
        """The truncated subsampled Gaussian PLD of one step of ``run`` for the pair whose larger
        data set has n + ``added`` records (see :meth:`distributions`)."""
        from dp_accounting.pld import privacy_loss_distribution as pld_lib

        event = run.sampling
        assert event is not None and event.population_size is not None
        assert event.max_batch_size is not None
        q, z = _clamped(run.sampling_probability, run.noise_multiplier)
        return pld_lib.from_truncated_subsampled_gaussian_mechanism(
            dataset_size=event.population_size + added,
            sampling_probability=q,
            truncated_batch_size=event.max_batch_size,
            noise_multiplier=z,
            value_discretization_interval=self.value_discretization_interval,
        )

    def _compose(self, parts: list[Any]) -> Any:
        total = parts[0]
        for p in parts[1:]:
            total = total.compose(p)
        return total

    def _gaussian_only(self, ledger: CompressedLedger) -> float | None:
        """μ of the ledger if every costly step is full batch (else None)."""
        factor = self._factor(ledger)
        mu_squared = 0.0
        for run in ledger.runs:
            if run.releases_nothing:
                continue
            if run.sampling_probability < 1.0 or run.scheme is not SamplingScheme.FULL:
                return None
            mu_squared += _gaussian_term(run.count, factor, run.noise_multiplier)
        return math.sqrt(mu_squared)

    def distributions(self, ledger: CompressedLedger) -> list[Any]:
        """The composed dp-accounting ``PrivacyLossDistribution`` of each neighbouring pair of
        the ledger; its δ(ε) is the largest of theirs (an empty list if no step is costly).

        Each distinct subsampled (q, z) is self-composed once with its total count; all
        full-batch steps form one Gaussian; each epoch of balls-in-bins or shuffled steps is one
        full-batch step (no amplification, :mod:`~dpledger.accountants.sampling_reduction`);
        each run of truncated Poisson steps is dp-accounting's truncated subsampled Gaussian
        PLD, self-composed.

        Truncated Poisson needs two pairs. dp-accounting's construction takes the size N of the
        data set that *contains* the differing record: the record is cut from a full batch when
        at least ``max_batch_size`` of the N − 1 others are sampled (probability
        ``binom.sf(max_batch_size − 1, N − 1, q)``), and it builds both orders of that one pair.
        A run recorded with n records has neighbours of n − 1 records (the record removed: the
        larger set has N = n) and of n + 1 (a record added: N = n + 1); every step of a run
        sees the same pair, and the PLD is not known to be monotone in N (the probability of the
        record being kept given a truncation moves the other way), so the ledger's PLD is
        computed for both and δ(ε) (and ε(δ)) is the larger of the two. Without truncated runs
        there is one PLD.
        """
        ledger = maybe_bucket(reduce_epochs(ledger), self.bucketing)
        factor = self._factor(ledger)
        classic, truncated = _split_truncated(ledger)
        truncated = [run for run in truncated if not run.releases_nothing]
        classic, fixed = _split_fixed_size(classic)
        self._check_budget(_budget_items(classic, truncated, fixed), factor)
        mu_squared = 0.0
        parts = []
        for (q, z), count in classic.distinct().items():
            if q == 0.0 or math.isinf(z):
                continue
            if q == 1.0:
                mu_squared += _gaussian_term(count, factor, z)
            else:
                parts.append(self_compose(self._subsampled(q, z), count)[0])
        for (q, z), count in fixed.items():
            if q == 0.0 or math.isinf(z):
                continue
            if q == 1.0:
                mu_squared += _gaussian_term(count, factor, z)
            else:
                parts.append(self_compose(self._without_replacement(q, z), count)[0])
        if mu_squared > 0.0:
            parts.append(self._gaussian(mu_squared))
        if not truncated:
            return [self._compose(parts)] if parts else []
        rest = self._compose(parts) if parts else None
        pairs = []
        for added in (0, 1):  # the larger data set of the pair has n (removal) or n + 1 records
            own = [self_compose(self._truncated(run, added), run.count)[0] for run in truncated]
            pairs.append(self._compose(own if rest is None else [rest, *own]))
        return pairs

    def distribution(self, ledger: CompressedLedger) -> Any:
        """The composed dp-accounting ``PrivacyLossDistribution`` of a ledger's costly steps
        (None if no step is costly), for ledgers whose neighbouring pairs share one PLD.

        Raises:
            UnsupportedLedgerError: the ledger has truncated Poisson steps, whose δ(ε) is the
                larger of two PLDs' (:meth:`distributions`).
        """
        plds = self.distributions(ledger)
        if len(plds) > 1:
            raise UnsupportedLedgerError(
                "a ledger with truncated Poisson steps has two privacy loss distributions (the "
                "neighbour with one record removed and the one with one added); its δ(ε) is the "
                "larger of theirs: use PldAccountant.distributions"
            )
        return plds[0] if plds else None

    # ------------------------------------------------------------------ accountant hooks
    def _epsilon(self, ledger: CompressedLedger, delta: float) -> Answer:
        mu = self._gaussian_only(maybe_bucket(reduce_epochs(ledger), self.bucketing))
        if mu is not None:
            eps = gdp_epsilon(mu, delta)
            return Answer(eps, upper=eps, details=_details(ledger, closed_form_gaussian_mu=mu))
        plds = self.distributions(ledger)
        eps = max(0.0, *(float(pld.get_epsilon_for_delta(delta)) for pld in plds))
        return Answer(eps, upper=eps, details=_details(ledger, distinct_runs=_distinct(ledger)))

    def _delta(self, ledger: CompressedLedger, epsilon: float) -> Answer:
        mu = self._gaussian_only(maybe_bucket(reduce_epochs(ledger), self.bucketing))
        if mu is not None:
            delta = gdp_delta(mu, epsilon)
            return Answer(delta, upper=delta, details=_details(ledger, closed_form_gaussian_mu=mu))
        plds = self.distributions(ledger)
        delta = min(1.0, max(0.0, *(float(pld.get_delta_for_epsilon(epsilon)) for pld in plds)))
        return Answer(delta, upper=delta, details=_details(ledger, distinct_runs=_distinct(ledger)))

    def _epsilon_curve(
        self, ledger: CompressedLedger, delta: float, steps: Sequence[int]
    ) -> list[Answer]:
        if not ledger.is_poisson:
            # epochs and truncated runs do not map step counts to runs one to one
            return [self._epsilon(ledger.prefix(t), delta) for t in steps]
        return self._poisson_curve(ledger, delta, steps)

    def _poisson_curve(
        self, ledger: CompressedLedger, delta: float, steps: Sequence[int]
    ) -> list[Answer]:
        """Incremental: the subsampled part of the PLD after t_i steps is that after t_{i−1}
        composed with the steps in between (each distinct step's single-step PLD is built once);
        the full-batch steps so far are one Gaussian, composed in at each point (or, with no
        subsampled step yet, the closed form)."""
        ledger = maybe_bucket(ledger, self.bucketing)
        factor = self._factor(ledger)
        self._check_budget(ledger.distinct(), factor, evaluations=len(steps))
        base: dict[tuple[float, float], Any] = {}
        answers = []
        current = None  # PLD of the subsampled steps so far
        full_mu_squared = 0.0
        done = 0
        run_index, used_in_run = 0, 0
        runs = ledger.runs
        for t in steps:
            parts = [] if current is None else [current]
            need = t - done
            while need > 0:
                run = runs[run_index]
                take = min(need, run.count - used_in_run)
                q, z = run.sampling_probability, run.noise_multiplier
                if not run.releases_nothing:
                    if q == 1.0:
                        full_mu_squared += _gaussian_term(take, factor, z)
                    else:
                        if (q, z) not in base:
                            base[(q, z)] = self._subsampled(q, z)
                        parts.append(self_compose(base[(q, z)], take)[0])
                need -= take
                used_in_run += take
                if used_in_run == run.count:
                    run_index, used_in_run = run_index + 1, 0
            done = t
            if parts:
                current = self._compose(parts)
            if current is None:
                eps = gdp_epsilon(math.sqrt(full_mu_squared), delta)
            else:
                pld = current
                if full_mu_squared > 0.0:
                    pld = current.compose(self._gaussian(full_mu_squared))
                eps = max(0.0, float(pld.get_epsilon_for_delta(delta)))
            answers.append(Answer(eps, upper=eps))
        return answers


def _split_truncated(ledger: CompressedLedger) -> tuple[CompressedLedger, list[StepRun]]:
    """(the ledger without its truncated-Poisson runs, those runs)."""
    truncated = [r for r in ledger.runs if r.scheme is SamplingScheme.TRUNCATED_POISSON]
    if not truncated:
        return ledger, []
    rest = tuple(r for r in ledger.runs if r.scheme is not SamplingScheme.TRUNCATED_POISSON)
    return CompressedLedger(neighboring=ledger.neighboring, runs=rest), truncated


def _split_fixed_size(
    ledger: CompressedLedger,
) -> tuple[CompressedLedger, dict[tuple[float, float], int]]:
    """(the ledger without its fixed-size runs, their step count per distinct (q, z))."""
    fixed: dict[tuple[float, float], int] = {}
    for r in ledger.runs:
        if r.scheme is SamplingScheme.FIXED_SIZE:
            key = (r.sampling_probability, r.noise_multiplier)
            fixed[key] = fixed.get(key, 0) + r.count
    if not fixed:
        return ledger, fixed
    rest = tuple(r for r in ledger.runs if r.scheme is not SamplingScheme.FIXED_SIZE)
    return CompressedLedger(neighboring=ledger.neighboring, runs=rest), fixed


def _budget_items(
    classic: CompressedLedger,
    truncated: list[StepRun],
    fixed: dict[tuple[float, float], int] | None = None,
) -> dict[tuple[float, float], int]:
    """Distinct (q, z) → steps to budget for; a truncated run counts twice (two neighbouring
    pairs), a fixed-size (q, z) as Poisson steps at z/2, twice (two directions multiplied)."""
    items = dict(classic.distinct())
    for (q, z), count in (fixed or {}).items():
        key = (q, z / 2.0) if q < 1.0 else (q, z)
        items[key] = items.get(key, 0) + (2 * count if q < 1.0 else count)
    for run in truncated:
        key = (run.sampling_probability, run.noise_multiplier)
        items[key] = items.get(key, 0) + 2 * run.count
    return items


def _distinct(ledger: CompressedLedger) -> int:
    """The number of distinct steps the PLD is built from."""
    classic, truncated = _split_truncated(reduce_epochs(ledger))
    classic, fixed = _split_fixed_size(classic)
    return len(classic.distinct()) + len(truncated) + len(fixed)


def _details(ledger: CompressedLedger, **values: Any) -> dict[str, Any]:
    details: dict[str, Any] = dict(values)
    if has_epochs(ledger):
        details["sampling_note"] = NO_AMPLIFICATION_NOTE
    return details


def _round_up(x: float) -> float:
    """``x`` rounded up to one significant digit (a clean value to suggest)."""
    if not 0.0 < x < math.inf:
        return x
    scale = 10.0 ** math.floor(math.log10(x))
    return math.ceil(x / scale) * scale
