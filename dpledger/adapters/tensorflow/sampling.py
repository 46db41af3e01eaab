"""Samplers of records for ``tf.data``: Poisson, fixed-size, truncated Poisson, balls-in-bins
and shuffled batches.

Each sampler is a transformation of a population of n records into a dataset of batches
(:meth:`RecordSampler.sample`), and says which :class:`~dpledger.ledger.SamplingEvent` each of
those batches is (:meth:`RecordSampler.event_for_step`), so that the training step that consumes
a batch records exactly the scheme that drew it (docs/architecture.md, "Soundness rules",
rule 6). The samplers do not write to a ledger themselves. What a scheme is (its checked
parameters, q, denominator, epoch layout and events) is described without TensorFlow by the
sampler's :attr:`RecordSampler.scheme` (:mod:`dpledger.sampling`); the samplers here only draw
the index batches.

The schemes (one iteration over a sampler's dataset is one *epoch* of ``steps_per_epoch``
batches):

* :class:`PoissonSampler`: each step, each record is in the batch independently with
  probability q (McMahan & Andrew, Sec. 2). Batch sizes are Binomial(n, q), possibly 0.
* :class:`FixedSizeSampler`: each step, b distinct records drawn uniformly without replacement,
  independently of the other steps.
* :class:`TruncatedPoissonSampler`: a Poisson draw of rate q, cut to a uniformly random subset
  of ``max_batch_size`` records when it is larger.
* :class:`BallsInBinsSampler`: at the start of each epoch every record is put in one of k
  batches uniformly at random, independently; the epoch's steps are the k batches in order.
* :class:`ShuffleSampler`: at the start of each epoch a uniformly random permutation of the n
  records is cut into consecutive batches of b (the last one smaller unless ``drop_last``).

The events of the epoch-based schemes (balls-in-bins, shuffle) carry ``epoch_start=True`` on the
first batch of each iteration: that step's draw made the epoch's allocation or permutation.

Randomness: the draws come from a counter-based generator (``tf.random.Generator``, Philox)
seeded from ``seed``: a Poisson inclusion is u_j < q for a float64 uniform u_j (exact up to
2⁻⁵³), a uniform subset is the records with the largest float64 keys, a permutation sorts by
them and a balls-in-bins allocation draws uniform integers. Every iteration over a dataset made by
a sampler continues the generator's stream, so epochs differ, and a new sampler with the same
seed repeats the same sequence of batches. Philox is not a cryptographically secure generator;
seed from OS entropy (``seed=None``) in deployment.
"""

from __future__ import annotations

import contextlib
import secrets
import weakref
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import tensorflow as tf

from dpledger.errors import InvalidParameterError
from dpledger.ledger import SamplingEvent
from dpledger.sampling import (
    BallsInBinsScheme,
    BatchScheme,
    FixedSizeScheme,
    PoissonScheme,
    ShuffleScheme,
    TruncatedPoissonScheme,
)
from dpledger.sampling.validation import (
    check_expected_batch_size,
    check_population_size,
    check_step_position,
)

__all__ = [
    "BallsInBinsSampler",
    "FixedSizeSampler",
    "PoissonSampler",
    "RecordSampler",
    "ShuffleSampler",
    "TruncatedPoissonSampler",
]


# Dataset transformations that pass every element through unchanged.
_RECORD_PRESERVING = frozenset({"_PrefetchDataset", "PrefetchDataset", "_OptionsDataset"})


def _check_seed(seed: Any) -> int:
    if seed is None:
        seed = secrets.randbits(63)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise InvalidParameterError("seed", seed, "a non-negative integer or None")
    return int(seed)


