"""The one copy of the sampling parameters' checks: each error names the parameter and value."""

from __future__ import annotations

import numpy as np
import pytest

from dpledger.errors import InvalidParameterError
from dpledger.sampling.validation import (
    MAX_POPULATION,
    check_drop_last,
    check_expected_batch_size,
    check_population_size,
    check_sampling_probability,
    check_size_within_population,
    check_step_position,
    check_steps,
    default_steps,
)


def _refused(call, parameter: str, value: object) -> InvalidParameterError:
    with pytest.raises(InvalidParameterError) as info:
        call()
    assert info.value.parameter == parameter
    assert info.value.value is value or info.value.value == value
    assert str(info.value).startswith(f"{parameter}=")
    return info.value


@pytest.mark.parametrize("q", [0.0, -0.1, 1.5, float("nan"), True, "0.5", None])
def test_sampling_probability_must_be_in_the_half_open_interval(q: object) -> None:
    _refused(lambda: check_sampling_probability(q), "sampling_probability", q)


def test_sampling_probability_zero_only_when_allowed_and_message_says_why() -> None:
    error = _refused(lambda: check_sampling_probability(0.0), "sampling_probability", 0.0)
    assert "(0, 1]" in str(error) and "never samples" in str(error)
    assert check_sampling_probability(0.0, allow_zero=True) == 0.0
    assert check_sampling_probability(-0.0, allow_zero=True) == 0.0
    assert check_sampling_probability(np.float32(0.5)) == 0.5
    assert check_sampling_probability(1) == 1.0
    _refused(lambda: check_sampling_probability(2.0, name="q"), "q", 2.0)


@pytest.mark.parametrize("n", [0, -3, 2.0, True, "7", None])
def test_population_size_must_be_a_positive_integer(n: object) -> None:
    _refused(lambda: check_population_size(n), "population_size", n)


def test_population_size_cap_names_the_maximum() -> None:
    assert check_population_size(np.int64(7)) == 7
    assert check_population_size(MAX_POPULATION, maximum=MAX_POPULATION) == MAX_POPULATION
    error = _refused(
        lambda: check_population_size(MAX_POPULATION + 1, maximum=MAX_POPULATION),
        "population_size",
        MAX_POPULATION + 1,
    )
    assert "2**33" in str(error)


@pytest.mark.parametrize("name", ["batch_size", "max_batch_size", "num_batches"])
@pytest.mark.parametrize("value", [0, 11, 2.5, True])
def test_sizes_must_lie_within_the_population(name: str, value: object) -> None:
    error = _refused(
        lambda: check_size_within_population(name, value, population_size=10), name, value
    )
    if value == 11:
        assert "population_size=10" in str(error)
    assert check_size_within_population(name, 10, population_size=10) == 10


def test_steps_default_and_rounding() -> None:
    assert check_steps("steps", None, default=4) == 4
    assert check_steps("steps_per_epoch", 3, default=4) == 3
    _refused(lambda: check_steps("steps_per_epoch", 0, default=4), "steps_per_epoch", 0)
    _refused(lambda: check_steps("steps", 1.0, default=4), "steps", 1.0)
    assert default_steps(2.5) == 2 and default_steps(2.5, round_half_up=True) == 3
    assert default_steps(3.5) == 4 and default_steps(3.5, round_half_up=True) == 4
    assert default_steps(0.2) == 1 and default_steps(0.2, round_half_up=True) == 1


def test_drop_last_only_when_the_batch_size_divides_the_population() -> None:
    assert check_drop_last(True, batch_size=5, population_size=10) is True
    assert check_drop_last(False, batch_size=3, population_size=10) is False
    error = _refused(
        lambda: check_drop_last(True, batch_size=3, population_size=10), "drop_last", True
    )
    assert "does not divide" in str(error)
    _refused(lambda: check_drop_last(1, batch_size=5, population_size=10), "drop_last", 1)


@pytest.mark.parametrize("step", [-1, 3, 1.0, True, "0"])
def test_step_position_within_the_pass(step: object) -> None:
    error = _refused(lambda: check_step_position(step, steps_per_epoch=3), "step", step)
    assert "steps_per_epoch=3" in str(error)
    assert check_step_position(np.int32(2), steps_per_epoch=3) == 2


@pytest.mark.parametrize("size", [0, -1, 11, float("nan"), "5", True])
def test_expected_batch_size_lies_in_the_population(size: object) -> None:
    _refused(
        lambda: check_expected_batch_size(size, population_size=10), "expected_batch_size", size
    )
    assert check_expected_batch_size(10, population_size=10) == 10.0
