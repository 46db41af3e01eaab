"""Train an MLP sharded with FSDP2 on several processes with DP-SGD, and account for it.

Every process ("rank") shards each layer and the root with ``fully_shard``; a
``DistributedPoissonBatchSampler`` draws one global Poisson sample per step (each of the n
training images with probability q) and hands each rank its part; ``DPOptimizer`` clips each
rank's examples, adds the clipped sums up over the ranks, and rank 0 records the global sample
and the sum query in the ledger file, draws the noise and sends the noisy average to every
rank, which keeps its shard of it. Rank 0 prints the test accuracy and ε from the ledger.

    torchrun --nproc-per-node 2 examples/torch_fsdp.py [--ledger torch_fsdp.dpl]
    python examples/torch_fsdp.py            # the same, starting its 2 processes itself
    dpledger epsilon torch_fsdp.dpl --delta 1e-5

On the CPU the processes talk through gloo; on GPUs use ``--backend nccl`` (one GPU a rank).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from sklearn.datasets import load_digits
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from dpledger import PrivacyLedger
from dpledger.accountants import RdpAccountant
from dpledger.adapters.torch import DistributedPoissonBatchSampler, DPOptimizer
from dpledger.adapters.torch.poisson import EmptyBatchCollate

Q, EPOCHS, SIGMA, CLIP, DELTA = 0.05, 4, 1.0, 1.0, 1e-5


def digits() -> tuple[TensorDataset, TensorDataset]:
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    split = 1400
    return TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:])


def train(args: argparse.Namespace) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank: FSDP2 shards each rank's copy
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)

    train_set, test_set = digits()
    sampler = DistributedPoissonBatchSampler(
        population_size=len(train_set), sampling_probability=Q, steps=round(1 / Q)
    )
    loader = DataLoader(
        train_set,
        batch_sampler=sampler,
        collate_fn=EmptyBatchCollate(torch.utils.data.default_collate, train_set[0]),
    )
    ledger = PrivacyLedger(args.ledger) if rank == 0 else None  # one ledger: rank 0's
    optimizer = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5),
        model=model,
        sampler=sampler,
        ledger=ledger,
        l2_norm_bound=CLIP,
        noise_multiplier=SIGMA,
    )
    for _ in range(EPOCHS):
        for x, y in loader:  # this rank's part of the global Poisson sample
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()

    with torch.no_grad():
        x, y = test_set.tensors
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    if ledger is not None:
        ledger.close()
        result = RdpAccountant().epsilon(PrivacyLedger.load(args.ledger), delta=DELTA)
        print(
            f"test accuracy {accuracy:.3f}; epsilon {result.epsilon:.2f} at delta {DELTA} "
            f"(RDP, {result.kind.value}) after {ledger.num_steps} steps"
        )


def _spawned(rank: int, world: int, rendezvous: str, args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    try:
        train(args)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ledger", type=Path, default=Path("torch_fsdp.dpl"))
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--processes", type=int, default=2, help="without torchrun")
    args = parser.parse_args()
    if "RANK" in os.environ:  # started by torchrun
        dist.init_process_group(args.backend)
        try:
            train(args)
        finally:
            dist.destroy_process_group()
        return
    with tempfile.TemporaryDirectory() as folder:
        rendezvous = f"file://{Path(folder) / 'rendezvous'}"
        torch.multiprocessing.start_processes(
            _spawned,
            args=(args.processes, rendezvous, args),
            nprocs=args.processes,
            start_method="spawn",
        )


if __name__ == "__main__":
    main()
