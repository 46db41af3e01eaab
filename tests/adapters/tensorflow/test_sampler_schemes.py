"""Every tf.data sampler holds the dpledger.sampling scheme of its parameters and answers with
that scheme's events, steps and rate."""

from __future__ import annotations

import numpy as np
import pytest

from dpledger.adapters.tensorflow import (
    BallsInBinsDatasetSampler,
    FixedSizeDatasetSampler,
    PoissonDatasetSampler,
    ShuffleDatasetSampler,
    TruncatedPoissonDatasetSampler,
)
from dpledger.sampling import (
    BallsInBinsScheme,
    FixedSizeScheme,
    PoissonScheme,
    ShuffleScheme,
    TruncatedPoissonScheme,
)
from dpledger.sampling.index_draws import host_generator

CASES = [
    (
        lambda: PoissonDatasetSampler(population_size=20, sampling_probability=0.4, seed=0),
        PoissonScheme(population_size=20, sampling_probability=0.4, round_half_up=True),
    ),
    (
        lambda: FixedSizeDatasetSampler(population_size=20, batch_size=8, seed=0),
        FixedSizeScheme(population_size=20, batch_size=8, round_half_up=True),
    ),
    (
        lambda: TruncatedPoissonDatasetSampler(
            population_size=20, sampling_probability=0.3, max_batch_size=4, seed=0
        ),
        TruncatedPoissonScheme(
            population_size=20, sampling_probability=0.3, max_batch_size=4, round_half_up=True
        ),
    ),
    (
        lambda: BallsInBinsDatasetSampler(population_size=20, num_batches=6, seed=0),
        BallsInBinsScheme(population_size=20, num_batches=6),
    ),
    (
        lambda: ShuffleDatasetSampler(population_size=20, batch_size=6, seed=0),
        ShuffleScheme(population_size=20, batch_size=6),
    ),
]


@pytest.mark.parametrize(("make", "scheme"), CASES)
def test_sampler_holds_its_scheme(make, scheme) -> None:
    sampler = make()
    assert sampler.scheme == scheme
    assert sampler.steps_per_epoch == scheme.steps_per_epoch
    assert sampler.epoch_based is scheme.epoch_based
    assert sampler.sampling_probability == scheme.sampling_probability
    assert sampler.sampling_event == scheme.event()
    steps = range(sampler.steps_per_epoch)
    assert [sampler.event_for_step(i) for i in steps] == [scheme.event_for_step(i) for i in steps]


def test_default_steps_round_halves_up_as_before() -> None:
    # 1/q = 2.5 and n/b = 2.5: three batches per epoch (PyTorch's samplers round to even: two)
    assert (
        PoissonDatasetSampler(population_size=10, sampling_probability=0.4, seed=0).steps_per_epoch
        == 3
    )
    assert FixedSizeDatasetSampler(population_size=10, batch_size=4, seed=0).steps_per_epoch == 3


@pytest.mark.parametrize(("make", "scheme"), CASES)
def test_the_batches_are_the_schemes_host_draws(make, scheme) -> None:
    """The indices are the core scheme's NumPy draws (dpledger.sampling.index_draws), from one
    seed pair of the sampler's generator per draw (per epoch for the epoch-based schemes),
    sorted."""
    sampler, twin = make(), make()
    for _ in range(2):  # two epochs: the generator's stream continues
        got = [b.tolist() for b in sampler.index_dataset().as_numpy_iterator()]
        if scheme.epoch_based:
            batches = scheme.draw_epoch(host_generator(twin._seed_pair().numpy()))
        else:
            draws = [host_generator(twin._seed_pair().numpy()) for _ in got]
            batches = [scheme.draw(rng) for rng in draws]
        assert got == [np.sort(b).tolist() for b in batches]
