"""Batch samplers of the sampling schemes other than Poisson, each recording its own event, and
the cyclic batch sampler of a correlated-noise release (:class:`CyclicBatchSampler`).

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

from collections.abc import Callable, Iterator
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
from dpledger.mechanisms.correlated.spec import CorrelatedNoiseSpec
from dpledger.sampling import (
    BallsInBinsScheme,
    CyclicScheme,
    FixedSizeScheme,
    ShuffleScheme,
    TruncatedPoissonScheme,
)
from dpledger.sampling.sampler_properties import scheme_property

__all__ = [
    "BallsInBinsBatchSampler",
    "CyclicBatchSampler",
    "FixedSizeBatchSampler",
    "ShuffleBatchSampler",
    "TruncatedPoissonBatchSampler",
    "private_data_loader",
]


class FixedSizeBatchSampler(StepwiseBatchSampler):
    """Each step, a uniformly random subset of exactly b of the n records (without replacement).

    Batches are drawn independently per step (:meth:`~dpledger.sampling.FixedSizeScheme.draw`),
    as lists of indices in increasing order. A step records ``SamplingEvent.fixed_size(b, n)``
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

    batch_size = scheme_property(FixedSizeScheme.batch_size)


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

    sampling_probability = scheme_property(TruncatedPoissonScheme.sampling_probability)
    max_batch_size = scheme_property(TruncatedPoissonScheme.max_batch_size)


class BallsInBinsBatchSampler(EpochBatchSampler):
    """Each epoch, every record is put into one of k batches uniformly at random.

    One iteration over the sampler is one epoch: at its start every one of the n records is
    assigned to a uniformly random batch independently
    (:meth:`~dpledger.sampling.BallsInBinsScheme.draw_epoch`), and the epoch yields the k batches in
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

    num_batches = scheme_property(BallsInBinsScheme.num_batches)


class ShuffleBatchSampler(EpochBatchSampler):
    """Each epoch, a uniformly random permutation of the n records cut into batches of b.

    One iteration over the sampler is one epoch, what ``DataLoader(shuffle=True)`` does: the batches
    are consecutive pieces of a uniform permutation
    (:meth:`~dpledger.sampling.ShuffleScheme.draw_epoch`), in its order, ⌈n / b⌉ of them with the
    last one smaller when b does not divide n. ``drop_last=True`` is accepted only when b divides n
    (it then changes nothing): leaving the remainder out of every epoch is not the ``shuffle(b, n)``
    the ledger records, and Chua et al.'s lower bound, which ``dpledger epsilon`` shows for shuffled
    runs, does not hold for it. A step records ``SamplingEvent.shuffle(b, n, epoch_start=...)``,
    ``epoch_start=True`` on the first recorded step of each epoch, and averages over b (also for the
    smaller last batch). Shuffling is analysed under replace-one only and without amplification
    (each record is in one batch per epoch): record into a ``PrivacyLedger(...,
    neighboring="replace_one")``.

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

    batch_size = scheme_property(ShuffleScheme.batch_size)
    drop_last = scheme_property(ShuffleScheme.drop_last)


