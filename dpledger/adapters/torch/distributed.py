"""DP-SGD across processes (``torch.distributed``, e.g. DistributedDataParallel with gloo/NCCL).

A logical step over W processes ("ranks") is the single-process step on the union of the ranks'
records:

1. **Sampling.** :class:`DistributedPoissonBatchSampler` draws the same global Poisson sample on
   every rank (each of the n records with probability q, from generators in the same state) and
   hands rank r the sampled indices i with i ≡ r (mod W). The union over ranks is exactly one
   Poisson sample of the n records with rate q, so the ledger records (q, n) of the whole data
   set — the logical q, unchanged by the number of ranks.
2. **Clipping.** Each rank computes its records' per-example norms and clipped sum
   Σ_{i∈R_r} f_i g_i locally.
3. **Aggregation and noise.** The clipped sums and record counts are reduced (summed) onto rank
   0, which runs the Gaussian sum queries exactly as a single process would: the sensitivity
   check on the total, one draw of N(0, σ̃² I) from its generator, the ledger events, and the
   fixed-denominator average. The averaged noisy gradient is broadcast to every rank, and every
   rank takes the same optimizer step.

Why rank 0 draws all the noise (rather than every rank adding N(0, σ̃²/W)): the released value
is then the single-process value, draw for draw, for the same generator state — the total noise
has the single-process distribution by construction, without relying on the ranks' generators
being independent (W ranks seeded alike would add perfectly correlated noise of total standard
deviation √W·σ̃, not σ̃: a silent error), the ledger is written by the one process that drew the
noise, and a run can be reproduced with any number of ranks. The cost is the same communication
volume as one all-reduce (a reduce and a broadcast of the gradient).

Only rank 0 holds a ledger; the others must be given none.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from dpledger.adapters.torch.poisson import PoissonBatchSampler
from dpledger.errors import InvalidParameterError
from dpledger.validation import check_non_negative_int, check_positive_int

__all__ = [
    "DistributedPoissonBatchSampler",
    "broadcast_tensors",
    "distributed_world",
    "reduce_tensors",
    "sum_counts",
]


def distributed_world(process_group: Any = None) -> tuple[int, int]:
    """``(rank, world_size)`` in the default (or given) process group; ``(0, 1)`` without one."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(process_group), dist.get_world_size(process_group)


def _common_seed(process_group: Any) -> int:
    """A seed drawn on rank 0 and broadcast to every rank (the ranks must sample alike)."""
    seed = torch.tensor([secrets.randbits(62)], dtype=torch.int64)  # OS entropy
    if dist.is_available() and dist.is_initialized():
        dist.broadcast(seed, src=_global_rank(0, process_group), group=process_group)
    return int(seed.item())


def _global_rank(rank: int, process_group: Any) -> int:
    if process_group is None:
        return rank
    return dist.get_global_rank(process_group, rank)


class DistributedPoissonBatchSampler(PoissonBatchSampler):
    """This rank's share of a global Poisson sample of n records (see the module docstring).

    Every rank draws the global sample (each record independently with probability q) from a
    generator in the same state and keeps the indices i ≡ ``rank`` (mod ``world_size``); the
    union of the ranks' batches is the batch a :class:`PoissonBatchSampler` with the same seed
    draws in one process. :attr:`sampling_probability` and :attr:`population_size` are the
    global q and n, which the ledger records.

    Args:
        population_size: n, the number of records of the whole data set (every rank holds it
            or can index it).
        sampling_probability: q in (0, 1].
        rank: this process's rank; default from ``torch.distributed``.
        world_size: the number of ranks; default from ``torch.distributed``.
        steps: batches per epoch; default round(1/q).
        seed: the common seed (the same on every rank). None: rank 0 draws one from OS entropy
            and broadcasts it to the other ranks.
        process_group: the group for that broadcast.

    Raises:
        InvalidParameterError: bad n, q, steps, rank or world size.
    """

    def __init__(
        self,
        *,
        population_size: int,
        sampling_probability: float,
        rank: int | None = None,
        world_size: int | None = None,
        steps: int | None = None,
        seed: int | None = None,
        process_group: Any = None,
    ) -> None:
        default_rank, default_world = distributed_world(process_group)
        world = (
            default_world if world_size is None else check_positive_int("world_size", world_size)
        )
        me = default_rank if rank is None else check_non_negative_int("rank", rank)
        if me >= world:
            raise InvalidParameterError("rank", rank, f"an integer in [0, {world - 1}]")
        drawn = seed is None
        if drawn:
            seed = _common_seed(process_group)
        super().__init__(
            population_size=population_size,
            sampling_probability=sampling_probability,
            steps=steps,
            seed=seed,
        )
        if drawn:
            self._seeding = "os_entropy"  # rank 0 drew the common seed from the OS
        self._rank = me
        self._world = world

    @property
    def rank(self) -> int:
        """This rank."""
        return self._rank

    @property
    def world_size(self) -> int:
        """W, the number of ranks sharing the sample."""
        return self._world

    def _select(self, indices: list[int]) -> list[int]:
        """This rank's indices of a fresh global Poisson sample."""
        if self._world == 1:
            return indices
        return [i for i in indices if i % self._world == self._rank]


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors])


def _unflat(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, start = [], 0
    for t in like:
        k = t.numel()
        out.append(flat[start : start + k].view(t.shape).to(t.dtype))
        start += k
    return out


def reduce_tensors(
    tensors: Sequence[torch.Tensor], *, process_group: Any = None
) -> list[torch.Tensor]:
    """Sum ``tensors`` over the ranks onto rank 0 (one collective on a flattened buffer).

    Returns the sums on rank 0; other ranks get their buffers back with unspecified content.
    """
    flat = _flat(tensors)
    dist.reduce(flat, dst=_global_rank(0, process_group), op=dist.ReduceOp.SUM, group=process_group)
    return _unflat(flat, tensors)


def sum_counts(counts: Sequence[int], *, device: Any, process_group: Any = None) -> list[int]:
    """The sums of small integer counts over the ranks, known on every rank (one all-reduce)."""
    flat = torch.tensor(list(counts), dtype=torch.int64, device=device)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=process_group)
    return [int(v) for v in flat.tolist()]


def broadcast_tensors(
    tensors: Sequence[torch.Tensor], *, process_group: Any = None
) -> list[torch.Tensor]:
    """Rank 0's ``tensors`` on every rank (one collective on a flattened buffer)."""
    flat = _flat(tensors)
    dist.broadcast(flat, src=_global_rank(0, process_group), group=process_group)
    return _unflat(flat, tensors)
