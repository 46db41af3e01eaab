"""Every tf.data sampler holds the dpledger.sampling scheme of its parameters and answers with
that scheme's events, steps and rate."""

from __future__ import annotations

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
