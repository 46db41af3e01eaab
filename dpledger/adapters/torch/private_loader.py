"""The data side of :func:`~dpledger.adapters.torch.make_private`: the loader it returns.

Given a ``DataLoader``, make_private reuses its data set, collate function and worker settings
and replaces its sampling by a recorded batch sampler; :func:`_loader_settings` reads what is
reused and refuses a loader whose sampling cannot be reproduced by an analysed scheme (naming
the sampler to use instead). :func:`_batch_sampler` builds the recorded batch sampler of the
scheme ``sampling=`` names (a :class:`~dpledger.adapters.torch.DistributedPoissonBatchSampler`
under ``torch.distributed``), and :class:`_VirtualLoader` splits its logical batches into
physical chunks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    WeightedRandomSampler,
)
from torch.utils.data.distributed import DistributedSampler

from dpledger.adapters.torch.batch_samplers import (
    BallsInBinsBatchSampler,
    FixedSizeBatchSampler,
    ShuffleBatchSampler,
    TruncatedPoissonBatchSampler,
)
from dpledger.adapters.torch.distributed import DistributedPoissonBatchSampler
from dpledger.adapters.torch.poisson import EmptyBatchCollate, PoissonBatchSampler
from dpledger.adapters.torch.sampler_base import RecordedBatchSampler
from dpledger.adapters.torch.user_level import UserPoissonBatchSampler
from dpledger.adapters.torch.virtual_batches import virtual_batches
from dpledger.errors import InvalidParameterError
from dpledger.validation import check_positive_int

if TYPE_CHECKING:
    from dpledger.adapters.torch.optimizer import DPOptimizer

__all__: list[str] = []  # internal to make_private

_ANALYSED = (
    "pass the data set itself (or a DataLoader with shuffle=True or shuffle=False) and choose "
    "an analysed scheme with sampling= ('poisson': PoissonBatchSampler; 'fixed_size': "
    "FixedSizeBatchSampler; 'truncated_poisson': TruncatedPoissonBatchSampler; "
    "'balls_in_bins': BallsInBinsBatchSampler; 'shuffle': ShuffleBatchSampler)"
)


class _LoaderSettings(NamedTuple):
    dataset: Dataset
    kwargs: dict[str, Any]
    batch_size: int | None
    drop_last: bool


def _check_loader_sampler(sampler: Any) -> None:
    """Refuse a loader's sampler that make_private cannot replace by an analysed scheme without
    changing what the user asked for, naming the sampler to use instead."""
    if type(sampler) is SequentialSampler:
        return
    if type(sampler) is RandomSampler:
        if sampler.replacement:
            raise InvalidParameterError(
                "data",
                "<DataLoader with RandomSampler(replacement=True)>",
                "a loader without replacement: a batch drawn with replacement (a record may be "
                "in it twice) is not a scheme any accountant analyses; use sampling="
                "'fixed_size' (FixedSizeBatchSampler: b distinct records per step) or "
                "sampling='poisson' (PoissonBatchSampler), and pass the data set itself",
            )
        if sampler._num_samples is not None:
            raise InvalidParameterError(
                "data",
                f"<DataLoader with RandomSampler(num_samples={sampler._num_samples})>",
                "a loader whose epoch is one permutation of the whole data set (no num_samples)"
                f"; {_ANALYSED}",
            )
        return
    if isinstance(sampler, WeightedRandomSampler):
        raise InvalidParameterError(
            "data",
            "<DataLoader with WeightedRandomSampler>",
            "a loader with equal-probability sampling: records drawn with unequal weights "
            "(and with replacement) are not a scheme any accountant analyses, and make_private "
            f"cannot keep the weights; {_ANALYSED}",
        )
    if isinstance(sampler, DistributedSampler):
        raise InvalidParameterError(
            "data",
            "<DataLoader with DistributedSampler>",
            "the data set (or a non-distributed loader): one rank's shard of a DistributedSampler "
            "is not a sample of the whole data set; under torch.distributed make_private "
            "builds a DistributedPoissonBatchSampler, which splits one global Poisson sample "
            "over the ranks",
        )
    raise InvalidParameterError(
        "data",
        f"<DataLoader with sampler {type(sampler).__name__}>",
        f"a loader whose sampling make_private can reproduce; the draws of a "
        f"{type(sampler).__name__} have no recorded scheme. Either {_ANALYSED}, or build the "
        "loader with private_data_loader(dataset, sampler=...) and give it to "
        "DPOptimizer(sampler=...)",
    )


def _loader_settings(data: Any) -> _LoaderSettings:
    """The data set and the settings make_private reuses from ``data``, with the batch size and
    drop_last of a DataLoader; refuses a loader whose sampling it cannot reproduce."""
    if not isinstance(data, DataLoader):
        if isinstance(data, Dataset) and not isinstance(data, IterableDataset):
            return _LoaderSettings(data, {}, None, False)
        raise InvalidParameterError(
            "data", type(data).__name__, "a map-style Dataset or a DataLoader over one"
        )
    if isinstance(data.dataset, IterableDataset):
        raise InvalidParameterError(
            "data",
            f"<DataLoader over {type(data.dataset).__name__}>",
            "a DataLoader over a map-style data set (records that can be drawn by index)",
        )
    inner = data.batch_sampler
    batch_size: int | None = None
    drop_last = False
    if isinstance(inner, UserPoissonBatchSampler):
        raise InvalidParameterError(
            "data",
            "<DataLoader with batch_sampler UserPoissonBatchSampler>",
            "a record-level loader: make_private builds a record-level sampler and would drop "
            "the user-level sampling; for user-level DP give the loader to "
            "DPOptimizer(sampler=...) directly",
        )
    if isinstance(inner, RecordedBatchSampler):
        batch_size = getattr(inner, "batch_size", None)
        drop_last = bool(getattr(inner, "drop_last", False))
    elif inner is None:  # batch_size=None: one record at a time
        _check_loader_sampler(data.sampler)
    elif type(inner) is BatchSampler:
        _check_loader_sampler(inner.sampler)
        batch_size, drop_last = inner.batch_size, inner.drop_last
    else:
        raise InvalidParameterError(
            "data",
            f"<DataLoader with batch_sampler {type(inner).__name__}>",
            f"a loader whose batching make_private can reproduce; the batches of a "
            f"{type(inner).__name__} have no recorded scheme. Either {_ANALYSED}, or build the "
            "loader with private_data_loader(dataset, sampler=...) and give it to "
            "DPOptimizer(sampler=...)",
        )
    collate = data.collate_fn
    if isinstance(collate, EmptyBatchCollate):
        collate = collate._collate_fn
    kwargs = {"num_workers": data.num_workers, "pin_memory": data.pin_memory, "collate_fn": collate}
    return _LoaderSettings(data.dataset, kwargs, batch_size, drop_last)


def _build_sampler(
    sampling: str,
    n: int,
    *,
    q: float | None,
    batch_size: int | None,
    drop_last: bool,
    max_batch_size: int | None,
    num_batches: int | None,
    seed: int | None,
) -> RecordedBatchSampler:
    def need(name: str, value: Any, what: str) -> Any:
        if value is None:
            raise InvalidParameterError(name, None, f"{what} for sampling={sampling!r}")
        return value

    if sampling == "poisson":
        return PoissonBatchSampler(population_size=n, sampling_probability=q, seed=seed)
    if sampling == "truncated_poisson":
        return TruncatedPoissonBatchSampler(
            population_size=n,
            sampling_probability=q,
            max_batch_size=need("max_batch_size", max_batch_size, "the cap m"),
            seed=seed,
        )
    if sampling == "balls_in_bins":
        if num_batches is None and batch_size is not None:
            num_batches = -(-n // check_positive_int("batch_size", batch_size))
        k = need("num_batches", num_batches, "k (or batch_size=, for k = ⌈n / b⌉)")
        return BallsInBinsBatchSampler(population_size=n, num_batches=k, seed=seed)
    b = need("batch_size", batch_size, "b (or a DataLoader with a batch_size)")
    if sampling == "fixed_size":
        return FixedSizeBatchSampler(population_size=n, batch_size=b, seed=seed)
    return ShuffleBatchSampler(population_size=n, batch_size=b, drop_last=drop_last, seed=seed)


def _batch_sampler(
    sampling: str,
    n: int,
    *,
    q: float | None,
    batch_size: int | None,
    drop_last: bool,
    max_batch_size: int | None,
    num_batches: int | None,
    seed: int | None,
    distributed: bool,
    process_group: Any,
) -> RecordedBatchSampler:
    """The recorded batch sampler of the returned loader: the scheme ``sampling`` names, or
    under ``torch.distributed`` (Poisson only) a DistributedPoissonBatchSampler."""
    if distributed:
        if sampling != "poisson":
            raise InvalidParameterError(
                "sampling",
                sampling,
                "'poisson' under torch.distributed: only DistributedPoissonBatchSampler draws "
                "one global sample and splits it over the ranks (there is no distributed "
                f"sampler for {sampling!r})",
            )
        return DistributedPoissonBatchSampler(
            population_size=n,
            sampling_probability=q,  # type: ignore[arg-type]
            seed=seed,
            process_group=process_group,
        )
    return _build_sampler(
        sampling,
        n,
        q=q,
        batch_size=batch_size,
        drop_last=drop_last,
        max_batch_size=max_batch_size,
        num_batches=num_batches,
        seed=seed,
    )


class _VirtualLoader:
    """A re-iterable view of a loader in physical chunks (see :func:`virtual_batches`)."""

    def __init__(self, loader: DataLoader, optimizer: DPOptimizer, size: int) -> None:
        self.loader = loader
        self.optimizer = optimizer
        self.max_physical_batch_size = check_positive_int("max_physical_batch_size", size)

    @property
    def batch_sampler(self) -> Any:
        """The logical loader's batch sampler."""
        return self.loader.batch_sampler

    def __iter__(self) -> Any:
        return virtual_batches(
            self.loader, self.optimizer, max_physical_batch_size=self.max_physical_batch_size
        )
