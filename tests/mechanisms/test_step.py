"""Sampled steps, Poisson sampling and averaging."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dpledger import PrivacyLedger, SamplingEvent
from dpledger.errors import InvalidParameterError, LedgerStateError
from dpledger.ledger import SumQueryEvent
from dpledger.mechanisms import GaussianSumQuery, GroupedSumQuery, sampled_step
from dpledger.mechanisms.averaging import (
    UnaccountedReleaseWarning,
    fixed_denominator_average,
    realised_batch_average,
)
from dpledger.mechanisms.step import open_step
from dpledger.sampling import PoissonSampler

QUERY = GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=1.0, label="q")


def test_sampled_step_records_the_sample_then_the_queries() -> None:
    ledger = PrivacyLedger()
    rng = np.random.default_rng(0)
    with sampled_step(
        ledger, sampling_probability=0.02, population_size=500, generator=rng
    ) as step:
        assert step.is_open and step.index == 0 and step.expected_batch_size == 10.0
        step.run(QUERY, np.ones((9, 3)))
        step.release(QUERY, [np.zeros(3)], num_records=9)
    assert not step.is_open
    assert list(ledger.events()) == [
        SamplingEvent(0.02, 500),
        SumQueryEvent(1.0, 1.0, "q"),
        SumQueryEvent(1.0, 1.0, "q"),
    ]
    with pytest.raises(LedgerStateError):
        step.run(QUERY, np.ones((9, 3)))
    assert ledger.num_events == 3
    assert "ended" in repr(step)


def test_step_refuses_queries_after_a_later_sampling_event() -> None:
    ledger = PrivacyLedger()
    step = open_step(ledger, sampling_probability=0.5, generator=np.random.default_rng())
    ledger.record_sample(sampling_probability=0.5)
    with pytest.raises(LedgerStateError):
        step.release(QUERY, [np.zeros(2)], num_records=0)
    assert ledger.num_events == 2


def test_sampling_event_is_kept_when_the_step_fails() -> None:
    ledger = PrivacyLedger()
    with (
        pytest.raises(RuntimeError),
        sampled_step(ledger, sampling_probability=0.1, population_size=10),
    ):
        raise RuntimeError("training step crashed")
    assert ledger.num_steps == 1


def test_step_generator_can_be_given_per_call_and_grouped_queries_run() -> None:
    ledger = PrivacyLedger()
    group = GroupedSumQuery([QUERY])
    with sampled_step(ledger, sampling_probability=0.1, population_size=10) as step:
        ((a,),) = step.run(group, [[np.ones((2, 2))]], generator=np.random.default_rng(1))
        ((b,),) = step.release(
            group, [[np.zeros(2)]], num_records=2, generator=np.random.default_rng(1)
        )
        with pytest.raises(InvalidParameterError, match="query"):
            step.run("query", np.ones((2, 2)))
        with pytest.raises(InvalidParameterError, match="query"):
            step.release(object(), [np.zeros(2)], num_records=2)
    assert a.shape == b.shape == (2,)
    assert ledger.num_events == 3


def test_bad_step_arguments_leave_the_ledger_unchanged() -> None:
    ledger = PrivacyLedger()
    bad: list[tuple[str, object, dict]] = [
        ("sampling_probability", ledger, {"sampling_probability": 1.5}),
        ("backend", ledger, {"sampling_probability": 0.5, "backend": "torch"}),
        ("ledger", "ledger.dpl", {"sampling_probability": 0.5}),
    ]
    for parameter, target, kwargs in bad:
        with pytest.raises(InvalidParameterError) as err, sampled_step(target, **kwargs):  # type: ignore[arg-type]
            pass
        assert err.value.parameter == parameter
    assert ledger.num_events == 0


def test_average_uses_the_fixed_denominator() -> None:
    ledger = PrivacyLedger()
    with sampled_step(ledger, sampling_probability=0.25, population_size=8) as step:
        (avg,) = step.average([np.array([4.0, 6.0])])
    np.testing.assert_array_equal(avg, [2.0, 3.0])  # divided by q·n = 2
    with sampled_step(ledger, sampling_probability=0.25) as unknown:
        with pytest.raises(InvalidParameterError, match="population_size"):
            unknown.average([np.ones(2)])
        assert unknown.expected_batch_size is None


def test_realised_batch_average_is_an_explicit_opt_in_that_warns() -> None:
    ledger = PrivacyLedger()
    with (
        sampled_step(ledger, sampling_probability=0.25, population_size=8) as step,
        pytest.warns(UnaccountedReleaseWarning, match="not cover"),
    ):
        (avg,) = step.average([np.array([4.0, 6.0])], realised_batch_size=4)
    np.testing.assert_array_equal(avg, [1.0, 1.5])
    with pytest.warns(UnaccountedReleaseWarning):
        (zero,) = realised_batch_average(np.array([4.0]), batch_size=0)
    assert zero.tolist() == [4.0]


FIXED, REALISED = fixed_denominator_average, realised_batch_average
ONE = [np.ones(1)]


@pytest.mark.parametrize(
    ("function", "kwargs", "parameter"),
    [
        (FIXED, {"sampling_probability": 0.0, "population_size": 3}, "sampling_probability"),
        (FIXED, {"sampling_probability": 1.5, "population_size": 3}, "sampling_probability"),
        (FIXED, {"sampling_probability": 0.5, "population_size": 0}, "population_size"),
        (REALISED, {"batch_size": -1}, "batch_size"),
        (REALISED, {"batch_size": 2.0}, "batch_size"),
    ],
)
def test_bad_average_inputs(function: object, kwargs: dict, parameter: str) -> None:
    with pytest.raises(InvalidParameterError) as err:
        function(ONE, **kwargs)  # type: ignore[operator]
    assert err.value.parameter == parameter
    with pytest.raises(InvalidParameterError, match="noised_sums"):
        FIXED([], sampling_probability=0.5, population_size=3)


@pytest.mark.statistical
def test_fixed_denominator_average_is_unbiased_under_poisson_sampling() -> None:
    """E[Σ_{i∈R} x_i / (q·n)] = mean(x): checked over many Poisson samples of a fixed data set."""
    rng = np.random.default_rng(3)
    n, q, trials = 400, 0.1, 4000
    data = rng.uniform(0.0, 1.0, size=n)
    sampler = PoissonSampler(population_size=n, sampling_probability=q, generator=rng)
    estimates = np.array(
        [
            fixed_denominator_average(
                np.array(data[sampler.sample()].sum()), sampling_probability=q, population_size=n
            )[0]
            for _ in range(trials)
        ]
    )
    se = estimates.std(ddof=1) / math.sqrt(trials)
    assert abs(estimates.mean() - data.mean()) <= 5 * se
