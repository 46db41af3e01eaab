"""CyclicDatasetSampler: the tf.data draws of the core CyclicScheme, pass after pass."""

from __future__ import annotations

import numpy as np
import pytest

from dpledger.adapters.tensorflow import CyclicDatasetSampler
from dpledger.errors import InvalidParameterError
from dpledger.sampling import CyclicScheme


@pytest.mark.parametrize("q", [None, 0.5])
def test_batches_are_the_core_schemes_draws_of_the_streams_steps(q):
    """Reference: ``CyclicScheme.draw(t)`` of a scheme built here with the same parameters."""
    sampler = CyclicDatasetSampler(
        population_size=30, period=3, num_steps=9, sampling_probability=q, seed=4
    )
    scheme = CyclicScheme(population_size=30, period=3, num_steps=9, sampling_probability=q, seed=4)
    data = sampler.sample(np.arange(30))
    seen = [batch.numpy().tolist() for _ in range(3) for batch in data]
    assert seen == [scheme.draw(t).tolist() for t in range(9)]
    assert sampler.next_step == 9
    assert sampler.drew(data) and not sampler.drew(data.shuffle(2))


def test_peeking_does_not_advance_and_seek_resumes_a_pass():
    sampler = CyclicDatasetSampler(population_size=12, period=2, num_steps=6, seed=0)
    data = sampler.sample(np.arange(12))
    with sampler.preserved_state():
        next(iter(data))
    assert sampler.next_step == 0
    sampler.seek(4)
    assert [b.numpy().tolist() for b in data] == [
        sampler.cyclic_scheme.draw(4).tolist(),
        sampler.cyclic_scheme.draw(5).tolist(),
    ]
    with pytest.raises(InvalidParameterError, match="step"):
        sampler.seek(3)


def test_bad_arguments_and_per_step_events_are_refused():
    with pytest.raises(InvalidParameterError, match="num_steps"):
        CyclicDatasetSampler(population_size=12, period=4, num_steps=6, seed=0)
    with pytest.raises(InvalidParameterError, match="period"):
        CyclicDatasetSampler(population_size=3, period=4, num_steps=8, seed=0)
    sampler = CyclicDatasetSampler(population_size=12, period=2, num_steps=6, seed=0)
    with pytest.raises(InvalidParameterError, match="correlated-noise release"):
        sampler.sampling_event  # noqa: B018
    assert sampler.average_denominator == 6.0
