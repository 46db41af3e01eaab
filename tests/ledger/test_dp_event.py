"""to_dp_event(): a ledger as a dp-accounting event, checked against events built by hand."""

from __future__ import annotations

import math

import dp_accounting
import pytest
from dp_accounting import rdp

from dpledger import PrivacyLedger, SamplingEvent
from dpledger.errors import InvalidParameterError, UnsupportedSamplingError
from dpledger.ledger import StepRun
from dpledger.ledger.dp_event import compressed_to_dp_event, run_to_dp_event
from dpledger.ledger.steps import CompressedLedger

ORDERS = [1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 64.0, 128.0, 256.0]
DELTA = 1e-5


def rdp_epsilon(events: list[dp_accounting.DpEvent]) -> float:
    accountant = rdp.RdpAccountant(orders=ORDERS)
    for event in events:
        accountant.compose(event)
    return accountant.get_epsilon(DELTA)


def build_ledger() -> tuple[PrivacyLedger, list[dp_accounting.DpEvent]]:
    """A ledger and, step by step, the dp-accounting events it stands for (z by hand)."""
    ledger = PrivacyLedger()
    by_hand: list[dp_accounting.DpEvent] = []
    # 30 steps at q = 0.01 with two groups: z = (1/1.2² + (0.5/0.8)²)^(-1/2)
    z_two_groups = (1.0 / 1.2**2 + (0.5 / 0.8) ** 2) ** -0.5
    for _ in range(30):
        ledger.record_sample(sampling_probability=0.01, population_size=10_000)
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.2, label="w")
        ledger.record_sum_query(l2_norm_bound=0.5, noise_stddev=0.8, label="b")
        by_hand.append(
            dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(z_two_groups))
        )
    # 5 steps without queries release nothing.
    for _ in range(5):
        ledger.record_sample(sampling_probability=0.01, population_size=10_000)
    # 20 steps at q = 0.05 with one group: z = 2.0 / 1.5
    for _ in range(20):
        ledger.record_sample(sampling_probability=0.05, population_size=10_000)
        ledger.record_sum_query(l2_norm_bound=1.5, noise_stddev=2.0)
        by_hand.append(
            dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(2.0 / 1.5))
        )
    # 2 full-batch steps, two queries (S, σ̃) = (1, 3): z = ((1/3)² + (1/3)²)^(-1/2) = 3/√2
    for _ in range(2):
        ledger.record_sample(sampling_probability=1.0)
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=3.0)
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=3.0)
        by_hand.append(dp_accounting.GaussianDpEvent(3.0 / math.sqrt(2.0)))
    # Back to the first kind of step: a separate run with the same (q, z).
    for _ in range(10):
        ledger.record_sample(sampling_probability=0.01, population_size=10_000)
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.2, label="w")
        ledger.record_sum_query(l2_norm_bound=0.5, noise_stddev=0.8, label="b")
        by_hand.append(
            dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(z_two_groups))
        )
    return ledger, by_hand


def test_to_dp_event_gives_the_same_epsilon_as_composing_the_steps_by_hand() -> None:
    ledger, by_hand = build_ledger()
    assert len(ledger.runs()) == 5
    event = ledger.to_dp_event()
    assert isinstance(event, dp_accounting.ComposedDpEvent)
    eps_ledger = rdp_epsilon([event])
    eps_hand = rdp_epsilon(by_hand)
    assert 0.0 < eps_hand < math.inf
    assert eps_ledger == pytest.approx(eps_hand, rel=1e-9)


def test_the_dp_event_is_the_run_structure() -> None:
    ledger, _ = build_ledger()
    first, no_op, second, full, again = ledger.to_dp_event().events
    assert isinstance(first, dp_accounting.SelfComposedDpEvent) and first.count == 30
    assert first.event.sampling_probability == 0.01
    assert first.event.event.noise_multiplier == ledger.runs()[0].noise_multiplier
    assert no_op == dp_accounting.SelfComposedDpEvent(dp_accounting.NoOpDpEvent(), 5)
    assert second.event == dp_accounting.PoissonSampledDpEvent(
        0.05, dp_accounting.GaussianDpEvent(2.0 / 1.5)
    )
    assert isinstance(full.event, dp_accounting.GaussianDpEvent)  # q = 1: no sampling
    assert again.count == 10


def test_zero_noise_is_non_private_and_q_zero_or_no_query_is_free() -> None:
    assert run_to_dp_event(StepRun(0.1, 0.0, 1)) == dp_accounting.NonPrivateDpEvent()
    assert run_to_dp_event(StepRun(0.0, 0.0, 1)) == dp_accounting.NoOpDpEvent()
    assert run_to_dp_event(StepRun(0.3, math.inf, 1)) == dp_accounting.NoOpDpEvent()
    ledger = PrivacyLedger()
    ledger.record_sample(sampling_probability=0.01)
    ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0)
    ledger.record_sample(sampling_probability=0.01)
    ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=0.0)
    assert rdp_epsilon([ledger.to_dp_event()]) == math.inf


def test_empty_ledger_spends_nothing() -> None:
    event = PrivacyLedger().to_dp_event()
    assert event == dp_accounting.ComposedDpEvent([])
    assert rdp_epsilon([event]) == 0.0
    assert compressed_to_dp_event(CompressedLedger()) == event


def truncated_ledger(steps: int, *, queries: bool = True) -> PrivacyLedger:
    ledger = PrivacyLedger()
    for _ in range(steps):
        ledger.record_sample(event=SamplingEvent.truncated_poisson(0.2, 50, 10))
        if queries:
            ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0)
    return ledger


def test_truncated_poisson_has_no_single_dp_event() -> None:
    """dp-accounting's truncated event takes the size of the data set holding the differing
    record (n removed, n + 1 added) and the guarantee is the larger of the two: one event
    cannot say that, so it is refused, naming the scheme and where both are; every other way
    in (the compressed ledger, one run) refuses alike."""
    ledger = truncated_ledger(3)
    with pytest.raises(UnsupportedSamplingError, match="to_dp_events") as info:
        ledger.to_dp_event()
    assert info.value.scheme == "truncated_poisson" and "n = 50" in str(info.value)
    with pytest.raises(UnsupportedSamplingError):
        compressed_to_dp_event(ledger.compressed())
    (run,) = ledger.compressed().runs
    with pytest.raises(UnsupportedSamplingError):
        run_to_dp_event(run)
    with pytest.raises(InvalidParameterError, match="neighbour"):
        run_to_dp_event(run, neighbour="both")


def test_to_dp_events_gives_the_removed_and_the_added_neighbour() -> None:
    ledger = truncated_ledger(3)

    def truncated(n: int) -> dp_accounting.DpEvent:
        step = dp_accounting.TruncatedSubsampledGaussianDpEvent(
            dataset_size=n, sampling_probability=0.2, truncated_batch_size=10, noise_multiplier=1.0
        )
        return dp_accounting.ComposedDpEvent([dp_accounting.SelfComposedDpEvent(step, 3)])

    assert ledger.to_dp_events() == [truncated(50), truncated(51)]
    # without truncated Poisson steps (or with ones that release nothing) there is one pair
    plain, _ = build_ledger()
    assert plain.to_dp_events() == [plain.to_dp_event()]
    silent = truncated_ledger(2, queries=False)
    assert silent.to_dp_events() == [silent.to_dp_event()]
