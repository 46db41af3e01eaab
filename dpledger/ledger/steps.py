"""Replay views of a ledger: steps, their effective noise multiplier, and runs of identical steps.

A *step* is one sampling event plus the sum queries computed on that sample. By paper Eq. 1 a step
with queries (S_g, σ̃_g), g = 1..G, is one Gaussian sum query with noise multiplier

    z_eff = (Σ_g (S_g / σ̃_g)²)^(-1/2)

on the same sample, so for accounting a step is fully described by (q, z_eff). A step with no
query released nothing (z_eff = ∞, no privacy cost); a step with a σ̃ = 0 query is not private
(z_eff = 0, ε = ∞).

This module is a little over 500 lines because it holds the one chain from a step's queries to
runs: z_eff, :class:`LedgerStep`, :class:`StepRun`, :class:`CompressedLedger` and the
:class:`RunCompressor` that builds the runs while recording, which all share the run checks.
"""

from __future__ import annotations

import math
import numbers
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import attrs

from dpledger.errors import InvalidParameterError, UnsupportedLedgerError
from dpledger.ledger.correlated import CorrelatedReleaseEvent
from dpledger.ledger.events import (
    NeighboringRelation,
    PrivacyUnit,
    SamplingEvent,
    SamplingScheme,
    SumQueryEvent,
    inverse_square_term,
)
from dpledger.validation import check_non_negative_int, check_positive_int, check_probability

__all__ = [
    "CompressedLedger",
    "EpochSegment",
    "LedgerStep",
    "RunCompressor",
    "StepRun",
    "noise_multiplier_from_inverse_square_sum",
    "step_noise_multiplier",
]


def noise_multiplier_from_inverse_square_sum(
    inverse_square_sum: float, num_queries: int = 2
) -> float:
    """z_eff from Σ_g (S_g/σ̃_g)² (paper Eq. 1): ∞ for no query, 0 for an infinite sum.

    Args:
        inverse_square_sum: Σ_g (S_g/σ̃_g)² over the step's queries (∞ if some σ̃_g = 0).
        num_queries: G, the number of queries in the step (0: the step released nothing).
    """
    if num_queries == 0 or inverse_square_sum == 0.0:
        return math.inf
    if math.isinf(inverse_square_sum):
        return 0.0
    return 1.0 / math.sqrt(inverse_square_sum)


def step_noise_multiplier(queries: Iterable[SumQueryEvent | tuple[float, float]]) -> float:
    """z_eff of one step from its queries' (S_g, σ̃_g) (paper Eq. 1).

    z_eff = (Σ_g (S_g/σ̃_g)²)^(-1/2), accumulated in the order given; a single query gives
    exactly σ̃/S (no round trip through the square); no query gives ∞; a σ̃ = 0 query gives 0.
    This is the arithmetic the ledger's run compression uses, so both views agree bit for bit.
    """
    total = 0.0
    count = 0
    single = math.inf
    for query in queries:
        if isinstance(query, SumQueryEvent):
            s, sigma = query.l2_norm_bound, query.noise_stddev
        else:
            s, sigma = query
        total += inverse_square_term(s, sigma)
        single = sigma / s
        count += 1
    if count == 1:
        return single
    return noise_multiplier_from_inverse_square_sum(total, count)


@attrs.frozen(slots=True)
class LedgerStep:
    """One step of a ledger: a sampling event and the sum queries computed on that sample.

    Attributes:
        index: 0-based position of the step in the ledger.
        sampling: the sampling event that opened the step.
        queries: the sum-query events of the step, in the order they were recorded.
    """

    index: int
    sampling: SamplingEvent
    queries: tuple[SumQueryEvent, ...]

    @property
    def sampling_probability(self) -> float:
        """q of the step's sample."""
        return self.sampling.sampling_probability

    @property
    def population_size(self) -> int | None:
        """n of the step's population (None if unknown)."""
        return self.sampling.population_size

    @property
    def noise_multiplier(self) -> float:
        """z_eff of paper Eq. 1 (∞ for a step without queries, 0 if some σ̃ = 0)."""
        return step_noise_multiplier(self.queries)


