"""Samplers of records for ``tf.data``: Poisson, fixed-size, truncated Poisson, balls-in-bins
and shuffled batches.

Each sampler is a transformation of a population of n records into a dataset of batches
(:meth:`RecordedDatasetSampler.sample`), and says which :class:`~dpledger.ledger.SamplingEvent` each
of those batches is (:meth:`RecordedDatasetSampler.event_for_step`), so that the training step that
consumes a batch records exactly the scheme that drew it (docs/architecture.md, "Soundness rules",
rule 6). The samplers do not write to a ledger themselves. What a scheme is (its checked parameters,
q, denominator, epoch layout and events) is described without TensorFlow by the sampler's
:attr:`RecordedDatasetSampler.scheme` (:mod:`dpledger.sampling`), which also draws the record
indices on the host in NumPy (:meth:`~dpledger.sampling.BatchScheme.draw`,
:meth:`~dpledger.sampling.BatchScheme.draw_epoch`: the draws of the PyTorch batch samplers, written
once). The samplers here seed each draw from their ``tf.random.Generator``, run it in a
``tf.numpy_function`` and turn the indices into ``tf.data`` batches.

The schemes (one iteration over a sampler's dataset is one *epoch* of ``steps_per_epoch``
batches):

* :class:`PoissonDatasetSampler`: each step, each record is in the batch independently with
  probability q (McMahan & Andrew, Sec. 2). Batch sizes are Binomial(n, q), possibly 0.
* :class:`FixedSizeDatasetSampler`: each step, b distinct records drawn uniformly without
  replacement, independently of the other steps.
* :class:`TruncatedPoissonDatasetSampler`: a Poisson draw of rate q, cut to a uniformly random
  subset of ``max_batch_size`` records when it is larger.
* :class:`BallsInBinsDatasetSampler`: at the start of each epoch every record is put in one of k
  batches uniformly at random, independently; the epoch's steps are the k batches in order.
* :class:`ShuffleDatasetSampler`: at the start of each epoch a uniformly random permutation of
  the n records is cut into consecutive batches of b (the last one smaller unless ``drop_last``).
* :class:`CyclicDatasetSampler`: the records split once into ``period`` fixed groups visited in
  turn, whole or Poisson-sampled (:class:`~dpledger.sampling.CyclicScheme`): the batches of a
  correlated-noise release (``DPKerasModel(noise=spec)``), which records no per-step event.

The events of the epoch-based schemes (balls-in-bins, shuffle) carry ``epoch_start=True`` on the
first batch of each iteration: that step's draw made the epoch's allocation or permutation.

The base, its datasets and the randomness are in :mod:`~dpledger.adapters.tensorflow.sampler_base`;
the cyclic sampler is in :mod:`~dpledger.adapters.tensorflow.cyclic_sampler`.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from dpledger.adapters.tensorflow.sampler_base import RecordedDatasetSampler
from dpledger.sampling.sampler_properties import scheme_property
from dpledger.sampling.schemes import (
    BallsInBinsScheme,
    BatchScheme,
    FixedSizeScheme,
    PoissonScheme,
    ShuffleScheme,
    TruncatedPoissonScheme,
)
from dpledger.sampling.validation import check_expected_batch_size, check_population_size

__all__ = [
    "BallsInBinsDatasetSampler",
    "FixedSizeDatasetSampler",
    "PoissonDatasetSampler",
    "ShuffleDatasetSampler",
    "TruncatedPoissonDatasetSampler",
]


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

    def index_dataset(self) -> tf.data.Dataset:
        """A dataset of ``steps_per_epoch`` int64 vectors: the record indices of each batch
        (the scheme's :meth:`~dpledger.sampling.BatchScheme.draw`).

        Each vector is sorted and may be empty. Every iteration draws new batches.
        """

        def indices(_step: tf.Tensor) -> tf.Tensor:
            return self._host_draw(self._seed_pair())

        return tf.data.Dataset.range(self._steps).map(indices)


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

    batch_size = scheme_property(FixedSizeScheme.batch_size)


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

    max_batch_size = scheme_property(TruncatedPoissonScheme.max_batch_size)


class _EpochDatasetSampler(RecordedDatasetSampler):
    """A sampler that draws an epoch's batches together, at the start of each iteration."""

    def __init__(self, scheme: BatchScheme, *, seed: int | None) -> None:
        super().__init__(population_size=scheme.population_size, seed=seed)
        self._scheme = scheme

    @property
    def epoch_based(self) -> bool:
        """True: the first batch of each iteration is recorded with ``epoch_start=True``."""
        return True

    def index_dataset(self) -> tf.data.Dataset:
        """A dataset of ``steps_per_epoch`` sorted int64 vectors: the record indices of each
        batch of one epoch (the scheme's :meth:`~dpledger.sampling.BatchScheme.draw_epoch`), in
        order. Every iteration draws a new epoch."""
        steps = self.steps_per_epoch

        def epoch(_: tf.Tensor) -> tf.data.Dataset:
            order, bounds = self._host_epoch(self._seed_pair())
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

    num_batches = scheme_property(BallsInBinsScheme.num_batches)


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

    batch_size = scheme_property(ShuffleScheme.batch_size)

    drop_last = scheme_property(ShuffleScheme.drop_last)