class CyclicBatchSampler(RecordedBatchSampler):
    """The batches of a correlated-noise release: cyclic groups, whole or Poisson-sampled.

    Step t of the stream uses group t mod period of a :class:`~dpledger.sampling.CyclicScheme`
    (its :meth:`~dpledger.sampling.CyclicScheme.draw`; ``docs/correlated-noise.md``). It is the
    only sampler a :class:`~dpledger.adapters.torch.DPOptimizer` with ``noise=`` a
    :class:`~dpledger.mechanisms.correlated.CorrelatedNoiseSpec` accepts, because the release it
    records states the scheme's participation
    (:meth:`~dpledger.sampling.CyclicScheme.participation`), and each step claims the draw of
    *its* step of the stream (:meth:`claim_step`): a batch from another loader, a batch of
    another step, or a skipped batch is refused before anything is released.

    One pass over the sampler is one epoch (``period`` steps, fewer at the end of the stream);
    the pass continues the stream from the first step not yet claimed, and yields nothing once
    all T steps were claimed. The draws depend only on the scheme's seed and the step, so a run
    resumed from a checkpoint (:meth:`state_dict`, which holds the scheme with its seed) draws
    the same batches, also in a sampler built with another seed (``seed=None``): the
    checkpoint's scheme takes over. Its draws record no sampling event (the stream's steps are
    covered by the one correlated release): :meth:`sampling_event` refuses, so that a
    ``DPOptimizer`` with independent noise refuses this sampler.

    Args:
        scheme: the :class:`~dpledger.sampling.CyclicScheme` to draw.

    Raises:
        InvalidParameterError: ``scheme`` is not a ``CyclicScheme``.
    """

    def __init__(self, *, scheme: CyclicScheme) -> None:
        if not isinstance(scheme, CyclicScheme):
            raise InvalidParameterError("scheme", scheme, "a dpledger.sampling.CyclicScheme")
        super().__init__(population_size=scheme.population_size, seed=scheme.seed)
        self._cyclic = scheme
        self._next_claim = 0  # the first step of the stream not claimed yet

    @classmethod
    def for_spec(
        cls, spec: CorrelatedNoiseSpec, *, population_size: int, seed: int
    ) -> CyclicBatchSampler:
        """The sampler of ``spec``'s cyclic scheme over ``population_size`` records."""
        if not isinstance(spec, CorrelatedNoiseSpec):
            raise InvalidParameterError("spec", spec, "a CorrelatedNoiseSpec")
        return cls(scheme=spec.scheme(population_size=population_size, seed=seed))

    @property
    def cyclic_scheme(self) -> CyclicScheme:
        """The scheme drawn."""
        return self._cyclic

    @property
    def next_step(self) -> int:
        """The stream step the next claimed batch must be."""
        return self._next_claim

    @property
    def denominator(self) -> float:
        """The fixed denominator of the average: the expected batch size (n / period)·q."""
        return self._cyclic.average_denominator

    def sampling_event(self, *, epoch_start: bool = False) -> SamplingEvent:
        """Refused: a cyclic draw records no sampling event of its own.

        Raises:
            InvalidParameterError: always, naming what to use instead.
        """
        raise InvalidParameterError(
            "sampler",
            f"CyclicBatchSampler({self._cyclic.describe()})",
            "a sampler with a sampling event for independent noise: a cyclic sampler's "
            "batches are covered only by a correlated-noise release; use "
            "DPOptimizer(..., noise=CorrelatedNoiseSpec(...)) or "
            "make_private(..., noise=spec) with this sampler",
        )

    def _describe(self) -> str:
        return f"CyclicBatchSampler, {self._cyclic.describe()}"

    def __len__(self) -> int:
        return max(0, min(self._cyclic.period, self._cyclic.num_steps - self._next_claim))

    def __iter__(self) -> Iterator[list[int]]:
        self._new_pass()
        start = self._next_claim
        for t in range(start, start + len(self)):
            batch = self._cyclic.draw(t).tolist()
            self._note_draw(len(batch), None, t)
            yield batch

    def claim_draw(self, num_records: int) -> SamplingEvent:
        """Refused: steps of a correlated stream claim with :meth:`claim_step`.

        Raises:
            InvalidParameterError: always.
        """
        return self.sampling_event()

    def claim_step(self, num_records: int, *, step: int) -> None:
        """Tie stream step ``step`` to the oldest unclaimed draw, which must be that step's.

        Raises:
            SamplerMismatchError: no draw is waiting (the records came from another loader), the
                oldest draw is of another step (a batch was skipped), or it has another number
                of records. The draw is consumed either way.
        """
        self._draws.claim_step(num_records, step=step, describe_sampler=self._describe)

    def step_released(self, step: int) -> None:
        """Stream step ``step`` was released: the next pass starts after it.

        A step refused after its claim (a failed sensitivity check) is not released: the next
        pass draws its batch again, and the stream's noise of that step is still unused.
        """
        self._next_claim = step + 1

    def state_dict(self) -> dict[str, Any]:
        """The next stream step to claim and the scheme
        (:meth:`~dpledger.sampling.CyclicScheme.state`: the draws depend only on the scheme,
        its seed included, and the step)."""
        return {"next_step": self._next_claim, "scheme": self._cyclic.state()}

    def scheme_of_state(self, state: Any) -> CyclicScheme:
        """The scheme a :meth:`state_dict` was taken of, checked against this sampler's
        (:meth:`~dpledger.sampling.CyclicScheme.from_state`: only the seed may differ; a
        sampler built with ``seed=None``, ``make_private``'s default, drew a partition of its
        own, and the checkpoint's scheme takes over on :meth:`load_state_dict`).

        Raises:
            InvalidParameterError: not a state of this class, or a scheme with another
                population, period, T or q.
        """
        saved = state.get("scheme") if isinstance(state, dict) else None
        return CyclicScheme.from_state(saved, like=self._cyclic, name="state['scheme']")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` of a sampler of the same scheme up to its seed; the
        checkpoint's scheme (its seed) takes over, so the batches are the checkpointed run's.

        Raises:
            InvalidParameterError: the state is of another scheme (:meth:`scheme_of_state`),
                or its step is out of range.
        """
        scheme = self.scheme_of_state(state)
        step = state.get("next_step")
        if type(step) is not int or not 0 <= step <= scheme.num_steps:
            raise InvalidParameterError("state['next_step']", step, f"0..{scheme.num_steps}")
        self._draws.clear()
        self._cyclic = scheme
        self._next_claim = step

    def reseed(self, seed: int) -> None:
        """Refused: a cyclic stream's draws are fixed by its scheme.

        Raises:
            InvalidParameterError: always.
        """
        raise InvalidParameterError(
            "seed", seed, "no reseeding: the cyclic partition is fixed for the whole stream"
        )

    def __repr__(self) -> str:
        return f"CyclicBatchSampler(scheme={self._cyclic!r})"


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
    come out as empty tensors (see :class:`~dpledger.adapters.torch.poisson.EmptyBatchCollate`).

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
