"""Poisson sampling of records for DP-SGD.

Every step, each of the n records of the data set is in the batch independently with probability
q, so the batch size is Binomial(n, q) and may be zero (Abadi et al. 2016; McMahan & Andrew,
section 2: "sample"). Privacy amplification by sampling is analysed for exactly this scheme, so
the accountant must be given this q and not 1/(number of batches).

The sampler does not write to the privacy ledger: the training step that consumes a batch
records one sampling event (n, q) per logical step, reading :attr:`PoissonBatchSampler.
sampling_probability` and :attr:`PoissonBatchSampler.population_size`. Recording here as well
would count every step twice.

Every step is tied to a draw of the sampler (:mod:`~dpledger.adapters.torch.sampler_base`): the
optimizer claims the oldest unclaimed draw at each step (:meth:`PoissonBatchSampler.claim_draw`,
which returns the event to record) and refuses the step, before anything is recorded, when the
sampler drew nothing (the training loop iterates another loader, e.g. the user's own
``shuffle=True`` DataLoader) or drew a batch of another size. Samplers of the other schemes are
in :mod:`~dpledger.adapters.torch.batch_samplers`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data._utils.collate import default_collate

from dpledger.adapters.torch.sampler_base import StepwiseBatchSampler
from dpledger.errors import InvalidParameterError
from dpledger.sampling import PoissonScheme
from dpledger.sampling.sampler_properties import scheme_property

__all__ = ["EmptyBatchCollate", "PoissonBatchSampler", "poisson_data_loader"]


class PoissonBatchSampler(StepwiseBatchSampler):
    """Yields, for each step, the indices of the records drawn by Poisson sampling.

    Each of ``population_size`` records is included independently with probability
    ``sampling_probability`` in every batch (:meth:`~dpledger.sampling.PoissonScheme.draw`, the
    indices i with U_i < q for fresh uniforms U_0..U_{n-1}); batches are lists of indices in
    increasing order and may be empty. A step on one of its draws records
    ``SamplingEvent.poisson(q, n)`` (``scheme="full"`` when q = 1), the scheme every accountant
    analyses.

    Args:
        population_size: n, the number of records (``len(dataset)``).
        sampling_probability: q in (0, 1].
        steps: batches per iteration over the sampler (an "epoch"); default round(1/q), so that
            an epoch sees n records in expectation.
        generator: the random generator to draw from (on the CPU). Iterating again continues its
            stream, so successive epochs differ and the whole run is reproducible from its seed.
        seed: a seed for a new generator, when ``generator`` is not given; None draws one from
            the global generator (``torch.seed()``-like non-reproducible behaviour).

    Raises:
        InvalidParameterError: n < 1, q outside (0, 1], steps < 1, or both ``generator`` and
            ``seed`` given.
    """

    def __init__(
        self,
        *,
        population_size: int,
        sampling_probability: float,
        steps: int | None = None,
        generator: torch.Generator | None = None,
        seed: int | None = None,
    ) -> None:
        scheme = PoissonScheme(
            population_size=population_size, sampling_probability=sampling_probability, steps=steps
        )
        super().__init__(population_size=scheme.population_size, generator=generator, seed=seed)
        self._use_scheme(scheme)

    sampling_probability = scheme_property(PoissonScheme.sampling_probability)
    expected_batch_size = scheme_property(PoissonScheme.expected_batch_size)


class EmptyBatchCollate:
    """A collate function that also turns an empty list of samples into an empty batch.

    ``default_collate([])`` fails; a Poisson batch can be empty. For an empty list this returns
    the collation of one template sample with every tensor cut to zero records along dim 0, so
    the model sees tensors of the right dtype and trailing shape, e.g. (0, 1, 28, 28).

    Args:
        collate_fn: the collate function for non-empty batches.
        template: one sample of the data set (``dataset[0]``).
    """

    def __init__(self, collate_fn: Callable[[list[Any]], Any], template: Any) -> None:
        self._collate_fn = collate_fn
        self._template = template

    def __call__(self, samples: list[Any]) -> Any:
        if len(samples) > 0:
            return self._collate_fn(samples)
        one = self._collate_fn([self._template])
        return tree_map(lambda t: t[:0] if isinstance(t, torch.Tensor) else t, one)


def poisson_data_loader(
    dataset: Dataset,
    *,
    sampling_probability: float,
    steps: int | None = None,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    **loader_kwargs: Any,
) -> DataLoader:
    """A ``DataLoader`` whose batches are Poisson samples of ``dataset``.

    Its ``batch_sampler`` is a :class:`PoissonBatchSampler` over n = ``len(dataset)`` records;
    read q and n from it (``loader.batch_sampler.sampling_probability``) when recording the
    sampling event. Empty batches come out as empty tensors (see :class:`EmptyBatchCollate`).

    Args:
        dataset: a map-style data set with ``len``.
        sampling_probability: q in (0, 1].
        steps: batches per epoch; default round(1/q).
        generator: the generator of the batch sampler.
        seed: a seed for the batch sampler's generator when ``generator`` is not given.
        collate_fn: how to collate a non-empty list of samples (default ``default_collate``).
        **loader_kwargs: passed to ``DataLoader`` (``num_workers``, ``pin_memory``, …);
            ``batch_size``, ``shuffle``, ``sampler``, ``batch_sampler`` and ``drop_last`` are
            refused, as they would replace the sampling.
    """
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise InvalidParameterError(
            "dataset", type(dataset).__name__, "a map-style dataset with __len__ and __getitem__"
        )
    for key in ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"):
        if key in loader_kwargs:
            raise InvalidParameterError(
                key, loader_kwargs[key], "not given: Poisson sampling decides the batches"
            )
    n = len(dataset)
    sampler = PoissonBatchSampler(
        population_size=n,
        sampling_probability=sampling_probability,
        steps=steps,
        generator=generator,
        seed=seed,
    )
    collate = EmptyBatchCollate(collate_fn or default_collate, dataset[0])
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, **loader_kwargs)
