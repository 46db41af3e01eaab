"""Poisson sampling for tf.data: inclusion frequencies, empty batches, reproducibility."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from dpledger.adapters.tensorflow.sampling import PoissonDatasetSampler
from dpledger.errors import InvalidParameterError

N = 60


def _population(n: int = N):
    x = np.arange(n, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
    return x, np.arange(n, dtype=np.int64)


def _index_sets(dataset) -> list[list[int]]:
    return [batch[1].tolist() for batch in dataset.as_numpy_iterator()]


@pytest.mark.statistical
def test_inclusion_frequencies_match_the_binomial():
    q, steps = 0.2, 500
    sampler = PoissonDatasetSampler(
        population_size=N, sampling_probability=q, steps_per_epoch=steps, seed=1234
    )
    batches = _index_sets(sampler.sample(_population()))
    assert len(batches) == steps
    counts = np.zeros(N)
    sizes = np.array([len(b) for b in batches])
    for b in batches:
        assert b == sorted(set(b))  # no record twice in a batch
        counts[b] += 1
    # Each record's count is Binomial(steps, q): its mean over records has standard error
    # sqrt(q(1-q)/(steps·N)) around q; allow 4 standard errors.
    freq = counts / steps
    se = np.sqrt(q * (1 - q) / (steps * N))
    assert abs(freq.mean() - q) < 4 * se
    # Goodness of fit of the per-record counts: Σ (c - steps·q)² / (steps·q(1-q)) ~ χ²(N).
    chi2 = np.sum((counts - steps * q) ** 2 / (steps * q * (1 - q)))
    assert 1e-3 < stats.chi2.sf(chi2, N) < 1 - 1e-3
    # Batch sizes are Binomial(N, q): mean N·q (SE sqrt(Nq(1-q)/steps)) and the sample variance
    # within its chi-square interval.
    assert abs(sizes.mean() - N * q) < 4 * np.sqrt(N * q * (1 - q) / steps)
    var = N * q * (1 - q)
    stat = (steps - 1) * sizes.var(ddof=1) / var
    assert stats.chi2.ppf(1e-3, steps - 1) < stat < stats.chi2.ppf(1 - 1e-3, steps - 1)
    # Inclusions are independent across records: the count of pairs (j, j+1) both included
    # is Binomial(steps·(N−1), q²) in expectation.
    pairs = sum(len(set(b) & {j + 1 for j in b}) for b in batches)
    expected_pairs = steps * (N - 1) * q * q
    assert abs(pairs - expected_pairs) < 4 * np.sqrt(expected_pairs * (1 + 2 * q))


def test_empty_batches_keep_their_shapes():
    sampler = PoissonDatasetSampler(
        population_size=5, sampling_probability=0.01, steps_per_epoch=20, seed=0
    )
    x, y = _population(5)
    for source in ((x, y), tf.data.Dataset.from_tensor_slices((x, y))):
        batches = list(sampler.sample(source).as_numpy_iterator())
        assert len(batches) == 20
        empty = [b for b in batches if b[1].shape[0] == 0]
        assert empty  # P(empty) = 0.99⁵ ≈ 0.95 per step
        for bx, by in empty:
            assert bx.shape == (0, 3) and bx.dtype == np.float32
            assert by.shape == (0,) and by.dtype == np.int64


def test_same_seed_same_batches_and_each_epoch_differs():
    x, y = _population()
    a = PoissonDatasetSampler(population_size=N, sampling_probability=0.1, seed=7).sample((x, y))
    b = PoissonDatasetSampler(population_size=N, sampling_probability=0.1, seed=7).sample((x, y))
    epoch_a1, epoch_a2 = _index_sets(a), _index_sets(a)
    assert epoch_a1 == _index_sets(b)
    assert epoch_a2 == _index_sets(b)
    assert epoch_a1 != epoch_a2
    other = PoissonDatasetSampler(population_size=N, sampling_probability=0.1, seed=8).sample(
        (x, y)
    )
    assert _index_sets(other) != epoch_a1


def test_dataset_source_gives_the_same_batches_as_arrays():
    x, y = _population()
    from_arrays = PoissonDatasetSampler(population_size=N, sampling_probability=0.15, seed=3)
    from_dataset = PoissonDatasetSampler(population_size=N, sampling_probability=0.15, seed=3)
    arrays = list(from_arrays.sample((x, y)).as_numpy_iterator())
    dataset = list(
        from_dataset.sample(tf.data.Dataset.from_tensor_slices((x, y))).as_numpy_iterator()
    )
    assert len(arrays) == len(dataset)
    for (ax, ay), (dx, dy) in zip(arrays, dataset, strict=True):
        np.testing.assert_array_equal(ax, dx)
        np.testing.assert_array_equal(ay, dy)
        np.testing.assert_array_equal(ax[:, 0], ay.astype(np.float32))


def test_index_dataset_and_dict_structures():
    sampler = PoissonDatasetSampler(population_size=N, sampling_probability=0.3, seed=5)
    for idx in sampler.index_dataset().as_numpy_iterator():
        assert idx.dtype == np.int64 and np.all(np.diff(idx) > 0)
        assert idx.size == 0 or (idx.min() >= 0 and idx.max() < N)
    x, y = _population()
    batch = next(iter(sampler.sample({"x": x, "y": y})))
    assert set(batch) == {"x", "y"}
    np.testing.assert_array_equal(batch["x"][:, 0].numpy(), batch["y"].numpy())


def test_properties_and_default_steps_per_epoch():
    sampler = PoissonDatasetSampler(population_size=1797, sampling_probability=256 / 1797, seed=1)
    assert sampler.population_size == 1797
    assert sampler.sampling_probability == 256 / 1797
    assert sampler.expected_batch_size == pytest.approx(256)
    assert sampler.steps_per_epoch == 7  # round(1797 / 256) = round(7.02)
    assert PoissonDatasetSampler(population_size=10, sampling_probability=0.4).steps_per_epoch == 3
    assert PoissonDatasetSampler(population_size=10, sampling_probability=1.0).steps_per_epoch == 1
    assert (
        PoissonDatasetSampler(
            population_size=10, sampling_probability=0.3, steps_per_epoch=11
        ).steps_per_epoch
        == 11
    )
    fixed = PoissonDatasetSampler.from_expected_batch_size(
        population_size=200, expected_batch_size=50
    )
    assert fixed.sampling_probability == 0.25 and fixed.steps_per_epoch == 4
    assert isinstance(PoissonDatasetSampler(population_size=3, sampling_probability=0.5).seed, int)
    assert "sampling_probability=0.5" in repr(
        PoissonDatasetSampler(population_size=3, sampling_probability=0.5, seed=1)
    )


def test_q_one_takes_every_record():
    x, y = _population(7)
    sampler = PoissonDatasetSampler(population_size=7, sampling_probability=1.0, seed=0)
    assert _index_sets(sampler.sample((x, y))) == [list(range(7))]


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        ({"population_size": 0, "sampling_probability": 0.5}, "population_size"),
        ({"population_size": 2.0, "sampling_probability": 0.5}, "population_size"),
        ({"population_size": 10, "sampling_probability": 0.0}, "sampling_probability"),
        ({"population_size": 10, "sampling_probability": 1.5}, "sampling_probability"),
        ({"population_size": 10, "sampling_probability": float("nan")}, "sampling_probability"),
        ({"population_size": 10, "sampling_probability": True}, "sampling_probability"),
        (
            {"population_size": 10, "sampling_probability": 0.5, "steps_per_epoch": 0},
            "steps_per_epoch",
        ),
        ({"population_size": 10, "sampling_probability": 0.5, "seed": -1}, "seed"),
        ({"population_size": 10, "sampling_probability": 0.5, "seed": 1.5}, "seed"),
    ],
)
def test_bad_parameters_are_refused(kwargs, parameter):
    with pytest.raises(InvalidParameterError) as info:
        PoissonDatasetSampler(**kwargs)
    assert info.value.parameter == parameter


@pytest.mark.parametrize("size", [0, -1, 11, float("nan"), "5", True])
def test_bad_expected_batch_sizes_are_refused(size):
    with pytest.raises(InvalidParameterError, match="expected_batch_size"):
        PoissonDatasetSampler.from_expected_batch_size(population_size=10, expected_batch_size=size)


def test_data_of_the_wrong_size_is_refused():
    sampler = PoissonDatasetSampler(population_size=N, sampling_probability=0.5, seed=0)
    x, y = _population(N + 1)
    with pytest.raises(InvalidParameterError, match="population_size=60"):
        sampler.sample((x, y))
    with pytest.raises(InvalidParameterError, match="population_size=60"):
        sampler.sample(tf.data.Dataset.from_tensor_slices((x, y)))
