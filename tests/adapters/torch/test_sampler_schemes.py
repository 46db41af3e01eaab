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


@pytest.mark.parametrize(("make", "scheme"), CASES[:-1])
def test_the_batches_are_the_schemes_host_draws(make, scheme) -> None:
    """The indices are the core scheme's NumPy draws (dpledger.sampling.index_draws), from a
    NumPy generator seeded from the sampler's torch generator per draw (per epoch for the
    epoch-based schemes); a distributed rank keeps its share of the global draw."""
    sampler, twin = make(), make()
    keep = getattr(sampler, "rank", 0), getattr(sampler, "world_size", 1)
    for _ in range(2):  # two epochs: the generator's stream continues
        got = list(sampler)
        if scheme.epoch_based:
            batches = scheme.draw_epoch(twin.host_rng())
        else:
            batches = [scheme.draw(twin.host_rng()) for _ in got]
        want = [[i for i in b.tolist() if i % keep[1] == keep[0]] for b in batches]
        assert got == want
