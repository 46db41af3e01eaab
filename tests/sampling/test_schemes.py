"""Each scheme's q, average denominator, epoch layout, per-step event and unit of privacy."""

from __future__ import annotations

import pytest

from dpledger.errors import InvalidParameterError
from dpledger.ledger import PrivacyUnit, SamplingEvent
from dpledger.sampling import (
    BallsInBinsScheme,
    FixedSizeScheme,
    PoissonScheme,
    ShuffleScheme,
    TruncatedPoissonScheme,
    UserPoissonScheme,
)


def test_poisson() -> None:
    scheme = PoissonScheme(population_size=1000, sampling_probability=0.01)
    assert scheme.sampling_probability == 0.01 and scheme.population_size == 1000
    assert scheme.average_denominator == scheme.expected_batch_size == 0.01 * 1000
    assert scheme.steps_per_epoch == 100 and not scheme.epoch_based
    assert scheme.unit is PrivacyUnit.RECORD
    event = SamplingEvent.poisson(0.01, 1000)
    assert scheme.event() == event and scheme.event(epoch_start=True) == event
    assert [scheme.event_for_step(i) for i in (0, 99)] == [event, event]
    full = PoissonScheme(population_size=3, sampling_probability=1.0)
    assert full.event().scheme.value == "full" and full.steps_per_epoch == 1


def test_stepwise_default_steps_round_to_even_or_halves_up() -> None:
    assert PoissonScheme(population_size=10, sampling_probability=0.4).steps_per_epoch == 2
    halves_up = PoissonScheme(population_size=10, sampling_probability=0.4, round_half_up=True)
    assert halves_up.steps_per_epoch == 3
    assert FixedSizeScheme(population_size=10, batch_size=4).steps_per_epoch == 2
    assert (
        FixedSizeScheme(population_size=10, batch_size=4, round_half_up=True).steps_per_epoch == 3
    )
    assert PoissonScheme(population_size=10, sampling_probability=0.4, steps=7).steps_per_epoch == 7
    with pytest.raises(InvalidParameterError) as info:
        PoissonScheme(
            population_size=10, sampling_probability=0.4, steps=0, steps_parameter="steps_per_epoch"
        )
    assert info.value.parameter == "steps_per_epoch"


def test_fixed_size() -> None:
    scheme = FixedSizeScheme(population_size=10, batch_size=4, steps=5)
    assert scheme.batch_size == 4 and scheme.sampling_probability == 0.4
    assert scheme.average_denominator == 4.0 and scheme.steps_per_epoch == 5
    assert scheme.event() == SamplingEvent.fixed_size(4, 10)
    assert scheme.event(epoch_start=True).epoch_start is False


def test_truncated_poisson_cap_and_denominator() -> None:
    scheme = TruncatedPoissonScheme(population_size=10, sampling_probability=0.5, max_batch_size=3)
    assert scheme.max_batch_size == 3 and scheme.average_denominator == 5.0
    assert scheme.event() == SamplingEvent.truncated_poisson(0.5, 10, 3)
    assert scheme.steps_per_epoch == 2
    # a cap above n: accepted unless the sampler asks for a cap within the population
    assert (
        TruncatedPoissonScheme(
            population_size=10, sampling_probability=0.5, max_batch_size=11
        ).max_batch_size
        == 11
    )
    with pytest.raises(InvalidParameterError, match="population_size=10") as info:
        TruncatedPoissonScheme(
            population_size=10,
            sampling_probability=0.5,
            max_batch_size=11,
            cap_within_population=True,
        )
    assert info.value.parameter == "max_batch_size"


def test_balls_in_bins_epoch_layout_and_events() -> None:
    scheme = BallsInBinsScheme(population_size=10, num_batches=4)
    assert scheme.epoch_based and scheme.steps_per_epoch == 4 and scheme.num_batches == 4
    assert scheme.sampling_probability == 0.25 and scheme.average_denominator == 2.5
    assert scheme.event() == SamplingEvent.balls_in_bins(4, 10)
    assert scheme.event(epoch_start=True) == SamplingEvent.balls_in_bins(4, 10, epoch_start=True)
    assert [scheme.event_for_step(i).epoch_start for i in range(4)] == [True, False, False, False]
    with pytest.raises(InvalidParameterError) as info:
        scheme.event_for_step(4)
    assert info.value.parameter == "step"


@pytest.mark.parametrize(
    ("n", "b", "drop_last", "steps"), [(10, 4, False, 3), (12, 4, False, 3), (12, 4, True, 3)]
)
def test_shuffle_epoch_layout(n: int, b: int, drop_last: bool, steps: int) -> None:
    scheme = ShuffleScheme(population_size=n, batch_size=b, drop_last=drop_last)
    assert scheme.epoch_based and scheme.steps_per_epoch == steps
    assert scheme.average_denominator == float(b) and scheme.drop_last is drop_last
    assert scheme.event_for_step(0) == SamplingEvent.shuffle(b, n, epoch_start=True)
    assert scheme.event_for_step(steps - 1) == SamplingEvent.shuffle(b, n)


def test_user_level_unit() -> None:
    scheme = UserPoissonScheme(num_users=50, sampling_probability=0.1, max_records_per_user=3)
    assert scheme.unit is PrivacyUnit.USER and scheme.num_users == scheme.population_size == 50
    assert scheme.event() == SamplingEvent.poisson(0.1, 50, unit="user")
    assert scheme.average_denominator == scheme.expected_num_users == 0.1 * 50
    assert scheme.max_records_per_user == 3 and scheme.steps_per_epoch == 10


@pytest.mark.parametrize(
    ("make", "parameter"),
    [
        (lambda: PoissonScheme(population_size=0, sampling_probability=0.1), "population_size"),
        (
            lambda: PoissonScheme(population_size=5, sampling_probability=0.0),
            "sampling_probability",
        ),
        (lambda: PoissonScheme(population_size=5, sampling_probability=0.5, steps=0), "steps"),
        (lambda: FixedSizeScheme(population_size=5, batch_size=6), "batch_size"),
        (lambda: FixedSizeScheme(population_size=5, batch_size=0), "batch_size"),
        (
            lambda: TruncatedPoissonScheme(
                population_size=5, sampling_probability=0.5, max_batch_size=0
            ),
            "max_batch_size",
        ),
        (lambda: BallsInBinsScheme(population_size=5, num_batches=6), "num_batches"),
        (lambda: ShuffleScheme(population_size=5, batch_size=2, drop_last=True), "drop_last"),
        (lambda: ShuffleScheme(population_size=5, batch_size=2, drop_last=None), "drop_last"),
        (
            lambda: UserPoissonScheme(
                num_users=0, sampling_probability=0.5, max_records_per_user=1
            ),
            "num_users",
        ),
        (
            lambda: UserPoissonScheme(
                num_users=3, sampling_probability=0.5, max_records_per_user=0
            ),
            "max_records_per_user",
        ),
    ],
)
def test_bad_parameters_are_refused_by_name(make, parameter: str) -> None:
    with pytest.raises(InvalidParameterError) as info:
        make()
    assert info.value.parameter == parameter


def test_schemes_compare_by_parameters() -> None:
    a = ShuffleScheme(population_size=10, batch_size=4)
    assert a == ShuffleScheme(population_size=10, batch_size=4)
    assert a != ShuffleScheme(population_size=10, batch_size=5)
    assert a != FixedSizeScheme(population_size=10, batch_size=4)
    assert hash(a) == hash(ShuffleScheme(population_size=10, batch_size=4))
    assert "shuffle(b=4, n=10)" in repr(a)
