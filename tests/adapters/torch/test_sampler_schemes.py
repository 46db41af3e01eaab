"""Every PyTorch batch sampler holds the dpledger.sampling scheme of its parameters and records
that scheme's events, steps and denominator."""

from __future__ import annotations

import pytest

from dpledger.adapters.torch import (
    BallsInBinsBatchSampler,
    DistributedPoissonBatchSampler,
    FixedSizeBatchSampler,
    PoissonBatchSampler,
    ShuffleBatchSampler,
    TruncatedPoissonBatchSampler,
    UserPoissonBatchSampler,
)
from dpledger.sampling import (
    BallsInBinsScheme,
    FixedSizeScheme,
    PoissonScheme,
    ShuffleScheme,
    TruncatedPoissonScheme,
    UserPoissonScheme,
)

CASES = [
    (
        lambda: PoissonBatchSampler(population_size=20, sampling_probability=0.4, seed=0),
        PoissonScheme(population_size=20, sampling_probability=0.4),
    ),
    (
        lambda: DistributedPoissonBatchSampler(
            population_size=20, sampling_probability=0.25, rank=1, world_size=2, seed=0
        ),
        PoissonScheme(population_size=20, sampling_probability=0.25),
    ),
    (
        lambda: FixedSizeBatchSampler(population_size=20, batch_size=8, seed=0),
        FixedSizeScheme(population_size=20, batch_size=8),
    ),
    (
        lambda: TruncatedPoissonBatchSampler(
            population_size=20, sampling_probability=0.3, max_batch_size=4, steps=5, seed=0
        ),
        TruncatedPoissonScheme(
            population_size=20, sampling_probability=0.3, max_batch_size=4, steps=5
        ),
    ),
    (
        lambda: BallsInBinsBatchSampler(population_size=20, num_batches=6, seed=0),
        BallsInBinsScheme(population_size=20, num_batches=6),
    ),
    (
        lambda: ShuffleBatchSampler(population_size=20, batch_size=6, seed=0),
        ShuffleScheme(population_size=20, batch_size=6),
    ),
    (
        lambda: UserPoissonBatchSampler([0, 0, 1, 2, 2, 2], 0.5, 2, seed=0),
        UserPoissonScheme(num_users=3, sampling_probability=0.5, max_records_per_user=2),
    ),
]


@pytest.mark.parametrize(("make", "scheme"), CASES)
def test_sampler_holds_its_scheme_and_records_its_events(make, scheme) -> None:
    sampler = make()
    assert sampler.scheme == scheme
    assert len(sampler) == scheme.steps_per_epoch
    assert sampler.denominator == scheme.average_denominator
    assert sampler.sampling_event() == scheme.event()
    assert sampler.sampling_event(epoch_start=True) == scheme.event(epoch_start=True)
    # the draws of a pass are claimed with the scheme's events, epoch_start on the first
    batches = list(sampler)
    events = [sampler.claim_draw(len(batch)) for batch in batches]
    assert events == [scheme.event_for_step(i) for i in range(len(batches))]
