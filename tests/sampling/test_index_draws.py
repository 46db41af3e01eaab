"""The host-side index draws of every scheme (dpledger.sampling.index_draws), written once for
the PyTorch and the tf.data samplers: shapes, orders, exact sizes, reproducibility, and the
draws the schemes make with them."""

from __future__ import annotations

import doctest
import math

import numpy as np
import pytest

from dpledger.sampling import (
    BallsInBinsScheme,
    FixedSizeScheme,
    PoissonScheme,
    ShuffleScheme,
    TruncatedPoissonScheme,
    UserPoissonScheme,
    index_draws,
)
from dpledger.sampling.index_draws import UserRecords, host_generator


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _increasing(batch: np.ndarray) -> bool:
    return batch.dtype == np.int64 and bool((np.diff(batch) > 0).all())


def test_docstring_examples() -> None:
    result = doctest.testmod(index_draws)
    assert result.attempted > 0 and result.failed == 0


def test_host_generator_takes_any_int64_words_and_is_a_function_of_them() -> None:
    a = host_generator([-1, 5]).random(4)
    assert np.array_equal(a, host_generator(np.array([-1, 5], dtype=np.int64)).random(4))
    assert np.array_equal(a, host_generator([(1 << 64) - 1, 5]).random(4))  # -1 mod 2**64
    assert not np.array_equal(a, host_generator([-1, 6]).random(4))


def test_poisson_is_the_uniforms_below_q_also_in_chunks() -> None:
    for n in (1000, (1 << 22) + 17):  # one call, and the chunked path
        got = index_draws.poisson(_rng(3), n, 0.001)
        want = np.flatnonzero(_rng(3).random(n) < 0.001)
        assert _increasing(got) and np.array_equal(got, want)
    assert index_draws.poisson(_rng(), 5, 1.0).tolist() == [0, 1, 2, 3, 4]


def test_fixed_size_and_truncated_poisson_sizes() -> None:
    rng = _rng(1)
    for _ in range(50):
        batch = index_draws.fixed_size(rng, 30, 7)
        assert batch.size == 7 and _increasing(batch) and batch[0] >= 0 and batch[-1] < 30
        capped = index_draws.truncated_poisson(rng, 30, 0.5, 4)
        assert capped.size <= 4 and _increasing(capped)
    assert index_draws.fixed_size(rng, 4, 4).tolist() == [0, 1, 2, 3]
    # below the cap the truncated draw is the Poisson draw itself
    assert np.array_equal(
        index_draws.truncated_poisson(_rng(2), 30, 0.1, 30), index_draws.poisson(_rng(2), 30, 0.1)
    )


@pytest.mark.statistical
def test_truncation_keeps_a_uniform_subset_of_the_poisson_draw() -> None:
    # q = 1 draws every record; a cap of m keeps each with probability m / n
    n, m, trials = 10, 3, 6000
    rng = _rng(4)
    counts = np.zeros(n)
    for _ in range(trials):
        counts[index_draws.truncated_poisson(rng, n, 1.0, m)] += 1
    p = m / n
    assert np.all(np.abs(counts / trials - p) < 4.5 * math.sqrt(p * (1 - p) / trials))


def test_epoch_draws_partition_the_records() -> None:
    rng = _rng(5)
    bins = index_draws.balls_in_bins(rng, 23, 4)
    assert len(bins) == 4 and all(b.size == 0 or _increasing(b) for b in bins)
    assert sorted(np.concatenate(bins).tolist()) == list(range(23))
    pieces = index_draws.shuffle(rng, 23, 5, 5)
    assert [p.size for p in pieces] == [5, 5, 5, 5, 3]
    assert sorted(np.concatenate(pieces).tolist()) == list(range(23))
    assert [p.size for p in index_draws.shuffle(rng, 20, 5, 4)] == [5] * 4


def test_user_records_cap_each_user_and_name_the_users() -> None:
    slots = [0, 1, 0, 2, 0, 1, 0]  # user 0 has records 0, 2, 4, 6
    users = UserRecords(slots)
    assert users.num_users == 3 and users.records_per_user.tolist() == [4, 2, 1]
    records, owners = users.draw(_rng(), sampling_probability=1.0, max_records_per_user=10)
    assert records.tolist() == [0, 2, 4, 6, 1, 5, 3] and owners.tolist() == [0, 0, 0, 0, 1, 1, 2]
    rng = _rng(6)
    for _ in range(30):
        records, owners = users.draw(rng, sampling_probability=0.7, max_records_per_user=2)
        assert [slots[r] for r in records] == owners.tolist()
        assert all(np.count_nonzero(owners == u) <= 2 for u in range(3))
        assert (np.diff(owners) >= 0).all()  # grouped by user, users in order


def test_every_scheme_draws_through_index_draws_from_the_generator_given() -> None:
    stepwise = [
        (PoissonScheme(population_size=40, sampling_probability=0.3),
         lambda r: index_draws.poisson(r, 40, 0.3)),
        (FixedSizeScheme(population_size=40, batch_size=6),
         lambda r: index_draws.fixed_size(r, 40, 6)),
        (TruncatedPoissonScheme(population_size=40, sampling_probability=0.3, max_batch_size=5),
         lambda r: index_draws.truncated_poisson(r, 40, 0.3, 5)),
    ]  # fmt: skip
    for scheme, draw in stepwise:
        assert np.array_equal(scheme.draw(_rng(7)), draw(_rng(7)))
        epoch = scheme.draw_epoch(_rng(8))
        ref = _rng(8)
        assert len(epoch) == scheme.steps_per_epoch
        assert all(np.array_equal(b, draw(ref)) for b in epoch)
    balls = BallsInBinsScheme(population_size=40, num_batches=3)
    shuffled = ShuffleScheme(population_size=40, batch_size=6)
    for got, want in (
        (balls.draw_epoch(_rng(9)), index_draws.balls_in_bins(_rng(9), 40, 3)),
        (shuffled.draw_epoch(_rng(9)), index_draws.shuffle(_rng(9), 40, 6, 7)),
    ):
        assert len(got) == len(want) and all(map(np.array_equal, got, want))
    user = UserPoissonScheme(num_users=3, sampling_probability=0.5, max_records_per_user=1)
    for scheme in (balls, shuffled, user):
        with pytest.raises(TypeError, match="no per-step draw"):
            scheme.draw(_rng())