class RecordSampler:
    """The base of the samplers: a population of n records, a seeded generator, the datasets
    made by :meth:`sample` and the sampling event of each of their batches.

    Subclasses set ``self._scheme`` (a :class:`~dpledger.sampling.BatchScheme`, from which the
    description of the scheme and its events follow) and define :meth:`index_dataset` (the
    record indices of each batch of one epoch); a subclass without a scheme also defines
    :attr:`sampling_event` and :attr:`steps_per_epoch`.
    """

    _scheme: BatchScheme | None = None

    def __init__(self, *, population_size: int, seed: int | None) -> None:
        self._n = check_population_size(population_size)
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
        so the event follows from the position alone: for the epoch-based schemes, batch 0 of an
        iteration has ``epoch_start=True`` and the others False; for the other schemes every
        batch has the same event.

        Raises:
            InvalidParameterError: ``step`` is not an integer in [0, steps_per_epoch).
        """
        check_step_position(step, steps_per_epoch=self.steps_per_epoch)
        event = self.sampling_event
        if self.epoch_based and step == 0:
            return attrs.evolve(event, epoch_start=True)
        return event

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


class _StepwiseSampler(RecordSampler):
    """A sampler whose every step is an independent draw (Poisson, fixed size, truncated)."""

    _steps: int

    def _use_scheme(self, scheme: BatchScheme) -> None:
        self._scheme = scheme
        self._steps = scheme.steps_per_epoch

    def _indices(self, _step: tf.Tensor) -> tf.Tensor:
        raise NotImplementedError

    def index_dataset(self) -> tf.data.Dataset:
        """A dataset of ``steps_per_epoch`` int64 vectors: the record indices of each batch.

        Each vector is sorted and may be empty. Every iteration draws new batches.
        """
        return tf.data.Dataset.range(self._steps).map(self._indices)


class PoissonSampler(_StepwiseSampler):
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
        scheme = PoissonScheme(
            population_size=population_size,
            sampling_probability=sampling_probability,
            steps=steps_per_epoch,
            steps_parameter="steps_per_epoch",
            round_half_up=True,
        )
        super().__init__(population_size=scheme.population_size, seed=seed)
        self._use_scheme(scheme)
        self._q = scheme.sampling_probability

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
        n = check_population_size(population_size)
        size = check_expected_batch_size(expected_batch_size, population_size=n)
        return cls(
            population_size=n,
            sampling_probability=size / n,
            steps_per_epoch=steps_per_epoch,
            seed=seed,
        )

    @property
    def sampling_probability(self) -> float:
        """q, the probability that a given record is in a given batch."""
        return self._q

    @property
    def expected_batch_size(self) -> float:
        """q·n."""
        return self._q * self._n

    def __repr__(self) -> str:
        return (
            f"PoissonSampler(population_size={self._n}, sampling_probability={self._q!r}, "
            f"steps_per_epoch={self._steps}, seed={self._seed})"
        )

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


class FixedSizeSampler(_StepwiseSampler):
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

    def __init__(
        self,
        *,
        population_size: int,
        batch_size: int,
        steps_per_epoch: int | None = None,
        seed: int | None = None,
    ) -> None:
        scheme = FixedSizeScheme(
            population_size=population_size,
            batch_size=batch_size,
            steps=steps_per_epoch,
            steps_parameter="steps_per_epoch",
            round_half_up=True,
        )
        super().__init__(population_size=scheme.population_size, seed=seed)
        self._use_scheme(scheme)
        self._b = scheme.batch_size

    @property
    def batch_size(self) -> int:
        """b, the number of records in every batch."""
        return self._b

    def __repr__(self) -> str:
        return (
            f"FixedSizeSampler(population_size={self._n}, batch_size={self._b}, "
            f"steps_per_epoch={self._steps}, seed={self._seed})"
        )

    def _indices(self, _step: tf.Tensor) -> tf.Tensor:
        return _uniform_subset(tf.range(self._n, dtype=tf.int64), self._b, self._seed_pair())


class TruncatedPoissonSampler(_StepwiseSampler):
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

    def __init__(
        self,
        *,
        population_size: int,
        sampling_probability: float,
        max_batch_size: int,
        steps_per_epoch: int | None = None,
        seed: int | None = None,
    ) -> None:
        scheme = TruncatedPoissonScheme(
            population_size=population_size,
            sampling_probability=sampling_probability,
            max_batch_size=max_batch_size,
            steps=steps_per_epoch,
            steps_parameter="steps_per_epoch",
            round_half_up=True,
            cap_within_population=True,
        )
        super().__init__(population_size=scheme.population_size, seed=seed)
        self._use_scheme(scheme)
        self._q = scheme.sampling_probability
        self._m = scheme.max_batch_size

    @property
    def max_batch_size(self) -> int:
        """The cap on a batch's size."""
        return self._m

    def __repr__(self) -> str:
        return (
            f"TruncatedPoissonSampler(population_size={self._n}, "
            f"sampling_probability={self._q!r}, max_batch_size={self._m}, "
            f"steps_per_epoch={self._steps}, seed={self._seed})"
        )

    def _indices(self, _step: tf.Tensor) -> tf.Tensor:
        seeds = self._generator.make_seeds(2)
        u = tf.random.stateless_uniform([self._n], seed=seeds[:, 0], dtype=tf.float64)
        drawn = tf.where(u < self._q)[:, 0]
        size = tf.minimum(tf.size(drawn), self._m)
        return _uniform_subset(drawn, size, seeds[:, 1])


