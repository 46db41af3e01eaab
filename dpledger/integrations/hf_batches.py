"""The Trainer's micro-batches of :class:`~dpledger.integrations.transformers.DPTrainer`.

Each logical (Poisson) batch of the recorded loader is cut into ``gradient_accumulation_steps``
micro-batches of sizes differing by at most one, so that the Trainer's gradient accumulation
runs over one draw per optimizer step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from dpledger.errors import InvalidParameterError

__all__ = ["MicroBatchLoader", "num_records", "split_batch"]


def num_records(inputs: Any) -> int:
    """The number of records along dim 0 of the batch's tensors."""
    values = inputs.values() if isinstance(inputs, dict) else inputs
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise InvalidParameterError("inputs", type(inputs).__name__, "a batch with tensors")


def split_batch(batch: Any, parts: int) -> list[Any]:
    """``batch`` (a dict of tensors, records along dim 0) cut into ``parts`` micro-batches of
    sizes differing by at most one; other values are repeated in each."""
    pieces = {
        key: torch.tensor_split(value, parts)
        if isinstance(value, torch.Tensor) and value.dim() > 0
        else (value,) * parts
        for key, value in batch.items()
    }
    return [{key: pieces[key][i] for key in batch} for i in range(parts)]


class MicroBatchLoader:
    """Each logical (Poisson) batch of ``loader`` as ``parts`` micro-batches, so that the
    Trainer's gradient accumulation runs over one draw per optimizer step."""

    def __init__(self, loader: torch.utils.data.DataLoader, parts: int) -> None:
        self.loader = loader
        self.parts = parts
        self.dataset = loader.dataset
        self.batch_sampler = loader.batch_sampler

    def __len__(self) -> int:
        return len(self.loader) * self.parts

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            if not isinstance(batch, dict):
                raise InvalidParameterError(
                    "data_collator",
                    type(batch).__name__,
                    "a collator returning a dict of tensors (the Trainer's model inputs)",
                )
            yield from split_batch(batch, self.parts)
