"""The base of the ``tf.data`` samplers: a population of n records, a seeded generator, the
datasets made by :meth:`RecordedDatasetSampler.sample` and the sampling event of each of their
batches (the schemes are listed in :mod:`~dpledger.adapters.tensorflow.sampling`).

Randomness: each draw takes a seed pair from a counter-based generator (``tf.random.Generator``,
Philox) seeded from ``seed``, and the scheme draws the record indices on the host in NumPy from it
(:mod:`~dpledger.sampling.index_draws`, the draws of the PyTorch samplers too), in a
``tf.numpy_function``. Every iteration over a dataset made by a sampler continues the generator's
stream, so epochs differ, and a new sampler with the same seed repeats the same sequence of
batches. Neither Philox nor NumPy's PCG64 is a cryptographically secure generator; seed from OS
entropy (``seed=None``) in deployment.
"""

from __future__ import annotations

import contextlib
import secrets
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from dpledger.errors import InvalidParameterError
from dpledger.ledger import SamplingEvent
from dpledger.sampling.index_draws import host_generator
from dpledger.sampling.schemes import BatchScheme
from dpledger.sampling.validation import check_population_size, check_step_position

__all__ = ["RecordedDatasetSampler"]


# Dataset transformations that pass every element through unchanged.
_RECORD_PRESERVING = frozenset({"_PrefetchDataset", "PrefetchDataset", "_OptionsDataset"})


def _check_seed(seed: Any) -> int:
    if seed is None:
        seed = secrets.randbits(63)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise InvalidParameterError("seed", seed, "a non-negative integer or None")
    return int(seed)


class RecordedDatasetSampler:
    """The base of the samplers: a population of n records, a seeded generator, the datasets
    made by :meth:`sample` and the sampling event of each of their batches.

    Subclasses set ``self._scheme`` (a :class:`~dpledger.sampling.schemes.BatchScheme`, from which
    the description of the scheme and its events follow) and define :meth:`index_dataset` (the
    record indices of each batch of one epoch); a subclass without a scheme also defines
    :attr:`sampling_event` and :attr:`steps_per_epoch`.
    """

    _scheme: BatchScheme | None = None
    #: The properties :meth:`__repr__` shows, in order.
    _shown: tuple[str, ...] = ("population_size", "seed")

    def __init__(self, *, population_size: int, seed: int | None) -> None:
        self._n = check_population_size(population_size)
        self._seeding = "os_entropy" if seed is None else "caller_seed"
        self._seed = _check_seed(seed)
        self._generator = tf.random.Generator.from_seed(self._seed)
        self._datasets: weakref.WeakSet[tf.data.Dataset] = weakref.WeakSet()

    # ------------------------------------------------------------------ description
    @property
    def scheme(self) -> BatchScheme | None:
        """The framework-neutral description of the sampler's scheme (parameters, q,
        denominator, epoch layout, events; :mod:`dpledger.sampling`)."""
        return self._scheme

    @property
    def population_size(self) -> int:
        """n, the number of records sampled from."""
        return self._n

    @property
    def steps_per_epoch(self) -> int:
        """Batches per iteration over a dataset made by :meth:`sample`."""
        if self._scheme is None:
            raise NotImplementedError
        return self._scheme.steps_per_epoch

    @property
    def seeding(self) -> str:
        """How the generator was seeded: ``"os_entropy"`` or ``"caller_seed"``
        (:data:`~dpledger.ledger.provenance.SEEDINGS`)."""
        return self._seeding

    @property
    def seed(self) -> int:
        """The seed of the sampler's generator (drawn from OS entropy when none was given)."""
        return self._seed

    @property
    def epoch_based(self) -> bool:
        """True when an epoch's batches are drawn together (balls-in-bins, shuffle)."""
        return self._scheme is not None and self._scheme.epoch_based

    @property
    def sampling_event(self) -> SamplingEvent:
        """The sampling event of every batch (``epoch_start=False``; see :meth:`event_for_step`)."""
        if self._scheme is None:
            raise NotImplementedError
        return self._scheme.event()

    @property
    def sampling_probability(self) -> float:
        """q recorded with each step: the Poisson rate, or b/n, or 1/k (see
        :attr:`~dpledger.ledger.SamplingEvent.sampling_probability`)."""
        return self.sampling_event.sampling_probability

    def event_for_step(self, step: int) -> SamplingEvent:
        """The sampling event of the batch at position ``step`` (0-based) of an iteration over a
        dataset made by :meth:`sample`.

        Every iteration draws a new epoch and yields exactly :attr:`steps_per_epoch` batches,
        so the event follows from the position alone
        (:meth:`~dpledger.sampling.BatchScheme.event_for_step`): for the epoch-based schemes,
        batch 0 of an iteration has ``epoch_start=True`` and the others False; for the other
        schemes every batch has the same event.

        Raises:
            InvalidParameterError: ``step`` is not an integer in [0, steps_per_epoch).
        """
        if self._scheme is not None:
            return self._scheme.event_for_step(step)
        check_step_position(step, steps_per_epoch=self.steps_per_epoch)
        return self.sampling_event

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._shown)
        return f"{type(self).__name__}({shown})"

    @contextlib.contextmanager
    def preserved_state(self) -> Iterator[None]:
        """Inside this block, draws (e.g. peeking at a batch) do not advance the sampler: its
        generator is restored on exit, so training sees the same batches as without them."""
        saved = tf.identity(self._generator.state)
        try:
            yield
        finally:
            self._generator.reset(saved)

    # ------------------------------------------------------------------ batches
    def index_dataset(self) -> tf.data.Dataset:
        """A dataset of ``steps_per_epoch`` sorted int64 vectors: the record indices of each
        batch (possibly empty). Every iteration draws new batches."""
        raise NotImplementedError

    def _seed_pair(self) -> tf.Tensor:
        return self._generator.make_seeds(1)[:, 0]

    def _host_draw(self, seed: tf.Tensor) -> tf.Tensor:
        """The scheme's batch drawn from ``seed`` (:meth:`~dpledger.sampling.BatchScheme.draw`),
        as an int64 vector."""
        scheme = self._scheme
        assert scheme is not None

        def draw(words: np.ndarray) -> np.ndarray:
            return scheme.draw(host_generator(words))

        out = tf.numpy_function(draw, [seed], tf.int64, stateful=False)
        out.set_shape([None])
        return out

    def _host_epoch(self, seed: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """The scheme's epoch drawn from ``seed`` (:meth:`~dpledger.sampling.schemes.BatchScheme.
        draw_epoch`): its records in batch order and the batch boundaries."""
        scheme = self._scheme
        assert scheme is not None

        def draw(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            batches = scheme.draw_epoch(host_generator(words))
            sizes = np.array([b.size for b in batches], dtype=np.int64)
            return np.concatenate(batches), np.concatenate([[0], np.cumsum(sizes)])

        order, bounds = tf.numpy_function(draw, [seed], [tf.int64, tf.int64], stateful=False)
        order.set_shape([None])
        bounds.set_shape([None])
        return order, bounds

    def sample(self, data: Any) -> tf.data.Dataset:
        """A dataset of ``steps_per_epoch`` batches of ``data`` drawn by this sampler.

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
        # flat_map hides the number of batches, which Keras needs to know where an epoch ends
        if int(dataset.cardinality()) != self.steps_per_epoch:
            dataset = dataset.apply(tf.data.experimental.assert_cardinality(self.steps_per_epoch))
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