class _EpochSampler(RecordSampler):
    """A sampler that draws an epoch's batches together, at the start of each iteration."""

    @property
    def epoch_based(self) -> bool:
        """True: the first batch of each iteration is recorded with ``epoch_start=True``."""
        return True

    def _epoch(self, seed: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """The epoch's records in batch order and the k + 1 batch boundaries."""
        raise NotImplementedError

    def index_dataset(self) -> tf.data.Dataset:
        """A dataset of ``steps_per_epoch`` sorted int64 vectors: the record indices of each
        batch of one epoch, in order. Every iteration draws a new epoch."""
        steps = self.steps_per_epoch

        def epoch(_: tf.Tensor) -> tf.data.Dataset:
            order, bounds = self._epoch(self._seed_pair())
            return tf.data.Dataset.range(steps).map(
                lambda j: tf.sort(order[bounds[j] : bounds[j + 1]])
            )

        return tf.data.Dataset.range(1).flat_map(epoch)


class BallsInBinsSampler(_EpochSampler):
    """Balls-in-bins batches: at the start of each epoch every record is put in one of k
    batches uniformly at random, independently of the others; the epoch's k steps are the
    batches in order (``SamplingEvent.balls_in_bins(k, n)``, ``epoch_start`` on the first).
    Batch sizes are Binomial(n, 1/k) and vary; gradients are averaged by n/k.

    Args:
        population_size: n ≥ 1.
        num_batches: k in [1, n], the batches (steps) per epoch.
        seed: seed of the generator (None: OS entropy).

    Raises:
        InvalidParameterError: for a bad argument (naming it).
    """

    def __init__(self, *, population_size: int, num_batches: int, seed: int | None = None) -> None:
        scheme = BallsInBinsScheme(population_size=population_size, num_batches=num_batches)
        super().__init__(population_size=scheme.population_size, seed=seed)
        self._scheme = scheme
        self._k = scheme.num_batches

    @property
    def num_batches(self) -> int:
        """k, the batches per epoch."""
        return self._k

    def __repr__(self) -> str:
        return (
            f"BallsInBinsSampler(population_size={self._n}, num_batches={self._k}, "
            f"seed={self._seed})"
        )

    def _epoch(self, seed: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        bins = tf.random.stateless_uniform(
            [self._n], seed=seed, minval=0, maxval=self._k, dtype=tf.int64
        )
        order = tf.argsort(bins, stable=True)
        counts = tf.math.bincount(
            tf.cast(bins, tf.int32), minlength=self._k, maxlength=self._k, dtype=tf.int64
        )
        bounds = tf.concat([tf.zeros([1], tf.int64), tf.cumsum(counts)], 0)
        return tf.cast(order, tf.int64), bounds


class ShuffleSampler(_EpochSampler):
    """Shuffled batches: at the start of each epoch a uniformly random permutation of the n
    records is cut into consecutive batches of b, the last one smaller when b does not divide n.
    ``drop_last=True`` is accepted only when b divides n (it then changes nothing): leaving the
    remainder out of every epoch is not the ``shuffle(b, n)`` the ledger records, and the lower
    bound ``dpledger epsilon`` shows for shuffled runs does not hold for it. Recorded as
    ``SamplingEvent.shuffle(b, n)`` with ``epoch_start`` on each epoch's first batch; gradients
    are averaged by b.

    This is what ``dataset.shuffle(n).batch(b)`` does, made the sampler's own draw so that the
    ledger records it truthfully. dpledger analyses shuffled batches under replace-one
    neighbouring only (the ledger must be created with ``neighboring="replace_one"``) and without
    amplification by sampling.

    Args:
        population_size: n ≥ 1.
        batch_size: b in [1, n].
        drop_last: drop the last, smaller batch of each epoch; only when b divides n.
        seed: seed of the generator (None: OS entropy).

    Raises:
        InvalidParameterError: for a bad argument (naming it).
    """

    def __init__(
        self,
        *,
        population_size: int,
        batch_size: int,
        drop_last: bool = False,
        seed: int | None = None,
    ) -> None:
        scheme = ShuffleScheme(
            population_size=population_size, batch_size=batch_size, drop_last=drop_last
        )
        super().__init__(population_size=scheme.population_size, seed=seed)
        self._scheme = scheme
        self._b = scheme.batch_size
        self._drop_last = scheme.drop_last

    @property
    def batch_size(self) -> int:
        """b, the size of every batch (but a smaller last one without ``drop_last``)."""
        return self._b

    @property
    def drop_last(self) -> bool:
        """Whether the last, smaller batch of each epoch is dropped."""
        return self._drop_last

    def __repr__(self) -> str:
        return (
            f"ShuffleSampler(population_size={self._n}, batch_size={self._b}, "
            f"drop_last={self._drop_last}, seed={self._seed})"
        )

    def _epoch(self, seed: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        keys = tf.random.stateless_uniform([self._n], seed=seed, dtype=tf.float64)
        order = tf.cast(tf.argsort(keys), tf.int64)
        ends = [min((j + 1) * self._b, self._n) for j in range(self.steps_per_epoch)]
        bounds = tf.constant([0, *ends], tf.int64)
        return order, bounds
