"""Replay views of a ledger: steps, their effective noise multiplier, and runs of identical steps.

A *step* is one sampling event plus the sum queries computed on that sample. By paper Eq. 1 a step
with queries (S_g, σ̃_g), g = 1..G, is one Gaussian sum query with noise multiplier

    z_eff = (Σ_g (S_g / σ̃_g)²)^(-1/2)

on the same sample, so for accounting a step is fully described by (q, z_eff). A step with no
query released nothing (z_eff = ∞, no privacy cost); a step with a σ̃ = 0 query is not private
(z_eff = 0, ε = ∞).
"""

from __future__ import annotations

import math
import numbers
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import attrs

from dpledger.errors import InvalidParameterError
from dpledger.ledger.events import (
    NeighboringRelation,
    SamplingEvent,
    SumQueryEvent,
    inverse_square_term,
)
from dpledger.validation import check_positive_int, check_probability

__all__ = [
    "CompressedLedger",
    "LedgerStep",
    "RunCompressor",
    "StepRun",
    "effective_noise_multiplier",
    "step_noise_multiplier",
]


def effective_noise_multiplier(inverse_square_sum: float, num_queries: int = 2) -> float:
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
    return effective_noise_multiplier(total, count)


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


@attrs.frozen(slots=True)
class StepRun:
    """``count`` consecutive steps that share the same (q, z_eff).

    Attributes:
        sampling_probability: q of every step in the run.
        noise_multiplier: z_eff of every step in the run (∞: nothing released; 0: not private).
        count: the number of steps, at least 1.
    """

    sampling_probability: float = attrs.field(converter=_run_probability)
    noise_multiplier: float = attrs.field(converter=_noise_multiplier)
    count: int = attrs.field(converter=_count)

    @property
    def is_private(self) -> bool:
        """False when some query of these steps had σ̃ = 0 (and q > 0)."""
        return self.noise_multiplier > 0.0 or self.sampling_probability == 0.0

    @property
    def releases_nothing(self) -> bool:
        """True when the steps cost no privacy (no query, or q = 0)."""
        return math.isinf(self.noise_multiplier) or self.sampling_probability == 0.0


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
        runs: consecutive runs of steps with identical (q, z_eff), in ledger order. Adjacent runs
            always differ (equal neighbours are merged).
    """

    neighboring: NeighboringRelation = attrs.field(
        default=NeighboringRelation.ADD_REMOVE, converter=NeighboringRelation.parse
    )
    runs: tuple[StepRun, ...] = attrs.field(default=(), converter=_runs_tuple)

    def __attrs_post_init__(self) -> None:
        for i, run in enumerate(self.runs):
            if not isinstance(run, StepRun):
                raise InvalidParameterError(f"runs[{i}]", run, "a StepRun")
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

    def distinct(self) -> dict[tuple[float, float], int]:
        """Total step count per distinct (q, z_eff), in order of first appearance.

        Composition is commutative, so accountants may compose each distinct step kind once with
        its total count.
        """
        out: dict[tuple[float, float], int] = {}
        for r in self.runs:
            key = (r.sampling_probability, r.noise_multiplier)
            out[key] = out.get(key, 0) + r.count
        return out

    def prefix(self, num_steps: int) -> CompressedLedger:
        """The ledger of the first ``num_steps`` steps."""
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 0:
            raise InvalidParameterError("num_steps", num_steps, "an integer >= 0")
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


def _merge_adjacent(runs: Sequence[StepRun]) -> tuple[StepRun, ...]:
    out: list[StepRun] = []
    for r in runs:
        if (
            out
            and out[-1].sampling_probability == r.sampling_probability
            and out[-1].noise_multiplier == r.noise_multiplier
        ):
            out[-1] = attrs.evolve(out[-1], count=out[-1].count + r.count)
        else:
            out.append(r)
    return tuple(out)


def _trusted_run(q: float, z: float, count: int) -> StepRun:
    """A StepRun from values the compressor produced (already valid): no re-validation."""
    run = object.__new__(StepRun)
    object.__setattr__(run, "sampling_probability", q)
    object.__setattr__(run, "noise_multiplier", z)
    object.__setattr__(run, "count", count)
    return run


class RunCompressor:
    """Builds the run-length view of a ledger one event at a time, in O(1) per event.

    The last step stays open (more queries may arrive) until the next sampling event; ``runs()``
    includes it as it stands. The arithmetic is that of :func:`step_noise_multiplier`, written
    out inline because this sits on the recording hot path, so runs and steps agree exactly.
    Finished runs are kept in three flat arrays (24 bytes per run).
    """

    __slots__ = ("_nq", "_q", "_rc", "_rq", "_rz", "_single", "_step_open", "_steps", "_sum")

    def __init__(self) -> None:
        self._rq = array("d")  # q of each finished run
        self._rz = array("d")  # z_eff of each finished run
        self._rc = array("q")  # number of steps of each finished run
        self._step_open = False
        self._q = 0.0
        self._sum = 0.0  # Σ (S/σ̃)² of the open step
        self._nq = 0
        self._single = math.inf  # σ̃/S of the open step's last query
        self._steps = 0

    @property
    def num_steps(self) -> int:
        """Number of steps seen (including the open one)."""
        return self._steps

    @property
    def num_runs(self) -> int:
        """Number of finished runs (the open step not included)."""
        return len(self._rc)

    @property
    def step_open(self) -> bool:
        """True after a sampling event, until the step is ended."""
        return self._step_open

    def add_sample(self, q: float) -> None:
        """A sampling event: ends the open step and opens a new one."""
        if self._step_open:
            self._fold()
        self._step_open = True
        self._q = q
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
        return effective_noise_multiplier(self._sum, nq)

    def _fold(self) -> None:
        nq = self._nq
        z = self._single if nq == 1 else effective_noise_multiplier(self._sum, nq)
        rc = self._rc
        if rc and self._rq[-1] == self._q and self._rz[-1] == z:
            rc[-1] += 1
        else:
            self._rq.append(self._q)
            self._rz.append(z)
            rc.append(1)

    def end_step(self) -> None:
        """Fold the open step into the runs; later queries need a new sampling event."""
        if self._step_open:
            self._fold()
            self._step_open = False

    def runs(self) -> tuple[StepRun, ...]:
        """The runs of identical steps so far, the open step included."""
        out = list(map(_trusted_run, self._rq, self._rz, self._rc))
        if self._step_open:
            q, z = self._q, self._open_z()
            if out and out[-1].sampling_probability == q and out[-1].noise_multiplier == z:
                out[-1] = _trusted_run(q, z, out[-1].count + 1)
            else:
                out.append(_trusted_run(q, z, 1))
        return tuple(out)
