"""The sampling event of every step of a DP run, from the sampler that draws its batches.

:class:`StepEvents` is what :class:`~dpledger.adapters.tensorflow.PrivateGradients` and
:class:`~dpledger.adapters.tensorflow.DPKerasModel` record with each step: the sampler's event,
with ``epoch_start`` on the first step of each epoch for the epoch-based schemes
(docs/architecture.md, "Soundness rules", rule 6).
"""

from __future__ import annotations

from typing import Any

from dpledger.errors import InvalidParameterError
from dpledger.ledger import NeighboringRelation, PrivacyLedger, SamplingEvent
from dpledger.sampling.relations import check_ledger_relation
from dpledger.sampling.validation import check_population_size, check_sampling_probability

__all__ = ["StepEvents", "check_relation", "sampling_of", "step_events_of"]


class StepEvents:
    """The sampling event of every step of a DP run, from its sampler.

    Not constructed by users: :class:`PrivateGradients` and
    :class:`~dpledger.adapters.tensorflow.DPKerasModel` build it from their ``sampler`` (or
    from ``sampling_probability`` and ``population_size``, a Poisson sample).

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
        sampler's steps per epoch): the sampler's
        :meth:`~dpledger.adapters.tensorflow.RecordedDatasetSampler.event_for_step`."""
        if not self.epoch_based:
            return self.event
        assert self.steps_per_epoch is not None
        return self._sampler.event_for_step(position % self.steps_per_epoch)

    @property
    def relations(self) -> tuple[NeighboringRelation, ...]:
        """The neighbouring relations dpledger can analyse the steps under."""
        return self.event.relations


def step_events_of(
    sampler: Any, sampling_probability: float | None, population_size: int | None
) -> StepEvents:
    """The steps' events from a sampler or from an explicit Poisson (q, n), validated."""
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
                "a sampler of dpledger.adapters.tensorflow (PoissonDatasetSampler, "
                "FixedSizeDatasetSampler, TruncatedPoissonDatasetSampler, "
                "BallsInBinsDatasetSampler, ShuffleDatasetSampler) or one with "
                "sampling_probability and population_size",
            )
        sampling_probability, population_size = q, n
    if sampling_probability is None or population_size is None:
        raise InvalidParameterError(
            "sampling_probability",
            sampling_probability,
            "the sampler's q in (0, 1] and population_size n (or "
            "sampler=PoissonDatasetSampler(...)); "
            "q must be the probability with which the data pipeline includes each record",
        )
    q = check_sampling_probability(sampling_probability)
    n = check_population_size(population_size)
    return StepEvents(SamplingEvent.poisson(q, n))


def sampling_of(
    sampler: Any, sampling_probability: float | None, population_size: int | None
) -> tuple[float, int]:
    """(q, n) from a sampler or from explicit values, validated."""
    event = step_events_of(sampler, sampling_probability, population_size).event
    assert event.population_size is not None
    return event.sampling_probability, event.population_size


def check_relation(events: StepEvents, ledger: PrivacyLedger) -> None:
    """Refuse a ledger whose neighbouring relation the steps' scheme has no analysis under.

    Raises:
        InvalidParameterError: naming the relation(s) to create the ledger with.
    """
    check_ledger_relation(events.event, ledger.neighboring)
