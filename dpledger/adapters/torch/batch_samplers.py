"""Batch samplers of the sampling schemes other than Poisson, each recording its own event.

Each sampler draws index batches from its ``torch.Generator`` and, when a DP step claims one of
its draws (:meth:`~dpledger.adapters.torch.sampler_base.RecordedBatchSampler.claim_draw`), says
which :class:`~dpledger.ledger.SamplingEvent` the step records; the step's average divides by
that event's ``average_denominator``. The schemes and what can analyse them:

======================================  ===============================  =====================
sampler                                 event (denominator)              neighbouring relation
======================================  ===============================  =====================
:class:`FixedSizeBatchSampler`          ``fixed_size(b, n)`` (b)         replace-one only
:class:`TruncatedPoissonBatchSampler`   ``truncated_poisson(q, n, m)``   see ``SCHEME_RELATIONS``
                                        (q·n)
:class:`BallsInBinsBatchSampler`        ``balls_in_bins(k, n)`` (n / k)  add/remove, replace-one
:class:`ShuffleBatchSampler`            ``shuffle(b, n)`` (b)            replace-one only
======================================  ===============================  =====================

Which accountant certifies a scheme is the accountant's business: an accountant without a valid
analysis of a scheme refuses the ledger with
:class:`~dpledger.errors.UnsupportedSamplingError` (see :mod:`dpledger.accountants`); the
:class:`~dpledger.adapters.torch.optimizer.DPOptimizer` refuses, at construction, a ledger whose
neighbouring relation the scheme is not analysed under
(:attr:`~dpledger.ledger.SamplingEvent.relations`).

These samplers draw for one process. Under ``torch.distributed`` only
:class:`~dpledger.adapters.torch.distributed.DistributedPoissonBatchSampler` splits one global
sample over the ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data._utils.collate import default_collate

from dpledger.adapters.torch.poisson import EmptyBatchCollate
from dpledger.adapters.torch.sampler_base import (
    EpochBatchSampler,
    RecordedBatchSampler,
    StepwiseBatchSampler,
)
from dpledger.errors import InvalidParameterError
from dpledger.ledger import SamplingEvent
from dpledger.sampling import (
    BallsInBinsScheme,
    FixedSizeScheme,
    ShuffleScheme,
    TruncatedPoissonScheme,
)
from dpledger.sampling.sampler_properties import scheme_property

__all__ = [
    "BallsInBinsBatchSampler",
    "FixedSizeBatchSampler",
    "ShuffleBatchSampler",
    "TruncatedPoissonBatchSampler",
    "private_data_loader",
]


def _sorted_list(indices: torch.Tensor) -> list[int]:
    return indices.sort().values.tolist()


class FixedSizeBatchSampler(StepwiseBatchSampler):
    """Each step, a uniformly random subset of exactly b of the n records (without replacement).

    Batches are drawn independently per step (``torch.randperm(n)[:b]``), as lists of indices in
    increasing order. A step records ``SamplingEvent.fixed_size(b, n)``
    (``fixed_size_without_replacement``) and averages over b. The scheme is analysed under the
    replace-one relation only (Wang, Balle & Kasiviswanathan 2019): record into a
    ``PrivacyLedger(..., neighboring="replace_one")``; an accountant without an analysis of it
    refuses the ledger with :class:`~dpledger.errors.UnsupportedSamplingError`.

    Args:
        population_size: n, the number of records.
        batch_size: b in [1, n].
        steps: batches per iteration over the sampler; default round(n / b).
        generator: the CPU generator to draw from.
        seed: a seed for a new generator when ``generator`` is not given.

    Raises:
        InvalidParameterError: n < 1, b outside [1, n], steps < 1, a bad generator or seed.
    """

    def __init__(
        self,
        *,
        population_size: int,
        batch_size: int,
        steps: int | None = None,
        generator: torch.Generator | None = None,
        seed: int | None = None,
    ) -> None:
        scheme = FixedSizeScheme(
            population_size=population_size, batch_size=batch_size, steps=steps
        )
        super().__init__(population_size=scheme.population_size, generator=generator, seed=seed)
        self._use_scheme(scheme)
        self._b = scheme.batch_size

    @property
    def batch_size(self) -> int:
        """b, the size of every batch."""
        return self._b

    def sample(self) -> list[int]:
        """Draw one batch of b distinct indices; kept until a step claims it."""
        if self._b == self._n:
            batch = list(range(self._n))
        else:
            batch = _sorted_list(torch.randperm(self._n, generator=self._generator)[: self._b])
        self._note_draw(len(batch))
        return batch


class TruncatedPoissonBatchSampler(StepwiseBatchSampler):
    """A Poisson sample with rate q, cut to a uniformly random ``max_batch_size`` records.

    Each step includes each record independently with probability q; when more than m =
    ``max_batch_size`` records were drawn, a uniformly random subset of m of them is kept (a
    cap that keeps every step within memory). Batches are indices in increasing order and may be
    empty. A step records ``SamplingEvent.truncated_poisson(q, n, m)`` and averages over q·n (the
    expected size before the cap), so the cap only ever removes records from the sum. Which
    relations and accountants analyse it: :data:`~dpledger.ledger.SCHEME_RELATIONS` and the
    accountants' ``supported_schemes`` (the PLD accountant, at the time of writing).

    Args:
        population_size: n, the number of records.
        sampling_probability: q in (0, 1].
        max_batch_size: m ≥ 1, the cap.
        steps: batches per iteration over the sampler; default round(1/q).
        generator: the CPU generator to draw from.
        seed: a seed for a new generator when ``generator`` is not given.

    Raises:
        InvalidParameterError: n < 1, q outside (0, 1], m < 1, steps < 1, a bad generator or
            seed.
    """

    def __init__(
        self,
        *,
        population_size: int,
        sampling_probability: float,
        max_batch_size: int,
        steps: int | None = None,
        generator: torch.Generator | None = None,
        seed: int | None = None,
    ) -> None:
        scheme = TruncatedPoissonScheme(
            population_size=population_size,
            sampling_probability=sampling_probability,
            max_batch_size=max_batch_size,
            steps=steps,
        )
        super().__init__(population_size=scheme.population_size, generator=generator, seed=seed)
        self._use_scheme(scheme)
        self._q = scheme.sampling_probability
        self._m = scheme.max_batch_size

    @property
    def sampling_probability(self) -> float:
        """q, the Poisson rate before the cap."""
        return self._q

    @property
    def max_batch_size(self) -> int:
        """m, the largest batch."""
        return self._m

    def sample(self) -> list[int]:
        """Draw one capped Poisson batch; kept until a step claims it."""
        if self._q == 1.0:
            drawn = torch.arange(self._n)
        else:
            drawn = (torch.rand(self._n, generator=self._generator) < self._q).nonzero().view(-1)
        if len(drawn) > self._m:
            keep = torch.randperm(len(drawn), generator=self._generator)[: self._m]
            drawn = drawn[keep].sort().values
        batch = drawn.tolist()
        self._note_draw(len(batch))
        return batch


class BallsInBinsBatchSampler(EpochBatchSampler):
    """Each epoch, every record is put into one of k batches uniformly at random.

    One iteration over the sampler is one epoch: at its start every one of the n records is
    assigned to batch ``torch.randint(k)`` independently, and the epoch yields the k batches in
    order (indices in increasing order; sizes ~ Binomial(n, 1/k), so a batch may be empty: step
    it with ``optimizer.empty_step()`` or an empty forward, as for Poisson). A step records
    ``SamplingEvent.balls_in_bins(k, n, epoch_start=...)``, ``epoch_start=True`` on the first
    recorded step of each epoch, and averages over n / k. The scheme is analysed under
    add/remove and replace-one (by the accountants that list it in ``supported_schemes``).

    Args:
        population_size: n, the number of records.
        num_batches: k in [1, n], the batches (steps) of an epoch.
        generator: the CPU generator to draw from.
        seed: a seed for a new generator when ``generator`` is not given.

    Raises:
        InvalidParameterError: n < 1, k outside [1, n], a bad generator or seed.
    """

    _scheme: BallsInBinsScheme

    def __init__(
        self,
        *,
        population_size: int,
        num_batches: int,
        generator: torch.Generator | None = None,
        seed: int | None = None,
    ) -> None:
        scheme = BallsInBinsScheme(population_size=population_size, num_batches=num_batches)
        super().__init__(population_size=scheme.population_size, generator=generator, seed=seed)
        self._scheme = scheme
        self._k = scheme.num_batches

    @property
    def num_batches(self) -> int:
        """k, the batches of an epoch."""
        return self._k

    def sampling_event(self, *, epoch_start: bool = False) -> SamplingEvent:
        """``SamplingEvent.balls_in_bins(k, n, epoch_start=epoch_start)``."""
        return self._scheme.event(epoch_start=epoch_start)

    def __len__(self) -> int:
        return self._k

    def _epoch(self) -> list[list[int]]:
        bins = torch.randint(self._k, (self._n,), generator=self._generator)
        order = torch.argsort(bins, stable=True)  # indices grouped by bin, increasing in each
        counts = torch.bincount(bins, minlength=self._k).tolist()
        return [part.tolist() for part in torch.split(order, counts)]


class ShuffleBatchSampler(EpochBatchSampler):
    """Each epoch, a uniformly random permutation of the n records cut into batches of b.

    One iteration over the sampler is one epoch, what ``DataLoader(shuffle=True)`` does: the
    batches are consecutive pieces of ``torch.randperm(n)``, ⌈n / b⌉ of them with the last one
    smaller when b does not divide n. ``drop_last=True`` is accepted only when b divides n (it
    then changes nothing): leaving the remainder out of every epoch is not the ``shuffle(b, n)``
    the ledger records, and Chua et al.'s lower bound, which ``dpledger epsilon`` shows for
    shuffled runs, does not hold for it. A step records
    ``SamplingEvent.shuffle(b, n, epoch_start=...)``, ``epoch_start=True`` on the first recorded
    step of each epoch, and averages over b (also for the smaller last batch). Shuffling is
    analysed under replace-one only and without amplification (each record is in one batch per
    epoch): record into a ``PrivacyLedger(..., neighboring="replace_one")``.

    Args:
        population_size: n, the number of records.
        batch_size: b in [1, n].
        drop_last: leave out the last, smaller batch of each epoch; only when b divides n.
        generator: the CPU generator to draw from.
        seed: a seed for a new generator when ``generator`` is not given.

    Raises:
        InvalidParameterError: n < 1, b outside [1, n], drop_last not a bool or True with b not
            dividing n, a bad generator or seed.
    """

    _scheme: ShuffleScheme

    def __init__(
        self,
        *,
        population_size: int,
        batch_size: int,
        drop_last: bool = False,
        generator: torch.Generator | None = None,
        seed: int | None = None,
    ) -> None:
        scheme = ShuffleScheme(
            population_size=population_size, batch_size=batch_size, drop_last=drop_last
        )
        super().__init__(population_size=scheme.population_size, generator=generator, seed=seed)
        self._scheme = scheme
        self._b = scheme.batch_size
        self._steps = scheme.steps_per_epoch

    batch_size = scheme_property(ShuffleScheme.batch_size)
    drop_last = scheme_property(ShuffleScheme.drop_last)

    def sampling_event(self, *, epoch_start: bool = False) -> SamplingEvent:
        """``SamplingEvent.shuffle(b, n, epoch_start=epoch_start)``."""
        return self._scheme.event(epoch_start=epoch_start)

    def __len__(self) -> int:
        return self._steps

    def _epoch(self) -> list[list[int]]:
        perm = torch.randperm(self._n, generator=self._generator)
        batches = [part.tolist() for part in torch.split(perm, self._b)]
        return batches[: len(self)]


def private_data_loader(
    dataset: Dataset,
    *,
    sampler: RecordedBatchSampler,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    **loader_kwargs: Any,
) -> DataLoader:
    """A ``DataLoader`` over ``dataset`` whose batches are ``sampler``'s draws.

    ``sampler`` is any recorded batch sampler (:class:`~dpledger.adapters.torch.
    PoissonBatchSampler`, :class:`FixedSizeBatchSampler`, :class:`TruncatedPoissonBatchSampler`,
    :class:`BallsInBinsBatchSampler`, :class:`ShuffleBatchSampler`,
    :class:`~dpledger.adapters.torch.UserPoissonBatchSampler`) over n = ``len(dataset)``
    records; pass the loader (or the sampler) to ``DPOptimizer(sampler=...)``. Empty batches
    come out as empty tensors (see :class:`~dpledger.adapters.torch.EmptyBatchCollate`).

    Args:
        dataset: a map-style data set with ``len``.
        sampler: the batch sampler.
        collate_fn: how to collate a non-empty list of samples (default ``default_collate``).
        **loader_kwargs: passed to ``DataLoader`` (``num_workers``, ``pin_memory``, …);
            ``batch_size``, ``shuffle``, ``batch_sampler`` and ``drop_last`` are refused, as
            they would replace the sampling.

    Raises:
        InvalidParameterError: not a map-style data set, not a recorded batch sampler, a
            sampler over another number of records, or a batching argument.
    """
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise InvalidParameterError(
            "dataset", type(dataset).__name__, "a map-style dataset with __len__ and __getitem__"
        )
    if not isinstance(sampler, RecordedBatchSampler):
        raise InvalidParameterError(
            "sampler",
            type(sampler).__name__,
            "a PoissonBatchSampler, FixedSizeBatchSampler, TruncatedPoissonBatchSampler, "
            "BallsInBinsBatchSampler or ShuffleBatchSampler",
        )
    n = len(dataset)
    if sampler.population_size != n:
        raise InvalidParameterError(
            "sampler",
            f"<{type(sampler).__name__} over {sampler.population_size} records>",
            f"a sampler over the data set's {n} records (population_size=len(dataset))",
        )
    for key in ("batch_size", "shuffle", "batch_sampler", "drop_last"):
        if key in loader_kwargs:
            raise InvalidParameterError(
                key, loader_kwargs[key], "not given: the batch sampler decides the batches"
            )
    collate = EmptyBatchCollate(collate_fn or default_collate, dataset[0])
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, **loader_kwargs)
