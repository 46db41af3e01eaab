"""The NumPy Poisson sampler: inclusion with probability q, its step's event, its checks."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dpledger import PrivacyLedger, SamplingEvent
from dpledger.errors import InvalidParameterError
from dpledger.mechanisms import GaussianSumQuery, sampled_step
from dpledger.sampling import PoissonSampler
from dpledger.sampling.validation import MAX_POPULATION

QUERY = GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=1.0, label="q")


@pytest.mark.statistical
def test_poisson_sampler_includes_each_record_with_probability_q() -> None:
    n, q = 20_000, 0.03
    sampler = PoissonSampler(
        population_size=n, sampling_probability=q, generator=np.random.default_rng(4)
    )
    sizes = np.array([sampler.sample().size for _ in range(200)])
    # Binomial(n, q): mean n·q, standard error of the mean √(n q (1-q) / 200)
    assert abs(sizes.mean() - n * q) <= 5 * math.sqrt(n * q * (1 - q) / 200)
    idx = sampler.sample()
    assert (np.diff(idx) > 0).all() and idx.min() >= 0 and idx.max() < n


def test_poisson_sampler_step_records_its_own_q_and_n() -> None:
    ledger = PrivacyLedger()
    sampler = PoissonSampler(
        population_size=1000, sampling_probability=0.05, generator=np.random.default_rng(5)
    )
    assert sampler.expected_batch_size == 50.0
    with sampled_step(ledger, sampler=sampler) as step:
        assert step.indices is not None and step.generator is sampler.generator
        step.run(QUERY, np.ones((step.indices.size, 2)))
    first = next(iter(ledger.steps()))
    assert first.sampling == SamplingEvent(0.05, 1000)
    full = PoissonSampler(
        population_size=3, sampling_probability=1.0, generator=np.random.default_rng()
    )
    with sampled_step(ledger, sampler=full) as step:
        assert step.indices.tolist() == [0, 1, 2]
    assert list(ledger.steps())[1].sampling.scheme.value == "full"
    assert "PoissonSampler" in repr(full)


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        ({"population_size": 0, "sampling_probability": 0.1}, "population_size"),
        ({"population_size": 10, "sampling_probability": -0.1}, "sampling_probability"),
        ({"population_size": 10, "sampling_probability": 0.1, "generator": 3}, "generator"),
    ],
)
def test_bad_sampler_arguments(kwargs: dict, parameter: str) -> None:
    kwargs.setdefault("generator", np.random.default_rng())
    with pytest.raises(InvalidParameterError) as err:
        PoissonSampler(**kwargs)
    assert err.value.parameter == parameter


def test_population_beyond_the_cap_is_refused_before_any_draw() -> None:
    with pytest.raises(InvalidParameterError, match=r"2\*\*33") as err:
        PoissonSampler(
            population_size=MAX_POPULATION + 1,
            sampling_probability=0.5,
            generator=np.random.default_rng(),
        )
    assert err.value.parameter == "population_size"


def test_zero_rate_is_allowed_and_draws_nothing() -> None:
    sampler = PoissonSampler(
        population_size=5, sampling_probability=0.0, generator=np.random.default_rng(0)
    )
    assert sampler.sample().size == 0 and sampler.expected_batch_size == 0.0


def test_a_step_on_a_sampler_takes_nothing_the_sampler_decides() -> None:
    sampler = PoissonSampler(
        population_size=10, sampling_probability=0.5, generator=np.random.default_rng(1)
    )
    ledger = PrivacyLedger()
    for name, value in (("sampling_probability", 0.5), ("population_size", 10), ("scheme", "full")):
        with pytest.raises(InvalidParameterError) as err:
            sampled_step(ledger, sampler=sampler, **{name: value}).__enter__()
        assert err.value.parameter == name
    with pytest.raises(InvalidParameterError, match="PoissonSampler"):
        sampled_step(ledger, sampler=object()).__enter__()  # type: ignore[arg-type]
    assert ledger.num_steps == 0
    noise = np.random.default_rng(2)
    with sampled_step(ledger, sampler=sampler, generator=noise) as step:
        assert step.generator is noise and step.population_size == 10
