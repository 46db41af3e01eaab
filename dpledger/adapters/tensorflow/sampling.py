"""Poisson sampling of records for ``tf.data``.

Each step, each of the n records of the population is included in the batch independently with
probability q (McMahan & Andrew, Sec. 2: the *sample* of a round). Batch sizes are therefore
Binomial(n, q) — they vary from step to step and can be 0 — and the privacy amplification by
sampling that accountants credit for rate q holds. A fixed-size shuffled batch does not give
that guarantee; q must come from the sampler actually used (DESIGN.md, rule 6).

The sampler does not write to a ledger: the training step that consumes a batch records the
sampling event with :attr:`PoissonSampler.population_size` and
:attr:`PoissonSampler.sampling_probability`.

Randomness: each step draws n float64 uniforms u_j from a counter-based generator
(``tf.random.Generator``, Philox) and keeps the records with u_j < q, so
P(record j in the batch) = q up to 2⁻⁵³. The generator is seeded from ``seed``; every iteration
over a dataset made by the sampler continues the generator's stream, so epochs differ, and a new
sampler with the same seed repeats the same sequence of batches. Note that Philox is not a
cryptographically secure generator; seed from OS entropy (``seed=None``) in deployment.
"""

from __future__ import annotations

import contextlib
import math
import secrets
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from dpledger.errors import InvalidParameterError
from dpledger.validation import check_positive_finite, check_positive_int, check_probability

__all__ = ["PoissonSampler"]


# Dataset transformations that pass every element through unchanged.
_RECORD_PRESERVING = frozenset({"_PrefetchDataset", "PrefetchDataset", "_OptionsDataset"})


