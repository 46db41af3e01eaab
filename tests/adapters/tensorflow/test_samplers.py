"""The samplers of every scheme for tf.data: distributions, epochs, events, ties to datasets."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from dpledger.adapters.tensorflow import (
    BallsInBinsDatasetSampler,
    FixedSizeDatasetSampler,
    PoissonDatasetSampler,
    ShuffleDatasetSampler,
    TruncatedPoissonDatasetSampler,
)
from dpledger.adapters.tensorflow.sampler_base import RecordedDatasetSampler
from dpledger.errors import InvalidParameterError
from dpledger.ledger import SamplingEvent, SamplingScheme

# Tails of the two-sided checks: a statistic outside its central 1 − 2·TAIL interval fails.
TAIL = 1e-4
# Standard deviations allowed for an (approximately) normal statistic: P(|Z| > 5) ≈ 5.7e-7.
K = 5.0


def _population(n: int):
    x = np.arange(n, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)
    return x, np.arange(n, dtype=np.int64)


def _index_sets(dataset) -> list[list[int]]:
    return [batch.tolist() for batch in dataset.as_numpy_iterator()]


def _epochs(sampler: RecordedDatasetSampler, epochs: int) -> list[list[list[int]]]:
    """``epochs`` iterations of the sampler's index dataset (each draws a new epoch), read
    through one iterator: ``repeat`` iterates the dataset again for every repetition."""
    batches = _index_sets(sampler.index_dataset().repeat(epochs))
    per = sampler.steps_per_epoch
    assert len(batches) == epochs * per
    return [batches[e * per : (e + 1) * per] for e in range(epochs)]


def _chi2_ok(statistic: float, dof: int) -> bool:
    return stats.chi2.ppf(TAIL, dof) < statistic < stats.chi2.ppf(1 - TAIL, dof)


def _all_samplers(seed: int = 3) -> list[RecordedDatasetSampler]:
    return [
        PoissonDatasetSampler(population_size=12, sampling_probability=0.25, seed=seed),
        FixedSizeDatasetSampler(population_size=12, batch_size=5, seed=seed),
        TruncatedPoissonDatasetSampler(
            population_size=12, sampling_probability=0.5, max_batch_size=4, seed=seed
        ),
        BallsInBinsDatasetSampler(population_size=12, num_batches=3, seed=seed),
        ShuffleDatasetSampler(population_size=12, batch_size=5, seed=seed),
        ShuffleDatasetSampler(population_size=12, batch_size=4, drop_last=True, seed=seed),
    ]


_IDS = ["poisson", "fixed", "truncated", "balls", "shuffle", "shuffle_drop"]


# ----------------------------------------------------------------------------- fixed size
@pytest.mark.statistical
def test_fixed_size_batches_are_uniform_subsets_drawn_independently_per_step():
    n, b, steps = 30, 7, 600
    sampler = FixedSizeDatasetSampler(
        population_size=n, batch_size=b, steps_per_epoch=steps, seed=11
    )
    batches = _index_sets(sampler.index_dataset())
    assert len(batches) == steps
    counts = np.zeros(n)
    for batch in batches:
        assert len(batch) == b and batch == sorted(set(batch))  # exactly b distinct records
        assert batch[0] >= 0 and batch[-1] < n
        counts[batch] += 1
    # Each record's count is Binomial(steps, p), p = b/n; the counts sum to steps·b, so
    # Σ (c − steps·p)² / (steps·p(1−p)) is (n/(n−1))·χ²(n−1) (multivariate hypergeometric-like
    # covariance −var/(n−1)).
    p = b / n
    var = steps * p * (1 - p)
    assert np.all(np.abs(counts - steps * p) < K * math.sqrt(var))
    assert _chi2_ok(np.sum((counts - steps * p) ** 2) / var * (n - 1) / n, n - 1)
    # Independence across steps: |B_t ∩ B_{t+1}| is Hypergeometric(n, b, b) whatever B_{t+1}
    # is, so the overlaps of consecutive steps are iid with mean b²/n (a shuffle would give 0).
    overlaps = np.array([len(set(a) & set(c)) for a, c in itertools.pairwise(batches)])
    mean = b * b / n
    hyper_var = b * (b / n) * ((n - b) / n) * ((n - b) / (n - 1))
    assert abs(overlaps.mean() - mean) < K * math.sqrt(hyper_var / len(overlaps))


# ----------------------------------------------------------------------------- truncated
@pytest.mark.statistical
def test_truncated_poisson_is_a_poisson_draw_cut_to_a_uniform_subset():
    n, q, m, steps = 30, 0.4, 10, 800
    sampler = TruncatedPoissonDatasetSampler(
        population_size=n, sampling_probability=q, max_batch_size=m, steps_per_epoch=steps, seed=5
    )
    batches = _index_sets(sampler.index_dataset())
    assert len(batches) == steps
    sizes = np.array([len(batch) for batch in batches])
    for batch in batches:
        assert batch == sorted(set(batch)) and len(batch) <= m
    # Batch sizes are min(Binomial(n, q), m): each size's frequency is a binomial proportion.
    pmf = stats.binom.pmf(np.arange(m), n, q)
    expected = np.append(pmf, stats.binom.sf(m - 1, n, q))  # P(size = m) = P(X ≥ m)
    for size, prob in enumerate(expected):
        freq = np.mean(sizes == size)
        assert abs(freq - prob) < K * math.sqrt(prob * (1 - prob) / steps) + 1e-12, size
    assert expected[m] > 0.6  # the cut is taken on most steps
    # The kept records are a uniform subset: every record is in a batch with probability
    # E[min(X, m)]/n (a cut keeping the lowest indices would favour records 0..m−1).
    p = float(np.sum(np.arange(m + 1) * expected)) / n
    counts = np.zeros(n)
    for batch in batches:
        counts[batch] += 1
    assert np.all(np.abs(counts - steps * p) < K * math.sqrt(steps * p * (1 - p)))


# ----------------------------------------------------------------------------- balls in bins
@pytest.mark.statistical
def test_balls_in_bins_partitions_each_epoch_with_uniform_independent_bins():
    n, k, epochs = 40, 4, 200
    sampler = BallsInBinsDatasetSampler(population_size=n, num_batches=k, seed=21)
    table = np.zeros((n, k))  # table[j, c]: epochs in which record j was in batch c
    sizes = []
    previous = None
    for epoch in _epochs(sampler, epochs):
        assert len(epoch) == k  # every epoch has its k batches, empty ones included
        flat = [j for batch in epoch for j in batch]
        assert sorted(flat) == list(range(n))  # a partition: every record exactly once
        for c, batch in enumerate(epoch):
            assert batch == sorted(batch)
            table[batch, c] += 1
            sizes.append(len(batch))
        assert epoch != previous
        previous = epoch
    # Each record's batch is uniform over the k batches, independently across epochs:
    # per record Σ_c (count − E)²/E ~ χ²(k−1), and independent records sum to χ²(n(k−1)).
    e = epochs / k
    assert np.all(np.abs(table - e) < K * math.sqrt(epochs * (1 / k) * (1 - 1 / k)))
    assert _chi2_ok(np.sum((table - e) ** 2 / e), n * (k - 1))
    # Records are allocated independently: an epoch's k batch sizes are Multinomial(n, 1/k),
    # so Σ_c (s_c − n/k)² / (n/k) is Pearson's χ²(k−1) per epoch, χ²(epochs·(k−1)) in all (a
    # balanced allocation would give far less).
    sizes = np.array(sizes, dtype=np.float64)
    assert _chi2_ok(np.sum((sizes - n / k) ** 2) / (n / k), epochs * (k - 1))


# ----------------------------------------------------------------------------- shuffle
def test_shuffle_refuses_drop_last_unless_b_divides_n():
    """Leaving the remainder out of every epoch is not the recorded shuffle(b, n)."""
    with pytest.raises(InvalidParameterError, match="does not divide"):
        ShuffleDatasetSampler(population_size=10, batch_size=4, drop_last=True)
    exact = ShuffleDatasetSampler(population_size=12, batch_size=4, drop_last=True)
    assert exact.steps_per_epoch == 3


@pytest.mark.statistical
def test_shuffle_cuts_a_fresh_uniform_permutation_into_batches():
    n, b, epochs = 10, 4, 400
    sampler = ShuffleDatasetSampler(population_size=n, batch_size=b, seed=9)
    shape = [4, 4, 2]
    assert sampler.steps_per_epoch == len(shape)
    table = np.zeros((n, len(shape)))
    together = 0  # epochs in which records 0 and 1 share a batch
    epoch_sets = []
    for epoch in _epochs(sampler, epochs):
        assert [len(batch) for batch in epoch] == shape
        flat = [j for batch in epoch for j in batch]
        assert sorted(flat) == list(range(n))  # every record once per epoch
        for c, batch in enumerate(epoch):
            table[batch, c] += 1
            together += {0, 1} <= set(batch)
        epoch_sets.append(tuple(map(tuple, epoch)))
    # A fresh uniform permutation every epoch: the epoch's batches (as sets) are uniform over
    # the M = 10!/(4!·4!·2!) = 3150 ways to cut the records, so among the epochs there are
    # about C(epochs, 2)/M ≈ 25 repeated pairs (Poisson), and M(1 − (1 − 1/M)^epochs) distinct.
    ways = math.factorial(n) // (math.factorial(4) ** 2 * math.factorial(2))
    distinct = ways * (1 - (1 - 1 / ways) ** epochs)
    repeats = epochs * (epochs - 1) / 2 / ways
    assert abs(len(set(epoch_sets)) - distinct) < K * math.sqrt(repeats)
    # Record j is in batch c with probability size_c/n; with the column sums fixed the
    # statistic of the n × batches table is χ²((n−1)(batches−1)).
    sizes = np.array(shape, dtype=np.float64)
    expected = epochs * sizes / n
    assert np.all(np.abs(table - expected) < K * np.sqrt(epochs * (sizes / n) * (1 - sizes / n)))
    assert _chi2_ok(np.sum((table - expected) ** 2 / expected), (n - 1) * (len(sizes) - 1))
    # A uniform permutation puts a given pair in the same batch with probability
    # Σ_c s_c(s_c − 1) / (n(n − 1)).
    kept = np.array(shape, dtype=np.float64)
    p = float(np.sum(kept * (kept - 1))) / (n * (n - 1))
    assert abs(together / epochs - p) < K * math.sqrt(p * (1 - p) / epochs)


# ----------------------------------------------------------------------------- all samplers
@pytest.mark.parametrize("index", range(6), ids=_IDS)
def test_dataset_source_gives_the_same_batches_as_arrays(index):
    x, y = _population(12)
    from_arrays, from_dataset = _all_samplers(seed=4)[index], _all_samplers(seed=4)[index]
    arrays = list(from_arrays.sample((x, y)).as_numpy_iterator())
    dataset = list(
        from_dataset.sample(tf.data.Dataset.from_tensor_slices((x, y))).as_numpy_iterator()
    )
    assert len(arrays) == len(dataset) == from_arrays.steps_per_epoch
    for (ax, ay), (dx, dy) in zip(arrays, dataset, strict=True):
        np.testing.assert_array_equal(ax, dx)
        np.testing.assert_array_equal(ay, dy)
        np.testing.assert_array_equal(ax[:, 0], ay.astype(np.float32))


@pytest.mark.parametrize("index", range(6), ids=_IDS)
def test_same_seed_same_batches_each_epoch_differs_and_peeks_are_undone(index):
    x, y = _population(12)
    a, b = _all_samplers(seed=7)[index], _all_samplers(seed=7)[index]
    da, db = a.sample((x, y)), b.sample((x, y))
    with a.preserved_state():
        next(iter(da))  # a peek draws a whole epoch for the epoch-based samplers
    first, second = [bb[1].numpy().tolist() for bb in da], [bb[1].numpy().tolist() for bb in da]
    assert first == [bb[1].numpy().tolist() for bb in db]
    assert second == [bb[1].numpy().tolist() for bb in db]
    assert first != second


@pytest.mark.parametrize("index", range(6), ids=_IDS)
def test_drew_ties_datasets_to_their_sampler(index):
    x, y = _population(12)
    sampler, other = _all_samplers()[index], _all_samplers()[index]
    data = sampler.sample((x, y))
    assert sampler.drew(data) and sampler.drew(data.prefetch(2))
    assert not sampler.drew(data.unbatch().batch(5))
    assert not sampler.drew(other.sample((x, y)))
    assert not sampler.drew(tf.data.Dataset.from_tensor_slices((x, y)).shuffle(12).batch(5))


def test_events_of_every_step_and_their_denominators():
    n = 12
    cases = [
        (
            FixedSizeDatasetSampler(population_size=n, batch_size=5, seed=0),
            SamplingEvent.fixed_size(5, n),
            5.0,
        ),
        (
            TruncatedPoissonDatasetSampler(
                population_size=n, sampling_probability=0.25, max_batch_size=4, seed=0
            ),
            SamplingEvent.truncated_poisson(0.25, n, 4),
            3.0,
        ),
        (
            BallsInBinsDatasetSampler(population_size=n, num_batches=3, seed=0),
            SamplingEvent.balls_in_bins(3, n),
            4.0,
        ),
        (
            ShuffleDatasetSampler(population_size=n, batch_size=5, seed=0),
            SamplingEvent.shuffle(5, n),
            5.0,
        ),
        (PoissonDatasetSampler(population_size=n, sampling_probability=0.5, seed=0), None, 6.0),
    ]
    for sampler, event, denominator in cases:
        if event is None:
            event = SamplingEvent.poisson(0.5, n)
        assert sampler.sampling_event == event
        assert sampler.sampling_probability == event.sampling_probability
        assert event.average_denominator == denominator
        steps = [sampler.event_for_step(i) for i in range(sampler.steps_per_epoch)]
        if sampler.epoch_based:
            assert steps[0] == SamplingEvent(**{**_fields(event), "epoch_start": True})
            assert all(s == event for s in steps[1:])
        else:
            assert all(s == event for s in steps)
        for bad in (-1, sampler.steps_per_epoch, 1.0, True):
            with pytest.raises(InvalidParameterError, match="step"):
                sampler.event_for_step(bad)
    assert ShuffleDatasetSampler(population_size=n, batch_size=5).steps_per_epoch == 3
    assert (
        ShuffleDatasetSampler(population_size=10, batch_size=5, drop_last=True).steps_per_epoch == 2
    )
    assert (
        FixedSizeDatasetSampler(population_size=n, batch_size=5).steps_per_epoch == 2
    )  # round(2.4)
    balls = BallsInBinsDatasetSampler(population_size=n, num_batches=3, seed=1)
    assert balls.steps_per_epoch == 3
    assert balls.sampling_event.scheme is SamplingScheme.BALLS_IN_BINS
    assert "num_batches=3" in repr(balls) and "seed=1" in repr(balls)


def _fields(event: SamplingEvent) -> dict:
    return {
        "sampling_probability": event.sampling_probability,
        "population_size": event.population_size,
        "scheme": event.scheme,
        "batch_size": event.batch_size,
        "max_batch_size": event.max_batch_size,
        "num_batches": event.num_batches,
    }


@pytest.mark.parametrize(
    ("make", "parameter"),
    [
        (lambda: FixedSizeDatasetSampler(population_size=10, batch_size=0), "batch_size"),
        (lambda: FixedSizeDatasetSampler(population_size=10, batch_size=11), "batch_size"),
        (lambda: FixedSizeDatasetSampler(population_size=0, batch_size=1), "population_size"),
        (lambda: FixedSizeDatasetSampler(population_size=10, batch_size=2, seed=-1), "seed"),
        (
            lambda: FixedSizeDatasetSampler(population_size=10, batch_size=2, steps_per_epoch=0),
            "steps_per_epoch",
        ),
        (
            lambda: TruncatedPoissonDatasetSampler(
                population_size=10, sampling_probability=0.0, max_batch_size=2
            ),
            "sampling_probability",
        ),
        (
            lambda: TruncatedPoissonDatasetSampler(
                population_size=10, sampling_probability=0.5, max_batch_size=11
            ),
            "max_batch_size",
        ),
        (lambda: BallsInBinsDatasetSampler(population_size=10, num_batches=0), "num_batches"),
        (lambda: BallsInBinsDatasetSampler(population_size=10, num_batches=11), "num_batches"),
        (lambda: ShuffleDatasetSampler(population_size=10, batch_size=2.5), "batch_size"),
        (lambda: ShuffleDatasetSampler(population_size=10, batch_size=2, drop_last=1), "drop_last"),
    ],
)
def test_bad_parameters_are_refused(make, parameter):
    with pytest.raises(InvalidParameterError) as info:
        make()
    assert info.value.parameter == parameter


def test_data_of_the_wrong_size_is_refused():
    sampler = ShuffleDatasetSampler(population_size=12, batch_size=5, seed=0)
    x, y = _population(13)
    with pytest.raises(InvalidParameterError, match="population_size=12"):
        sampler.sample((x, y))
    with pytest.raises(InvalidParameterError, match="population_size=12"):
        sampler.sample(tf.data.Dataset.from_tensor_slices((x, y)))
