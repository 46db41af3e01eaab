"""The event classes: what they accept, what they refuse, what they store."""

from __future__ import annotations

import math

import attrs
import numpy as np
import pytest

from dpledger import InvalidParameterError, SamplingEvent
from dpledger.ledger import NeighboringRelation, SamplingScheme, SumQueryEvent


def test_sampling_event_stores_plain_python_values() -> None:
    event = SamplingEvent(np.float32(0.25), np.int64(1000))
    assert type(event.sampling_probability) is float and event.sampling_probability == 0.25
    assert type(event.population_size) is int and event.population_size == 1000
    assert event.scheme is SamplingScheme.POISSON


def test_scheme_defaults_to_full_for_q_one() -> None:
    assert SamplingEvent(1.0).scheme is SamplingScheme.FULL
    assert SamplingEvent(1.0, scheme="poisson").scheme is SamplingScheme.POISSON
    assert SamplingEvent(0.5).scheme is SamplingScheme.POISSON


@pytest.mark.parametrize(
    ("kwargs", "parameter", "value"),
    [
        ({"sampling_probability": 1.5}, "sampling_probability", 1.5),
        ({"sampling_probability": -0.1}, "sampling_probability", -0.1),
        ({"sampling_probability": math.nan}, "sampling_probability", math.nan),
        ({"sampling_probability": True}, "sampling_probability", True),
        ({"sampling_probability": "0.5"}, "sampling_probability", "0.5"),
        ({"sampling_probability": 0.5, "population_size": 0}, "population_size", 0),
        ({"sampling_probability": 0.5, "population_size": -3}, "population_size", -3),
        ({"sampling_probability": 0.5, "population_size": 10.0}, "population_size", 10.0),
        ({"sampling_probability": 0.5, "population_size": True}, "population_size", True),
        ({"sampling_probability": 0.5, "scheme": "uniform"}, "scheme", "uniform"),
        ({"sampling_probability": 0.5, "scheme": "full"}, "scheme", "full"),
    ],
)
def test_sampling_event_refuses(kwargs, parameter, value) -> None:
    with pytest.raises(InvalidParameterError) as info:
        SamplingEvent(**kwargs)
    assert info.value.parameter == parameter
    assert f"{parameter}={value!r}" in str(info.value)


def test_sum_query_event_stores_plain_python_values() -> None:
    event = SumQueryEvent(np.array(2.0), np.float16(0.5), "layer")
    assert type(event.l2_norm_bound) is float and event.l2_norm_bound == 2.0
    assert type(event.noise_stddev) is float and event.noise_stddev == 0.5
    assert event.noise_multiplier == 0.25
    assert event.inverse_square_multiplier == 16.0


def test_sum_query_with_zero_noise_is_legal_and_not_private() -> None:
    event = SumQueryEvent(1.0, -0.0)
    assert math.copysign(1.0, event.noise_stddev) == 1.0
    assert event.noise_multiplier == 0.0
    assert event.inverse_square_multiplier == math.inf


def test_extreme_ratio_gives_infinite_term_instead_of_overflow() -> None:
    assert SumQueryEvent(1e300, 1e-300).inverse_square_multiplier == math.inf


@pytest.mark.parametrize(
    ("kwargs", "parameter", "value"),
    [
        ({"l2_norm_bound": 0.0, "noise_stddev": 1.0}, "l2_norm_bound", 0.0),
        ({"l2_norm_bound": -1.0, "noise_stddev": 1.0}, "l2_norm_bound", -1.0),
        ({"l2_norm_bound": math.inf, "noise_stddev": 1.0}, "l2_norm_bound", math.inf),
        ({"l2_norm_bound": math.nan, "noise_stddev": 1.0}, "l2_norm_bound", math.nan),
        ({"l2_norm_bound": 1.0, "noise_stddev": -1e-9}, "noise_stddev", -1e-9),
        ({"l2_norm_bound": 1.0, "noise_stddev": math.inf}, "noise_stddev", math.inf),
        ({"l2_norm_bound": 1.0, "noise_stddev": math.nan}, "noise_stddev", math.nan),
        ({"l2_norm_bound": 1.0, "noise_stddev": None}, "noise_stddev", None),
        ({"l2_norm_bound": 1.0, "noise_stddev": 1.0, "label": 3}, "label", 3),
    ],
)
def test_sum_query_event_refuses(kwargs, parameter, value) -> None:
    with pytest.raises(InvalidParameterError) as info:
        SumQueryEvent(**kwargs)
    assert info.value.parameter == parameter
    assert f"{parameter}={value!r}" in str(info.value)


def test_events_are_frozen_and_evolve_revalidates() -> None:
    event = SumQueryEvent(1.0, 1.0)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        event.noise_stddev = 0.0  # type: ignore[misc]
    with pytest.raises(InvalidParameterError):
        attrs.evolve(event, noise_stddev=-1.0)


def test_neighboring_relation_parse() -> None:
    assert NeighboringRelation.parse("replace_one") is NeighboringRelation.REPLACE_ONE
    assert (
        NeighboringRelation.parse(NeighboringRelation.ADD_REMOVE) is NeighboringRelation.ADD_REMOVE
    )
    with pytest.raises(InvalidParameterError) as info:
        NeighboringRelation.parse("swap", parameter="neighboring")
    assert "neighboring='swap'" in str(info.value)
    assert "'add_remove'" in str(info.value) and "'replace_one'" in str(info.value)