class PoissonSampler:
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
        >>> sampler = PoissonSampler(population_size=1797, sampling_probability=256 / 1797,
        ...                          seed=0)
        >>> batches = sampler.sample((images, labels))  # doctest: +SKIP
        >>> model.fit(batches, epochs=10)  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        population_size: int,
        sampling_probability: float,
        steps_per_epoch: int | None = None,
        seed: int | None = None,
    ) -> None:
        self._n = check_positive_int("population_size", population_size)
        q = check_probability("sampling_probability", sampling_probability)
        if q == 0.0:
            raise InvalidParameterError(
                "sampling_probability", sampling_probability, "a probability in (0, 1]"
            )
        self._q = q
        if steps_per_epoch is None:
            steps_per_epoch = max(1, math.floor(1.0 / q + 0.5))
        self._steps = check_positive_int("steps_per_epoch", steps_per_epoch)
        if seed is None:
            seed = secrets.randbits(63)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise InvalidParameterError("seed", seed, "a non-negative integer or None")
        self._seed = int(seed)
        self._generator = tf.random.Generator.from_seed(self._seed)
        self._datasets: weakref.WeakSet[tf.data.Dataset] = weakref.WeakSet()

    @classmethod
    def from_expected_batch_size(
        cls,
        *,
        population_size: int,
        expected_batch_size: float,
        steps_per_epoch: int | None = None,
        seed: int | None = None,
    ) -> PoissonSampler:
        """The sampler with q = expected_batch_size / population_size.

        Raises:
            InvalidParameterError: when expected_batch_size is not in (0, population_size].
        """
        n = check_positive_int("population_size", population_size)
        size = check_positive_finite("expected_batch_size", expected_batch_size)
        if size > n:
            raise InvalidParameterError(
                "expected_batch_size", expected_batch_size, f"a number in (0, {n}]"
            )
        return cls(
            population_size=n,
            sampling_probability=size / n,
            steps_per_epoch=steps_per_epoch,
            seed=seed,
        )

    @property
    def population_size(self) -> int:
        """n, the number of records sampled from."""
        return self._n

    @property
    def sampling_probability(self) -> float:
        """q, the probability that a given record is in a given batch."""
        return self._q

    @property
    def steps_per_epoch(self) -> int:
        """Batches per iteration over a dataset made by :meth:`sample`."""
        return self._steps

    @property
    def expected_batch_size(self) -> float:
        """q·n."""
        return self._q * self._n

    @property
    def seed(self) -> int:
        """The seed of the sampler's generator (drawn from OS entropy when none was given)."""
        return self._seed

    def __repr__(self) -> str:
        return (
            f"PoissonSampler(population_size={self._n}, sampling_probability={self._q!r}, "
            f"steps_per_epoch={self._steps}, seed={self._seed})"
        )

    @contextlib.contextmanager
    def preserved_state(self) -> Iterator[None]:
        """Inside this block, draws (e.g. peeking at a batch) do not advance the sampler: its
        generator is restored on exit, so training sees the same batches as without them."""
        saved = tf.identity(self._generator.state)
        try:
            yield
        finally:
            self._generator.reset(saved)

    def _indices(self, _step: tf.Tensor) -> tf.Tensor:
        seed = self._generator.make_seeds(1)[:, 0]
        u = tf.random.stateless_uniform([self._n], seed=seed, dtype=tf.float64)
        return tf.where(u < self._q)[:, 0]

    def index_dataset(self) -> tf.data.Dataset:
        """A dataset of ``steps_per_epoch`` int64 vectors: the record indices of each batch.

        Each vector is sorted and may be empty. Every iteration draws new batches.
        """
        return tf.data.Dataset.range(self._steps).map(self._indices)

    def sample(self, data: Any) -> tf.data.Dataset:
        """A dataset of ``steps_per_epoch`` Poisson-sampled batches of ``data``.

        Args:
            data: the population, either a structure (tuple, dict…) of arrays or tensors whose
                leading axis has length n (gathered per step, fast), or a ``tf.data.Dataset`` of
                n elements (read in full every step, keeping the sampled ones: correct for any
                dataset, but O(n) reads per step).

        Returns:
            Batches with the structure of ``data`` and a leading batch axis of varying length;
            an empty batch keeps the shapes of the other axes.

        Raises:
            InvalidParameterError: when a leading axis (or a known dataset cardinality) is not n.
        """
        if isinstance(data, tf.data.Dataset):
            return self._made(self._sample_dataset(data))
        tensors = tf.nest.map_structure(tf.convert_to_tensor, data)
        for t in tf.nest.flatten(tensors):
            if t.shape.rank == 0 or (t.shape[0] is not None and t.shape[0] != self._n):
                raise InvalidParameterError(
                    "data",
                    f"an array of shape {t.shape.as_list()}",
                    f"arrays whose leading axis has population_size={self._n} records",
                )
        return self._made(
            self.index_dataset().map(
                lambda idx: tf.nest.map_structure(lambda t: tf.gather(t, idx), tensors)
            )
        )

    def _made(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        self._datasets.add(dataset)
        return dataset

    def drew(self, dataset: Any) -> bool:
        """Whether ``dataset`` yields exactly this sampler's batches: a dataset made by
        :meth:`sample`, possibly behind ``prefetch`` or ``with_options`` (which keep every record
        of every batch). Any other transformation (``shuffle``, ``batch``, ``unbatch``,
        ``filter``, ``map``, ``take``, ``cache``, …) may change which records a step sees, so a
        dataset built with one is not this sampler's draw."""
        while isinstance(dataset, tf.data.Dataset):
            if dataset in self._datasets:
                return True
            if type(dataset).__name__ not in _RECORD_PRESERVING:
                return False
            inputs = dataset._inputs()  # the public API has no way to walk a pipeline
            if len(inputs) != 1:
                return False
            dataset = inputs[0]
        return False

    def _sample_dataset(self, data: tf.data.Dataset) -> tf.data.Dataset:
        cardinality = int(data.cardinality())
        if cardinality >= 0 and cardinality != self._n:
            raise InvalidParameterError(
                "data",
                f"a dataset of {cardinality} elements",
                f"a dataset of population_size={self._n} elements",
            )
        n = self._n

        def empty(spec: tf.TensorSpec) -> tf.Tensor:
            dims = [0] + [0 if d is None else d for d in spec.shape.as_list()]
            return tf.zeros(dims, spec.dtype)

        empty_batch = tf.nest.map_structure(empty, data.element_spec)

        def batch_of(indices: tf.Tensor) -> tf.data.Dataset:
            mask = tf.scatter_nd(
                tf.expand_dims(indices, 1), tf.ones_like(indices, tf.bool), [tf.cast(n, tf.int64)]
            )
            kept = data.enumerate().filter(lambda i, _: tf.gather(mask, i)).map(lambda _, x: x)
            return kept.batch(n).concatenate(tf.data.Dataset.from_tensors(empty_batch)).take(1)

        return self.index_dataset().flat_map(batch_of)
