"""One sampled step: a sampling event followed by the sum queries computed on that sample.

:func:`sampled_step` records the sampling event (q, n) in the ledger and yields a
:class:`SampledStep` through which the step's queries run; the step knows its ledger, generator
and backend, so each query call is short, and it knows q and n for the fixed-denominator average::

    with sampled_step(ledger, sampling_probability=q, population_size=n, generator=rng) as step:
        kernel, bias = step.run(layer_query, [kernel_grads, bias_grads])
        kernel_avg, bias_avg = step.average([kernel, bias])

:class:`StepEvents` is the sampling event of every step of a run, from the sampler that draws
its batches (with ``epoch_start`` on the first step of each epoch of the epoch-based schemes;
docs/architecture.md, "Soundness rules", rule 6).

A query through a step that has ended (the ``with`` block exited, or a later sampling event was
recorded in the same ledger) is refused with :class:`~dpledger.errors.LedgerStateError`, so a
query can never be attributed to the wrong sample.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, overload

import numpy as np

from dpledger.errors import InvalidParameterError, LedgerStateError
from dpledger.ledger import NeighboringRelation, PrivacyLedger, SamplingEvent, SamplingScheme
from dpledger.mechanisms.averaging import fixed_denominator_average, realised_batch_average
from dpledger.mechanisms.backend import Array, ArrayBackend, resolve_backend
from dpledger.mechanisms.grouped import GroupedSumQuery, PreparedRelease
from dpledger.mechanisms.noise_provenance import note_numpy_provenance
from dpledger.mechanisms.sum_query import GaussianSumQuery
from dpledger.sampling.poisson import PoissonSampler
from dpledger.validation import check_positive_int, check_probability

if TYPE_CHECKING:
    from dpledger.mechanisms.adaptive import AdaptiveClipping

__all__ = ["SampledStep", "StepEvents", "open_step", "sampled_step", "step_events_of"]


class SampledStep:
    """A step whose sampling event is recorded; queries run through it on that sample.

    Created by :func:`sampled_step`; not constructed directly.

    Attributes:
        ledger: the ledger the step's events go to.
        sampling_probability: q of the sample.
        population_size: n, or None if unknown.
        index: 0-based index of the step in the ledger.
        generator: the random generator used for noise (may be None if only given per call).
        backend: the array backend.
        indices: the sampled record indices, when the step drew its sample from a
            :class:`~dpledger.sampling.PoissonSampler` (``sampled_step(ledger, sampler=...)``;
            else None).
        event: the recorded sampling event (its scheme decides the average's denominator).
    """

    def __init__(
        self,
        *,
        ledger: PrivacyLedger,
        sampling_probability: float,
        population_size: int | None,
        generator: Any,
        backend: ArrayBackend,
        indices: np.ndarray | None = None,
        event: SamplingEvent | None = None,
    ) -> None:
        self.ledger = ledger
        self.event = event
        self.sampling_probability = sampling_probability
        self.population_size = population_size
        self.index = ledger.num_steps - 1
        self.generator = generator
        self.backend = backend
        self.indices = indices
        self._ended = False

    @property
    def is_open(self) -> bool:
        """True while queries may still be added to this step."""
        return (
            not self._ended and not self.ledger.closed and self.ledger.num_steps == self.index + 1
        )

    @property
    def expected_batch_size(self) -> float | None:
        """q·n, the expected number of sampled records (None if n is unknown)."""
        if self.population_size is None:
            return None
        return self.sampling_probability * self.population_size

    @property
    def denominator(self) -> float | None:
        """The fixed denominator of :meth:`average` for this step's sampling scheme: q·n for
        Poisson, b for fixed-size and shuffled batches, n / k for balls-in-bins (None if n is
        unknown)."""
        if self.event is not None:
            return self.event.average_denominator
        return self.expected_batch_size

    def _check_open(self) -> None:
        if not self.is_open:
            raise LedgerStateError(
                f"step {self.index} has ended (its block exited, the ledger was closed, or a "
                "later sampling event was recorded); open a new step for further queries"
            )

    def _generator(self, generator: Any) -> Any:
        return self.generator if generator is None else generator

    @overload
    def run(
        self, query: GroupedSumQuery, records: Sequence[Any], *, generator: Any = None
    ) -> list[list[Array]]: ...

    @overload
    def run(
        self,
        query: GaussianSumQuery | AdaptiveClipping,
        records: Array | Sequence[Array],
        *,
        generator: Any = None,
    ) -> list[Array]: ...

    def run(self, query: Any, records: Any, *, generator: Any = None) -> Any:
        """Run ``query`` (a sum query, a :class:`GroupedSumQuery` or an adaptive clipping) on
        materialised records arrays of this step's sample; see the query's ``run``.

        Args:
            query: the query to run.
            records: its records arrays (for a grouped query: one group of arrays per query).
            generator: overrides the step's generator for this call.
        """
        self._check_open()
        if not hasattr(query, "run"):
            raise InvalidParameterError("query", query, "a sum query, grouped query or adaptive")
        return query.run(
            records, ledger=self.ledger, generator=self._generator(generator), backend=self.backend
        )

    @overload
    def release(
        self,
        query: GroupedSumQuery,
        clipped_sums: Sequence[Any],
        *,
        num_records: int,
        generator: Any = None,
    ) -> list[list[Array]]: ...

    @overload
    def release(
        self,
        query: GaussianSumQuery,
        clipped_sums: Array | Sequence[Array],
        *,
        num_records: int,
        generator: Any = None,
    ) -> list[Array]: ...

    def release(
        self, query: Any, clipped_sums: Any, *, num_records: int, generator: Any = None
    ) -> Any:
        """Stage (c) of ``query`` on clipped sums the caller computed; see the query's
        ``release``.

        Args:
            query: a :class:`GaussianSumQuery` (or scaled) or a :class:`GroupedSumQuery`.
            clipped_sums: Σ_i f_i·v_ij per array (for a grouped query: per group).
            num_records: |R|, the number of records in this step's sample.
            generator: overrides the step's generator for this call.
        """
        self._check_open()
        if not isinstance(query, (GaussianSumQuery, GroupedSumQuery)):
            raise InvalidParameterError("query", query, "a GaussianSumQuery or GroupedSumQuery")
        return query.release(
            clipped_sums,
            num_records=num_records,
            ledger=self.ledger,
            generator=self._generator(generator),
            backend=self.backend,
        )

    def commit(self, prepared: PreparedRelease, *, generator: Any = None) -> list[list[Array]]:
        """Stage (c) of a grouped release prepared (validated and sensitivity-checked) before
        the step was opened: draw its noise and record its events in this step.

        Args:
            prepared: from :meth:`GroupedSumQuery.prepare`.
            generator: overrides the step's generator for this call.
        """
        self._check_open()
        if not isinstance(prepared, PreparedRelease):
            raise InvalidParameterError(
                "prepared", prepared, "a PreparedRelease from GroupedSumQuery.prepare"
            )
        return prepared.commit(ledger=self.ledger, generator=self._generator(generator))

    def average(
        self, noised_sums: Array | Sequence[Array], *, realised_batch_size: int | None = None
    ) -> list[Array]:
        """The average of noised sums: sum/(q·n) by default (unbiased, fixed denominator).

        Args:
            noised_sums: the noised sums of one query.
            realised_batch_size: opt in to dividing by |R| instead; this is not covered by the
                Gaussian sum query's accounting and warns (see :func:`realised_batch_average`).

        Raises:
            InvalidParameterError: the step's population size is unknown (fixed denominator).
        """
        if realised_batch_size is not None:
            return realised_batch_average(
                noised_sums, batch_size=realised_batch_size, backend=self.backend
            )
        if self.population_size is None:
            raise InvalidParameterError(
                "population_size",
                None,
                "a known population size n for the fixed-denominator average sum/(q·n)",
            )
        if self.event is not None and not self.event.is_classic:
            return fixed_denominator_average(
                noised_sums, denominator=self.denominator, backend=self.backend
            )
        return fixed_denominator_average(
            noised_sums,
            sampling_probability=self.sampling_probability,
            population_size=self.population_size,
            backend=self.backend,
        )

    def end(self) -> None:
        """End the step: later queries through this object are refused. Idempotent."""
        self._ended = True

    def __repr__(self) -> str:
        state = "open" if self.is_open else "ended"
        return (
            f"SampledStep(index={self.index}, sampling_probability={self.sampling_probability!r}, "
            f"population_size={self.population_size!r}, {state})"
        )


def open_step(
    ledger: PrivacyLedger,
    *,
    sampling_probability: float | None = None,
    population_size: int | None = None,
    scheme: SamplingScheme | str | None = None,
    generator: Any = None,
    backend: ArrayBackend | None = None,
    indices: np.ndarray | None = None,
    event: SamplingEvent | None = None,
) -> SampledStep:
    """Record the sampling event and return the :class:`SampledStep` (no ``with`` block).

    Give q (with n and the scheme) of a Poisson or full-batch sample, or ``event``, a
    :class:`~dpledger.ledger.SamplingEvent` of any scheme.
    """
    if not isinstance(ledger, PrivacyLedger):
        raise InvalidParameterError("ledger", ledger, "a dpledger.PrivacyLedger")
    be = resolve_backend(backend)
    ledger.record_sample(
        sampling_probability=sampling_probability,
        population_size=population_size,
        scheme=scheme,
        event=event,
    )
    if event is not None:
        sampling_probability, population_size = event.sampling_probability, event.population_size
    assert sampling_probability is not None  # record_sample refused a missing q
    return SampledStep(
        ledger=ledger,
        sampling_probability=float(sampling_probability),
        population_size=None if population_size is None else int(population_size),
        generator=generator,
        backend=be,
        indices=indices,
        event=event,
    )


@contextlib.contextmanager
def sampled_step(
    ledger: PrivacyLedger,
    *,
    sampling_probability: float | None = None,
    population_size: int | None = None,
    scheme: SamplingScheme | str | None = None,
    generator: Any = None,
    backend: ArrayBackend | None = None,
    event: SamplingEvent | None = None,
    sampler: PoissonSampler | None = None,
) -> Iterator[SampledStep]:
    """Record a sampling event and run the step's queries inside a ``with`` block.

    The sampling event is recorded on entry (so a step that fails halfway is still counted:
    the sample was drawn). On exit the step ends; the next sampling event opens the next step.

    Args:
        ledger: the ledger to record into.
        sampling_probability: q, the probability with which each record was included by the
            sampler actually used.
        population_size: n, the number of records sampled from (needed for the average).
        scheme: ``"poisson"`` (default for q < 1) or ``"full"`` (q = 1).
        event: the sampling event of any scheme (``SamplingEvent.shuffle(b, n, ...)``, …),
            instead of q, n and the scheme.
        generator: the random generator for the step's noise (``numpy.random.Generator`` for
            NumPy); may instead be given per call. None with the NumPy backend and no
            ``sampler``: a new generator seeded from the operating system's entropy. The
            ledger's noise provenance (:mod:`dpledger.ledger.provenance`, a note written before
            the step's sampling event when it changes) records ``os_entropy`` for that one and
            ``caller_generator`` for a generator given here or a sampler's (a generator given
            per call is not seen by it).
        backend: the array backend (default NumPy).
        sampler: a :class:`~dpledger.sampling.PoissonSampler` to draw the step's sample from,
            instead of q, n, the scheme and the event: the step records the sampler's own q and
            n, holds the drawn record indices in ``step.indices``, and draws its noise from the
            sampler's generator unless ``generator`` is given.

    Yields:
        The :class:`SampledStep`.

    Raises:
        InvalidParameterError: ``sampler`` is not a ``PoissonSampler``, or is given with q, n,
            the scheme or the event.
    """
    indices = None
    if sampler is not None:
        if not isinstance(sampler, PoissonSampler):
            raise InvalidParameterError("sampler", sampler, "a dpledger.sampling.PoissonSampler")
        given = {
            "sampling_probability": sampling_probability,
            "population_size": population_size,
            "scheme": scheme,
            "event": event,
        }
        for name, value in given.items():
            if value is not None:
                raise InvalidParameterError(name, value, "not given with sampler= (its own)")
        indices = sampler.sample()
        sampling_probability, population_size = (
            sampler.sampling_probability,
            sampler.population_size,
        )
        generator = sampler.generator if generator is None else generator
    generator = note_numpy_provenance(ledger, backend, generator, sampler)
    step = open_step(
        ledger,
        sampling_probability=sampling_probability,
        population_size=population_size,
        scheme=scheme,
        generator=generator,
        backend=backend,
        indices=indices,
        event=event,
    )
    try:
        yield step
    finally:
        step.end()


class StepEvents:
    """The sampling event of every step of a DP run, from its sampler.

    Built by :func:`step_events_of` from an adapter's ``sampler`` (or from
    ``sampling_probability`` and ``population_size``, a Poisson sample).

    Attributes:
        event: the event of every step, with ``epoch_start=False``.
        epoch_based: whether the first step of each epoch is recorded with ``epoch_start``.
        steps_per_epoch: the sampler's batches per epoch (None without a sampler).
    """

    def __init__(self, event: SamplingEvent, sampler: Any = None) -> None:
        self.event = event
        self._sampler = sampler
        self.epoch_based = bool(getattr(sampler, "epoch_based", False))
        self.steps_per_epoch: int | None = getattr(sampler, "steps_per_epoch", None)

    @property
    def denominator(self) -> float:
        """The fixed denominator of every step's average (the event's; q·n for Poisson)."""
        value = self.event.average_denominator
        assert value is not None  # every event here has its n
        return value

    def at(self, position: int) -> SamplingEvent:
        """The event of the step at 0-based ``position`` in its epoch (taken modulo the
        sampler's steps per epoch): the sampler's ``event_for_step``."""
        if not self.epoch_based:
            return self.event
        assert self.steps_per_epoch is not None
        event: SamplingEvent = self._sampler.event_for_step(position % self.steps_per_epoch)
        return event

    @property
    def relations(self) -> tuple[NeighboringRelation, ...]:
        """The neighbouring relations dpledger can analyse the steps under."""
        return self.event.relations


def step_events_of(
    sampler: Any, sampling_probability: float | None, population_size: int | None
) -> StepEvents:
    """The steps' events from a sampler or from an explicit Poisson (q, n), validated.

    Args:
        sampler: a sampler with a ``sampling_event`` (and, when ``epoch_based``,
            ``event_for_step(step)``), or one with ``sampling_probability`` and
            ``population_size``; None for the explicit (q, n).
        sampling_probability: q of an explicit Poisson sample.
        population_size: n of an explicit Poisson sample.

    Raises:
        InvalidParameterError: a sampler with (q, n) too, a sampler without what is needed, or
            neither a sampler nor a valid (q, n).
    """
    if sampler is not None:
        if sampling_probability is not None or population_size is not None:
            raise InvalidParameterError(
                "sampler",
                sampler,
                "either a sampler or sampling_probability and population_size, not both",
            )
        event = getattr(sampler, "sampling_event", None)
        if isinstance(event, SamplingEvent):
            if event.epoch_start or event.population_size is None:
                raise InvalidParameterError(
                    "sampler", sampler, "a sampler whose sampling_event has n and no epoch_start"
                )
            if getattr(sampler, "epoch_based", False) and not callable(
                getattr(sampler, "event_for_step", None)
            ):
                raise InvalidParameterError(
                    "sampler", sampler, "an epoch-based sampler with event_for_step(step)"
                )
            return StepEvents(event, sampler)
        q = getattr(sampler, "sampling_probability", None)
        n = getattr(sampler, "population_size", None)
        if q is None or n is None:
            raise InvalidParameterError(
                "sampler",
                sampler,
                "a sampler of the adapter (with a sampling_event) or one with "
                "sampling_probability and population_size",
            )
        sampling_probability, population_size = q, n
    if sampling_probability is None or population_size is None:
        raise InvalidParameterError(
            "sampling_probability",
            sampling_probability,
            "the sampler's q in (0, 1] and population_size n (or sampler=PoissonSampler(...)); "
            "q must be the probability with which the data pipeline includes each record",
        )
    q = check_probability("sampling_probability", sampling_probability)
    if q == 0.0:
        raise InvalidParameterError(
            "sampling_probability", q, "a probability in (0, 1] (q = 0 never samples)"
        )
    n = check_positive_int("population_size", population_size)
    return StepEvents(SamplingEvent.poisson(q, n))
