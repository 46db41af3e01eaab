"""Virtual batches: one logical DP step processed in physical chunks that fit in memory.

A Poisson sample with a large expected size q·n is one *logical* step: one sampling event with
that q, one noise draw, one average over q·n. Its records are split into physical chunks of at
most ``max_physical_batch_size``; each chunk's forward and backward yields its per-example
gradients, which are clipped at once and added to the step's clipped sum
(:meth:`~dpledger.adapters.torch.optimizer.DPOptimizer.virtual_step`), and the ``step()`` after
the last chunk releases the logical step. Clipping is per record, so the result is the same as
processing the whole sample at once; the number of chunks changes nothing in the ledger.

:func:`virtual_batches` does the bookkeeping for a data loader so that an existing loop with
``optimizer.step()`` after every backward keeps working: ``step()`` after a chunk that is not
the last of its logical batch only accumulates.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from dpledger.errors import InvalidParameterError
from dpledger.validation import check_positive_int

if TYPE_CHECKING:
    from dpledger.adapters.torch.optimizer import DPOptimizer

__all__ = ["split_batch", "virtual_batches"]


def split_batch(batch: Any, *, max_size: int) -> list[Any]:
    """Split a batch (a tensor or a pytree of tensors, records along dim 0) into chunks.

    Every tensor leaf is cut along dimension 0 into pieces of at most ``max_size`` records;
    other leaves are repeated in every chunk. An empty batch gives one empty chunk (so that the
    empty logical step still runs its forward and backward).

    Raises:
        InvalidParameterError: ``max_size`` < 1, or tensor leaves with different numbers of
            records.
    """
    size = check_positive_int("max_size", max_size)
    leaves, spec = tree_flatten(batch)
    counts = {t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0}
    if len(counts) > 1:
        raise InvalidParameterError(
            "batch", f"<tensors with {sorted(counts)} records>", "the same records along dim 0"
        )
    total = counts.pop() if counts else 0
    if total == 0:
        return [batch]
    chunks = []
    for start in range(0, total, size):
        part = [
            t[start : start + size] if isinstance(t, torch.Tensor) and t.dim() > 0 else t
            for t in leaves
        ]
        chunks.append(tree_unflatten(part, spec))
    return chunks


def virtual_batches(
    data_loader: Iterable[Any], optimizer: DPOptimizer, *, max_physical_batch_size: int
) -> Iterator[Any]:
    """Iterate over ``data_loader``'s logical batches in physical chunks.

    ``optimizer.step()`` after a chunk's backward accumulates it; after the last chunk of a
    logical batch it releases the logical step (one sampling event with the loader's q)::

        for x, y in virtual_batches(loader, optimizer, max_physical_batch_size=64):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()

    Args:
        data_loader: yields logical (Poisson) batches.
        optimizer: the :class:`~dpledger.adapters.torch.optimizer.DPOptimizer` stepping them.
        max_physical_batch_size: the largest chunk, in records.
    """
    from dpledger.adapters.torch.optimizer import DPOptimizer

    size = check_positive_int("max_physical_batch_size", max_physical_batch_size)
    if not isinstance(optimizer, DPOptimizer):
        raise InvalidParameterError("optimizer", optimizer, "a DPOptimizer")
    try:
        for batch in data_loader:
            chunks = split_batch(batch, max_size=size)
            for k, chunk in enumerate(chunks):
                optimizer._final_chunk = k == len(chunks) - 1
                yield chunk
    finally:
        optimizer._final_chunk = None
