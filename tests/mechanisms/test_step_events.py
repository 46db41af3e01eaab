"""The sampling events of a run's steps from its sampler (:class:`StepEvents`), and a release
on summaries of sums that stay on a device (:class:`SummaryBackend`)."""

from __future__ import annotations

import math

import pytest

from dpledger import PrivacyLedger, SamplingEvent
from dpledger.errors import InvalidParameterError
from dpledger.ledger import SumQueryEvent
from dpledger.mechanisms import GaussianSumQuery, GroupedSumQuery
from dpledger.mechanisms.backend import NoiseOrder, SummaryBackend, SumSummary
from dpledger.mechanisms.step import StepEvents, open_step, step_events_of
from dpledger.mechanisms.sum_query import SensitivityCheckError


class _ShuffleSampler:
    """An epoch-based sampler: the first step of each epoch is recorded with epoch_start."""

    epoch_based = True
    steps_per_epoch = 4
    sampling_event = SamplingEvent.shuffle(5, 20)

    def event_for_step(self, step: int) -> SamplingEvent:
        return SamplingEvent.shuffle(5, 20, epoch_start=step == 0)


class _RateSampler:
    sampling_probability = 0.25
    population_size = 40


def test_explicit_poisson_steps():
    events = step_events_of(None, 0.1, 100)
    assert events.event == SamplingEvent.poisson(0.1, 100)
    assert events.denominator == pytest.approx(10.0)
    assert not events.epoch_based and events.at(7) == events.event
    assert events.relations == events.event.relations


def test_a_sampler_decides_each_steps_event():
    by_rate = step_events_of(_RateSampler(), None, None)
    assert by_rate.event == SamplingEvent.poisson(0.25, 40)
    epochs = step_events_of(_ShuffleSampler(), None, None)
    assert epochs.epoch_based and epochs.steps_per_epoch == 4
    assert [epochs.at(p).epoch_start for p in range(9)] == [
        True, False, False, False, True, False, False, False, True
    ]  # fmt: skip
    assert epochs.denominator == 5


@pytest.mark.parametrize(
    ("sampler", "q", "n", "parameter"),
    [
        (_RateSampler(), 0.1, None, "sampler"),
        (object(), None, None, "sampler"),
        (None, None, 10, "sampling_probability"),
        (None, 0.0, 10, "sampling_probability"),
        (None, 1.5, 10, "sampling_probability"),
        (None, 0.5, 0, "population_size"),
    ],
)
def test_bad_samplers_and_rates_are_named(sampler, q, n, parameter):
    with pytest.raises(InvalidParameterError) as info:
        step_events_of(sampler, q, n)
    assert info.value.parameter == parameter


def test_a_sampler_must_say_how_each_epoch_starts():
    class Starting(_ShuffleSampler):
        sampling_event = SamplingEvent.shuffle(5, 20, epoch_start=True)

    class Silent(_ShuffleSampler):
        event_for_step = None  # type: ignore[assignment]

    for sampler in (Starting(), Silent()):
        with pytest.raises(InvalidParameterError) as info:
            step_events_of(sampler, None, None)
        assert info.value.parameter == "sampler"
    assert isinstance(StepEvents(SamplingEvent.poisson(0.5, 4)).event, SamplingEvent)


def _summary(norm: float) -> SumSummary:
    return SumSummary(norm=norm, shape=(3,), eps=2.0**-52, tiny=2.0**-1022)


def test_a_release_on_summaries_records_and_orders_the_noise():
    grouped = GroupedSumQuery(
        [
            GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=2.0, label="a"),
            GaussianSumQuery(l2_norm_bound=0.5, noise_stddev=0.7, label="b"),
        ]
    )
    ledger = PrivacyLedger()
    step = open_step(ledger, event=SamplingEvent.poisson(0.1, 100), backend=SummaryBackend())
    sums = [[_summary(2.9), _summary(0.1)], [_summary(1.4)]]
    released = step.release(grouped, sums, num_records=3)
    orders = [order for group in released for order in group]
    assert all(isinstance(order, NoiseOrder) for order in orders)
    assert [order.stddev for order in orders] == [2.0, 2.0, 0.7]
    assert [order.summary for order in orders] == [*sums[0], *sums[1]]
    (recorded,) = ledger.steps()
    assert recorded.queries == (SumQueryEvent(1.0, 2.0, "a"), SumQueryEvent(0.5, 0.7, "b"))
    too_long = [[_summary(math.sqrt(3.0**2 + 0.5**2)), _summary(0.0)], [_summary(0.1)]]
    step = open_step(ledger, event=SamplingEvent.poisson(0.1, 100), backend=SummaryBackend())
    with pytest.raises(SensitivityCheckError):
        step.release(grouped, too_long, num_records=3)
