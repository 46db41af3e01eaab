"""The ``tf.data`` samplers whose every step is an independent draw: Poisson, fixed size and
truncated Poisson batches (the schemes and their randomness:
:mod:`~dpledger.adapters.tensorflow.sampling`, :mod:`~dpledger.adapters.tensorflow.sampler_base`).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from dpledger.adapters.tensorflow.sampler_base import RecordedDatasetSampler
from dpledger.sampling.sampler_properties import scheme_property
from dpledger.sampling.schemes import (
    BatchScheme,
    FixedSizeScheme,
    PoissonScheme,
    TruncatedPoissonScheme,
)
from dpledger.sampling.validation import check_expected_batch_size, check_population_size

__all__ = ["FixedSizeDatasetSampler", "PoissonDatasetSampler", "TruncatedPoissonDatasetSampler"]


class _StepwiseDatasetSampler(RecordedDatasetSampler):
    """A sampler whose every step is an independent draw (Poisson, fixed size, truncated)."""

    _steps: int

    def __init__(
        self,
        scheme_type: type[BatchScheme],
        *,
        seed: int | None,
        steps_per_epoch: int | None,
        **parameters: Any,
    ) -> None:
        """Build the scheme of ``scheme_type`` from its ``parameters`` (its steps per pass
        named and rounded as the ``tf.data`` samplers do: ``steps_per_epoch``, halves up)."""
        scheme = scheme_type(
            steps=steps_per_epoch,
            steps_parameter="steps_per_epoch",
            round_half_up=True,
            **parameters,
        )
        super().__init__(population_size=scheme.population_size, seed=seed)
        self._scheme = scheme
        self._steps = scheme.steps_per_epoch

    def _indices(self, _step: tf.Tensor) -> tf.Tensor:
        raise NotImplementedError

    def index_dataset(self) -> tf.data.Dataset:
        """A dataset of ``steps_per_epoch`` int64 vectors: the record indices of each batch.

        Each vector is sorted and may be empty. Every iteration draws new batches.
        """
        return tf.data.Dataset.range(self._steps).map(self._indices)


class PoissonDatasetSampler(_StepwiseDatasetSampler):
    """Poisson sampling of n records with rate q, ``steps_per_epoch`` batches per iteration.

    Args:
        population_size: n, the number of records (≥ 1).
        sampling_probability: q ∈ (0, 1], the probability that a record is in a batch.
        steps_per_epoch: batches per iteration over a dataset made by :meth:`sample`; by
            default round(1/q) (halves up), so that an epoch sees each record once on average.
        seed: seed of the sampler's generator; None draws one from OS entropy (see
            :attr:`seed`).

    Raises:
        InvalidParameterError: for n < 1, q outside (0, 1], steps_per_epoch < 1 or a seed that
            is not a non-negative integer.

    Example:
        >>> sampler = PoissonDatasetSampler(population_size=1797, sampling_probability=256 / 1797,
        ...                          seed=0)
        >>> batches = sampler.sample((images, labels))  # doctest: +SKIP
        >>> model.fit(batches, epochs=10)  # doctest: +SKIP
    """

    _shown = ("population_size", "sampling_probability", "steps_per_epoch", "seed")

    def __init__(
        self,
        *,
        population_size: int,
        sampling_probability: float,
        steps_per_epoch: int | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__(
            PoissonScheme,
            seed=seed,
            steps_per_epoch=steps_per_epoch,
            population_size=population_size,
            sampling_probability=sampling_probability,
        )
        self._q = self.sampling_probability

    @classmethod
    def from_expected_batch_size(
        cls,
        *,
        population_size: int,
        expected_batch_size: float,
        steps_per_epoch: int | None = None,
        seed: int | None = None,
    ) -> PoissonDatasetSampler:
        """The sampler with q = expected_batch_size / population_size.

        Raises:
            InvalidParameterError: when expected_batch_size is not in (0, population_size].
        """
        n = check_population_size(population_size)
        size = check_expected_batch_size(expected_batch_size, population_size=n)
        return cls(
            population_size=n,
            sampling_probability=size / n,
            steps_per_epoch=steps_per_epoch,
            seed=seed,
        )

    sampling_probability = scheme_property(PoissonScheme.sampling_probability)

    expected_batch_size = scheme_property(PoissonScheme.expected_batch_size)

    def _indices(self, _step: tf.Tensor) -> tf.Tensor:
        seed = self._seed_pair()
        u = tf.random.stateless_uniform([self._n], seed=seed, dtype=tf.float64)
        return tf.where(u < self._q)[:, 0]


def _uniform_subset(indices: tf.Tensor, size: Any, seed: tf.Tensor) -> tf.Tensor:
    """A uniformly random subset of ``size`` of ``indices`` (the largest of iid uniform keys),
    sorted."""
    keys = tf.random.stateless_uniform(tf.shape(indices), seed=seed, dtype=tf.float64)
    chosen = tf.math.top_k(keys, k=size, sorted=False).indices
    return tf.sort(tf.gather(indices, chosen))


class FixedSizeDatasetSampler(_StepwiseDatasetSampler):
    """Each step, b distinct records drawn uniformly without replacement from the n records,
    independently of the other steps (``SamplingEvent.fixed_size(b, n)``).

    Recorded as fixed-size sampling, which dpledger analyses under replace-one neighbouring
    only: the ledger must be created with ``neighboring="replace_one"``. Gradients are averaged
    by b.

    Args:
        population_size: n ≥ 1.
        batch_size: b in [1, n].
        steps_per_epoch: batches per iteration; by default round(n/b) (halves up).
        seed: seed of the generator (None: OS entropy).

    Raises:
        InvalidParameterError: for a bad argument (naming it).
    """

    _shown = ("population_size", "batch_size", "steps_per_epoch", "seed")

    def __init__(
        self,
        *,
        population_size: int,
        batch_size: int,
        steps_per_epoch: int | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__(
            FixedSizeScheme,
            seed=seed,
            steps_per_epoch=steps_per_epoch,
            population_size=population_size,
            batch_size=batch_size,
        )
        self._b = self.batch_size

    batch_size = scheme_property(FixedSizeScheme.batch_size)

    def _indices(self, _step: tf.Tensor) -> tf.Tensor:
        return _uniform_subset(tf.range(self._n, dtype=tf.int64), self._b, self._seed_pair())


class TruncatedPoissonDatasetSampler(_StepwiseDatasetSampler):
    """Poisson sampling with rate q, each batch cut to ``max_batch_size`` records: when the
    Poisson draw has more, a uniformly random subset of ``max_batch_size`` of them is kept
    (``SamplingEvent.truncated_poisson(q, n, max_batch_size)``). Gradients are averaged by q·n.

    Args:
        population_size: n ≥ 1.
        sampling_probability: q in (0, 1].
        max_batch_size: the cap, in [1, n].
        steps_per_epoch: batches per iteration; by default round(1/q) (halves up).
        seed: seed of the generator (None: OS entropy).

    Raises:
        InvalidParameterError: for a bad argument (naming it).
    """

    _shown = (
        "population_size",
        "sampling_probability",
        "max_batch_size",
        "steps_per_epoch",
        "seed",
    )

    def __init__(
        self,
        *,
        population_size: int,
        sampling_probability: float,
        max_batch_size: int,
        steps_per_epoch: int | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__(
            TruncatedPoissonScheme,
            seed=seed,
            steps_per_epoch=steps_per_epoch,
            cap_within_population=True,
            population_size=population_size,
            sampling_probability=sampling_probability,
            max_batch_size=max_batch_size,
        )
        self._q = self.sampling_probability
        self._m = self.max_batch_size

    max_batch_size = scheme_property(TruncatedPoissonScheme.max_batch_size)

    def _indices(self, _step: tf.Tensor) -> tf.Tensor:
        seeds = self._generator.make_seeds(2)
        u = tf.random.stateless_uniform([self._n], seed=seeds[:, 0], dtype=tf.float64)
        drawn = tf.where(u < self._q)[:, 0]
        size = tf.minimum(tf.size(drawn), self._m)
        return _uniform_subset(drawn, size, seeds[:, 1])
