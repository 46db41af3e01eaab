"""The ``tf.data`` samplers that draw an epoch's batches together: balls-in-bins and shuffled
batches (the schemes and their randomness: :mod:`~dpledger.adapters.tensorflow.sampling`,
:mod:`~dpledger.adapters.tensorflow.sampler_base`).
"""

from __future__ import annotations

import tensorflow as tf

from dpledger.adapters.tensorflow.sampler_base import RecordedDatasetSampler
from dpledger.sampling.sampler_properties import scheme_property
from dpledger.sampling.schemes import BallsInBinsScheme, BatchScheme, ShuffleScheme

__all__ = ["BallsInBinsDatasetSampler", "ShuffleDatasetSampler"]


class _EpochDatasetSampler(RecordedDatasetSampler):
    """A sampler that draws an epoch's batches together, at the start of each iteration."""

    def __init__(self, scheme: BatchScheme, *, seed: int | None) -> None:
        super().__init__(population_size=scheme.population_size, seed=seed)
        self._scheme = scheme

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


class BallsInBinsDatasetSampler(_EpochDatasetSampler):
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

    _shown = ("population_size", "num_batches", "seed")

    def __init__(self, *, population_size: int, num_batches: int, seed: int | None = None) -> None:
        scheme = BallsInBinsScheme(population_size=population_size, num_batches=num_batches)
        super().__init__(scheme, seed=seed)
        self._k = scheme.num_batches

    num_batches = scheme_property(BallsInBinsScheme.num_batches)

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


class ShuffleDatasetSampler(_EpochDatasetSampler):
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

    _shown = ("population_size", "batch_size", "drop_last", "seed")

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
        super().__init__(scheme, seed=seed)
        self._b = scheme.batch_size

    batch_size = scheme_property(ShuffleScheme.batch_size)

    drop_last = scheme_property(ShuffleScheme.drop_last)

    def _epoch(self, seed: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        keys = tf.random.stateless_uniform([self._n], seed=seed, dtype=tf.float64)
        order = tf.cast(tf.argsort(keys), tf.int64)
        ends = [min((j + 1) * self._b, self._n) for j in range(self.steps_per_epoch)]
        bounds = tf.constant([0, *ends], tf.int64)
        return order, bounds
