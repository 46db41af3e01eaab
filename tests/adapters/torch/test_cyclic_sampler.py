"""CyclicBatchSampler draws its scheme's batches, one stream step each, and resumes exactly.

Reference: ``dpledger.sampling.CyclicScheme.draw`` (tested against the cyclic participation
pattern by brute force in ``tests/sampling/test_cyclic.py``).
"""

from __future__ import annotations

import pytest

from dpledger.adapters.torch import CyclicBatchSampler
from dpledger.errors import InvalidParameterError, SamplerMismatchError
from dpledger.mechanisms.correlated import CorrelatedNoiseSpec
from dpledger.sampling import CyclicScheme


def test_a_pass_is_one_epoch_of_the_schemes_draws_and_stops_at_t() -> None:
    scheme = CyclicScheme(
        population_size=30, period=4, num_steps=10, sampling_probability=0.5, seed=2
    )
    sampler = CyclicBatchSampler(scheme=scheme)
    assert len(sampler) == 4
    drawn = []
    while len(sampler):
        for t, batch in enumerate(list(sampler), start=sampler.next_step):
            assert batch == scheme.draw(t).tolist()
            sampler.claim_step(len(batch), step=t)
            sampler.step_released(t)
            drawn.append(t)
    assert drawn == list(range(10))  # passes of 4, 4 and 2 steps
    assert list(sampler) == [] and len(sampler) == 0
    assert sampler.denominator == pytest.approx(30 / 4 * 0.5, rel=1e-15)


def test_an_unreleased_step_is_drawn_again_by_the_next_pass() -> None:
    spec = CorrelatedNoiseSpec(strategy="tree", num_steps=8, period=4)
    sampler = CyclicBatchSampler.for_spec(spec, population_size=20, seed=0)
    first = next(iter(sampler))
    sampler.claim_step(len(first), step=0)  # claimed, then refused (not released)
    assert next(iter(sampler)) == first  # a new pass starts at step 0 again
    sampler.claim_step(len(first), step=0)
    sampler.step_released(0)
    with pytest.raises(SamplerMismatchError, match="drew no batch"):
        sampler.claim_step(len(first), step=1)  # nothing drawn for step 1 yet
    passes = iter(sampler)
    next(passes)  # step 1's batch
    second = next(passes)  # and step 2's
    with pytest.raises(SamplerMismatchError, match="skipped"):
        sampler.claim_step(len(second), step=2)  # the oldest draw is step 1's


def test_state_dict_resumes_the_stream_and_its_scheme_takes_over() -> None:
    """A sampler of another seed (as make_private(seed=None) builds) takes over the checkpoint's
    scheme and draws the checkpointed run's batches; another population is refused."""
    spec = CorrelatedNoiseSpec(strategy="tree", num_steps=8, period=4)
    sampler = CyclicBatchSampler.for_spec(spec, population_size=20, seed=0)
    for t, batch in enumerate(sampler):
        sampler.claim_step(len(batch), step=t)
        sampler.step_released(t)
    state = sampler.state_dict()
    again = CyclicBatchSampler.for_spec(spec, population_size=20, seed=0)
    again.load_state_dict(state)
    assert again.next_step == 4
    assert list(again) == [sampler.cyclic_scheme.draw(t).tolist() for t in range(4, 8)]
    other = CyclicBatchSampler.for_spec(spec, population_size=20, seed=1)
    other.load_state_dict(state)
    assert other.cyclic_scheme == sampler.cyclic_scheme
    assert list(other) == [sampler.cyclic_scheme.draw(t).tolist() for t in range(4, 8)]
    bigger = CyclicBatchSampler.for_spec(spec, population_size=21, seed=0)
    with pytest.raises(InvalidParameterError, match="scheme"):
        bigger.load_state_dict(state)
    with pytest.raises(InvalidParameterError, match="next_step"):
        again.load_state_dict({**state, "next_step": 9})


def test_what_a_cyclic_sampler_cannot_do_is_refused() -> None:
    spec = CorrelatedNoiseSpec(strategy="tree", num_steps=8, period=4)
    sampler = CyclicBatchSampler.for_spec(spec, population_size=20, seed=0)
    with pytest.raises(InvalidParameterError, match="correlated-noise release"):
        sampler.sampling_event()
    with pytest.raises(InvalidParameterError, match="correlated-noise release"):
        sampler.claim_draw(5)
    with pytest.raises(InvalidParameterError, match="seed"):
        sampler.reseed(3)
    with pytest.raises(InvalidParameterError, match="scheme"):
        CyclicBatchSampler(scheme=spec)  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError, match="spec"):
        CyclicBatchSampler.for_spec("tree", population_size=20, seed=0)  # type: ignore[arg-type]
    assert "CyclicBatchSampler" in repr(sampler)