MAX_RUN_COUNT = 2**128
"""The most steps one run may hold: far beyond any training run (1e24 steps is 2**80), small
enough that every count prints and converts to a finite float."""


def _count(value: Any) -> int:
    count = check_positive_int("count", value)
    if count > MAX_RUN_COUNT:
        raise InvalidParameterError("count", value, "an integer in [1, 2**128]")
    return count


def _run_probability(value: Any) -> float:
    return check_probability("sampling_probability", value)


def _noise_multiplier(value: Any) -> float:
    expected = "a number >= 0 (inf allowed: the steps released nothing)"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidParameterError("noise_multiplier", value, expected)
    try:
        z = float(value)
    except (OverflowError, TypeError, ValueError):
        raise InvalidParameterError("noise_multiplier", value, expected) from None
    if not z >= 0.0:  # also NaN
        raise InvalidParameterError("noise_multiplier", value, expected)
    return z + 0.0


def _run_sampling(value: Any) -> SamplingEvent | None:
    if value is None or (isinstance(value, SamplingEvent) and not value.is_classic):
        return value
    raise InvalidParameterError(
        "sampling",
        value,
        "None (a record-level Poisson or full-batch step) or a SamplingEvent of another scheme "
        "or unit",
    )


def _sampling_matches(inst: StepRun, _attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and value.sampling_probability != inst.sampling_probability:
        raise InvalidParameterError(
            "sampling_probability",
            inst.sampling_probability,
            f"{value.sampling_probability!r}, the q of the run's sampling event",
        )


@attrs.frozen(slots=True)
class StepRun:
    """``count`` consecutive steps that share the same sampling and z_eff.

    Attributes:
        sampling_probability: q of every step in the run.
        noise_multiplier: z_eff of every step in the run (∞: nothing released; 0: not private).
        count: the number of steps, at least 1.
        sampling: the steps' sampling event when it is not a record-level Poisson or full-batch
            sample (its scheme, parameters and unit); None for those, which q describes fully.
    """

    sampling_probability: float = attrs.field(converter=_run_probability)
    noise_multiplier: float = attrs.field(converter=_noise_multiplier)
    count: int = attrs.field(converter=_count)
    sampling: SamplingEvent | None = attrs.field(
        default=None, converter=_run_sampling, validator=_sampling_matches, kw_only=True
    )

    @property
    def scheme(self) -> SamplingScheme:
        """The sampling scheme of the run's steps."""
        if self.sampling is not None:
            return self.sampling.scheme
        return SamplingScheme.FULL if self.sampling_probability == 1.0 else SamplingScheme.POISSON

    @property
    def unit(self) -> PrivacyUnit:
        """The unit of privacy of the run's steps."""
        return PrivacyUnit.RECORD if self.sampling is None else self.sampling.unit

    @property
    def is_private(self) -> bool:
        """False when some query of these steps had σ̃ = 0 (and q > 0)."""
        return self.noise_multiplier > 0.0 or self.sampling_probability == 0.0

    @property
    def releases_nothing(self) -> bool:
        """True when the steps cost no privacy (no query, or q = 0)."""
        return math.isinf(self.noise_multiplier) or self.sampling_probability == 0.0


def _neighboring(value: Any) -> NeighboringRelation:
    return NeighboringRelation.parse(value)


def _runs_tuple(value: Any) -> tuple[Any, ...]:
    try:
        return tuple(value)
    except TypeError:
        raise InvalidParameterError("runs", value, "an iterable of StepRun") from None


@attrs.frozen(slots=True)
class CompressedLedger:
    """A ledger reduced to what accounting needs: the relation and the runs of identical steps.

    Attributes:
        neighboring: the neighboring relation of the ledger.
        runs: consecutive runs of steps with identical sampling and z_eff, in ledger order.
            Adjacent runs always differ (equal neighbours are merged); runs of different
            sampling schemes are never mixed.
        correlated: the correlated-noise releases of the ledger, in order
            (:mod:`dpledger.ledger.correlated`). They are no steps: the accountants turn them
            into the Gaussian mechanisms they are equivalent to before composing
            (``dpledger/accountants/correlated.py``).
    """

    neighboring: NeighboringRelation = attrs.field(
        default=NeighboringRelation.ADD_REMOVE, converter=_neighboring
    )
    runs: tuple[StepRun, ...] = attrs.field(default=(), converter=_runs_tuple)
    correlated: tuple[CorrelatedReleaseEvent, ...] = attrs.field(
        default=(), converter=_runs_tuple, kw_only=True
    )

    def __attrs_post_init__(self) -> None:
        for i, run in enumerate(self.runs):
            if not isinstance(run, StepRun):
                raise InvalidParameterError(f"runs[{i}]", run, "a StepRun")
        for i, event in enumerate(self.correlated):
            if not isinstance(event, CorrelatedReleaseEvent):
                raise InvalidParameterError(f"correlated[{i}]", event, "a CorrelatedReleaseEvent")
        merged = _merge_adjacent(self.runs)
        if len(merged) != len(self.runs):
            object.__setattr__(self, "runs", merged)

    @classmethod
    def from_runs(
        cls,
        runs: Iterable[tuple[float, float, int] | StepRun],
        *,
        neighboring: NeighboringRelation | str = NeighboringRelation.ADD_REMOVE,
    ) -> CompressedLedger:
        """Build a compressed ledger from (sampling_probability, noise_multiplier, count) triples.

        This is how a training history kept elsewhere (for example an Opacus accountant's
        ``history`` of (noise_multiplier, sample_rate, steps)) becomes a ledger: note the order of
        the fields there differs from this function's.
        """
        built = []
        for i, r in enumerate(_runs_tuple(runs)):
            if isinstance(r, StepRun):
                built.append(r)
            elif isinstance(r, (tuple, list)) and len(r) == 3:
                built.append(StepRun(*r))
            else:
                expected = "a StepRun or a (sampling_probability, noise_multiplier, count) triple"
                raise InvalidParameterError(f"runs[{i}]", r, expected)
        return cls(neighboring=neighboring, runs=tuple(built))

    @property
    def num_steps(self) -> int:
        """Total number of steps."""
        return sum(r.count for r in self.runs)

    @property
    def schemes(self) -> tuple[SamplingScheme, ...]:
        """The sampling schemes of the ledger's steps, in order of first appearance."""
        return tuple(dict.fromkeys(r.scheme for r in self.runs))

    @property
    def units(self) -> tuple[PrivacyUnit, ...]:
        """The units of privacy of the ledger's steps, in order of first appearance."""
        return tuple(dict.fromkeys(r.unit for r in self.runs))

    @property
    def is_poisson(self) -> bool:
        """True when every step is a Poisson or full-batch sample (of records or of users)."""
        return all(
            r.sampling is None or r.sampling.scheme in (SamplingScheme.POISSON, SamplingScheme.FULL)
            for r in self.runs
        )

    def sampling_events(self) -> tuple[SamplingEvent, ...]:
        """The distinct non-classic sampling events of the ledger, in order of first appearance
        (epoch starts folded into the other steps of their scheme)."""
        seen: dict[SamplingEvent, None] = {}
        for r in self.runs:
            if r.sampling is not None:
                seen.setdefault(attrs.evolve(r.sampling, epoch_start=False), None)
        return tuple(seen)

    def distinct(self) -> dict[tuple[float, float], int]:
        """Total step count per distinct (q, z_eff), in order of first appearance.

        Composition is commutative, so accountants may compose each distinct step kind once with
        its total count. Only for ledgers of Poisson (and full-batch) steps: (q, z_eff) does
        not describe a step of another scheme, so this raises
        :class:`~dpledger.errors.UnsupportedLedgerError` for them rather than let them pass for
        Poisson steps.
        """
        if not self.is_poisson:
            raise UnsupportedLedgerError(
                "distinct() describes Poisson steps by (q, z_eff); this ledger also has steps "
                f"sampled by {', '.join(s.value for s in self.schemes)}"
            )
        out: dict[tuple[float, float], int] = {}
        for r in self.runs:
            key = (r.sampling_probability, r.noise_multiplier)
            out[key] = out.get(key, 0) + r.count
        return out

    def epoch_segments(self) -> tuple[EpochSegment, ...]:
        """The epochs of the ledger's epoch-based steps (balls-in-bins, shuffle), in order.

        See :meth:`epoch_view` for how epochs are delimited.
        """
        return tuple(item for item in self.epoch_view() if isinstance(item, EpochSegment))

    def epoch_view(self) -> tuple[StepRun | EpochSegment, ...]:
        """The ledger in order, with the steps of epoch-based schemes grouped into epochs.

        Runs of other schemes are kept as they are. An epoch starts at a step recorded with
        ``epoch_start=True`` (or at the first step of its scheme after a step of another kind)
        and holds the consecutive steps of the same sampling event that follow it. An epoch
        that holds more steps than the scheme's batches per epoch is counted as
        ⌈steps / batches⌉ epochs (conservative: no record can be in more batches than that).
        A step of another scheme in between ends the epoch. Each segment carries the smallest
        z_eff of its steps: the epoch is analysed as if every step had that noise (less noise
        never gives a smaller ε).
        """
        out: list[StepRun | EpochSegment] = []
        current: EpochSegment | None = None
        for r in self.runs:
            ev = r.sampling
            if ev is None or not ev.scheme.is_epoch_based:
                if current is not None:
                    out.append(current)
                    current = None
                out.append(r)
                continue
            base = attrs.evolve(ev, epoch_start=False)
            count = r.count
            z = r.noise_multiplier
            if ev.epoch_start or current is None or current.sampling != base:
                if current is not None:
                    out.append(current)
                # a run of epoch starts: every step but the last is a one-step epoch
                for _ in range(count - 1 if ev.epoch_start else 0):
                    out.append(EpochSegment(base, 1, z))
                current = EpochSegment(base, 1 if ev.epoch_start else count, z)
            else:
                current = EpochSegment(
                    base, current.steps + count, min(current.noise_multiplier, z)
                )
        if current is not None:
            out.append(current)
        return tuple(out)

    def prefix(self, num_steps: int) -> CompressedLedger:
        """The ledger of the first ``num_steps`` steps."""
        num_steps = check_non_negative_int("num_steps", num_steps)
        if num_steps > self.num_steps:
            raise InvalidParameterError(
                "num_steps", num_steps, f"at most the ledger's {self.num_steps} steps"
            )
        out: list[StepRun] = []
        left = num_steps
        for r in self.runs:
            if left == 0:
                break
            take = min(left, r.count)
            out.append(r if take == r.count else attrs.evolve(r, count=take))
            left -= take
        return CompressedLedger(neighboring=self.neighboring, runs=tuple(out))

    def __iter__(self) -> Iterator[StepRun]:
        return iter(self.runs)

    def __len__(self) -> int:
        return len(self.runs)


@attrs.frozen(slots=True)
class EpochSegment:
    """One epoch of an epoch-based sampling scheme, as replayed from the ledger.

    Attributes:
        sampling: the epoch's sampling event (with ``epoch_start=False``).
        steps: the steps recorded for the epoch.
        noise_multiplier: the smallest z_eff among them.
    """

    sampling: SamplingEvent
    steps: int
    noise_multiplier: float

    @property
    def epochs(self) -> int:
        """How many epochs the segment counts as: ⌈steps / batches per epoch⌉ (at least 1)."""
        per = self.sampling.batches_per_epoch or 1
        return max(1, -(-self.steps // per))


def _merge_adjacent(runs: Sequence[StepRun]) -> tuple[StepRun, ...]:
    out: list[StepRun] = []
    for r in runs:
        if (
            out
            and out[-1].sampling_probability == r.sampling_probability
            and out[-1].noise_multiplier == r.noise_multiplier
            and out[-1].sampling == r.sampling
        ):
            out[-1] = attrs.evolve(out[-1], count=out[-1].count + r.count)
        else:
            out.append(r)
    return tuple(out)


def _trusted_run(q: float, z: float, count: int, sampling: SamplingEvent | None = None) -> StepRun:
    """A StepRun from values the compressor produced (already valid): no re-validation."""
    run = object.__new__(StepRun)
    object.__setattr__(run, "sampling_probability", q)
    object.__setattr__(run, "noise_multiplier", z)
    object.__setattr__(run, "count", count)
    object.__setattr__(run, "sampling", sampling)
    return run


class RunCompressor:
    """Builds the run-length view of a ledger one event at a time, in O(1) per event.

    The last step stays open (more queries may arrive) until the next sampling event; ``runs()``
    includes it as it stands. The arithmetic is that of :func:`step_noise_multiplier`, written
    out inline because this sits on the recording hot path, so runs and steps agree exactly.
    Finished runs are kept in three flat arrays (24 bytes per run), plus a sparse map from run
    index to the sampling event of runs that are not record-level Poisson.
    """

    __slots__ = (
        "_nq",
        "_q",
        "_rc",
        "_rq",
        "_rs",
        "_rz",
        "_single",
        "_spec",
        "_step_open",
        "_steps",
        "_sum",
    )

    def __init__(self) -> None:
        self._rq = array("d")  # q of each finished run
        self._rz = array("d")  # z_eff of each finished run
        self._rc = array("q")  # number of steps of each finished run
        self._rs: dict[int, SamplingEvent] = {}  # run index -> sampling event, when not classic
        self._step_open = False
        self._q = 0.0
        self._spec: SamplingEvent | None = None  # the open step's event, when not classic
        self._sum = 0.0  # Σ (S/σ̃)² of the open step
        self._nq = 0
        self._single = math.inf  # σ̃/S of the open step's last query
        self._steps = 0

    @property
    def num_steps(self) -> int:
        """Number of steps seen (including the open one)."""
        return self._steps

    @property
    def step_open(self) -> bool:
        """True after a sampling event, until the step is ended."""
        return self._step_open

    def add_sample(self, q: float, sampling: SamplingEvent | None = None) -> None:
        """A sampling event: ends the open step and opens a new one.

        ``sampling`` is the event when it is not a record-level Poisson or full-batch sample
        (its q must be ``q``); None for those.
        """
        if self._step_open:
            self._fold()
        self._step_open = True
        self._q = q
        self._spec = sampling
        self._sum = 0.0
        self._nq = 0
        self._steps += 1

    def add_query(self, l2_norm_bound: float, noise_stddev: float) -> None:
        """A sum query on the open step (the caller checks that a step is open)."""
        if noise_stddev == 0.0:
            self._sum += math.inf
        else:
            ratio = l2_norm_bound / noise_stddev
            self._sum += ratio * ratio  # inverse_square_term(l2_norm_bound, noise_stddev)
        self._single = noise_stddev / l2_norm_bound
        self._nq += 1

    def _open_z(self) -> float:
        nq = self._nq
        if nq == 1:
            return self._single
        return noise_multiplier_from_inverse_square_sum(self._sum, nq)

    def _fold(self) -> None:
        nq = self._nq
        z = self._single if nq == 1 else noise_multiplier_from_inverse_square_sum(self._sum, nq)
        rc = self._rc
        spec = self._spec
        last = len(rc) - 1
        if rc and self._rq[-1] == self._q and self._rz[-1] == z and self._rs.get(last) == spec:
            rc[-1] += 1
        else:
            self._rq.append(self._q)
            self._rz.append(z)
            rc.append(1)
            if spec is not None:
                self._rs[last + 1] = spec

    def end_step(self) -> None:
        """Fold the open step into the runs; later queries need a new sampling event."""
        if self._step_open:
            self._fold()
            self._step_open = False

    def runs(self) -> tuple[StepRun, ...]:
        """The runs of identical steps so far, the open step included."""
        if self._rs:
            specs = self._rs
            out = [
                _trusted_run(q, z, c, specs.get(i))
                for i, (q, z, c) in enumerate(zip(self._rq, self._rz, self._rc, strict=True))
            ]
        else:
            out = list(map(_trusted_run, self._rq, self._rz, self._rc))
        if self._step_open:
            q, z, spec = self._q, self._open_z(), self._spec
            if (
                out
                and out[-1].sampling_probability == q
                and out[-1].noise_multiplier == z
                and out[-1].sampling == spec
            ):
                out[-1] = _trusted_run(q, z, out[-1].count + 1, spec)
            else:
                out.append(_trusted_run(q, z, 1, spec))
        return tuple(out)
