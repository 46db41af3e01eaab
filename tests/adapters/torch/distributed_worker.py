"""The per-process body of the distributed test (imported by spawned processes)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data._utils.collate import default_collate

from dpledger import PrivacyLedger
from dpledger.adapters.torch import DistributedPoissonBatchSampler, DPOptimizer, PoissonBatchSampler
from dpledger.adapters.torch.poisson import EmptyBatchCollate
from dpledger.errors import InvalidParameterError, RecordDependenceError, SamplerMismatchError
from tests.adapters.torch.dp_helpers import batch, small_cnn

N, Q, STEPS, SEED, NOISE_SEED = 40, 0.25, 3, 3, 7
CONFIGS = [("plain", 0.0), ("ddp", 0.0), ("plain", 1.0), ("ddp", 1.0)]


class Centre(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0)


def dataset() -> TensorDataset:
    return TensorDataset(*batch(N, seed=2))


def train(model, sampler, ledger, sigma: float, out: Path) -> None:
    data = dataset()
    loader = DataLoader(
        data, batch_sampler=sampler, collate_fn=EmptyBatchCollate(default_collate, data[0])
    )
    dp = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.3),
        model=model,
        sampler=sampler,
        ledger=ledger,
        l2_norm_bound=1.0,
        noise_multiplier=sigma,
        seed=NOISE_SEED,
    )
    sizes, on_disk = [], []
    for x, y in loader:
        dp.zero_grad()
        F.cross_entropy(model(x), y).backward()
        dp.step()
        sizes.append(len(y))
        if ledger is not None:  # the steps the file holds when step() returns (write-ahead)
            with open(ledger.path, encoding="utf-8") as fp:
                on_disk.append(fp.read().count('"kind":"sample"'))
    params = [p.detach().clone() for p in model.parameters()]
    torch.save({"params": params, "sizes": sizes, "on_disk": on_disk}, out)


def single_process(directory: Path) -> None:
    """The reference: one process, the same seeds, the whole data set."""
    torch.set_num_threads(1)
    for sigma in sorted({s for _, s in CONFIGS}):
        sampler = PoissonBatchSampler(
            population_size=N, sampling_probability=Q, steps=STEPS, seed=SEED
        )
        ledger = PrivacyLedger(directory / f"single_{sigma}.dpl")
        train(small_cnn(), sampler, ledger, sigma, directory / f"single_{sigma}.pt")
        ledger.close()


def worker(rank: int, world: int, directory: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    path = Path(directory)
    dist.init_process_group(
        "gloo", init_method=f"file://{path / 'rendezvous'}", rank=rank, world_size=world
    )
    try:
        for mode, sigma in CONFIGS:
            torch.manual_seed(100 + rank)  # different initialisations: rank 0's is broadcast
            model = small_cnn(seed=rank)
            if mode == "ddp":
                model = DistributedDataParallel(model)
            sampler = DistributedPoissonBatchSampler(
                population_size=N, sampling_probability=Q, steps=STEPS, seed=SEED
            )
            ledger = PrivacyLedger(path / f"{mode}_{sigma}.dpl") if rank == 0 else None
            train(model, sampler, ledger, sigma, path / f"rank{rank}_{mode}_{sigma}.pt")
            if ledger is not None:
                ledger.close()
        refusals = []
        try:
            m = small_cnn()
            DPOptimizer(
                torch.optim.SGD(m.parameters(), lr=0.1),
                model=m,
                sampler=PoissonBatchSampler(population_size=N, sampling_probability=Q, seed=1),
                l2_norm_bound=1.0,
                noise_multiplier=1.0,
            )
        except InvalidParameterError as err:
            refusals.append(err.parameter)
        if rank == 1:
            try:
                m = small_cnn()
                DPOptimizer(
                    torch.optim.SGD(m.parameters(), lr=0.1),
                    model=m,
                    sampling_probability=Q,
                    population_size=N,
                    ledger=PrivacyLedger(),
                    l2_norm_bound=1.0,
                    noise_multiplier=1.0,
                )
            except InvalidParameterError as err:
                refusals.append(err.parameter)
        try:  # a model that mixes records, under DDP: every rank's probe refuses it
            centred = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 4), Centre()))
            _dp = DPOptimizer(  # its hooks on the model stay for the forward below
                torch.optim.SGD(centred.parameters(), lr=0.1),
                model=centred,
                sampler=DistributedPoissonBatchSampler(
                    population_size=N, sampling_probability=Q, seed=1
                ),
                ledger=PrivacyLedger() if rank == 0 else None,
                l2_norm_bound=1.0,
                noise_multiplier=1.0,
            )
            centred(torch.randn(4, 4))
        except RecordDependenceError as err:
            refusals.append(f"mixing:{err.layer_name}")
        # Rank 1 steps on records its sampler did not draw, rank 0 on its real draw: every rank
        # refuses the step together (none waits in a collective), and nothing is recorded.
        m = small_cnn()
        sampler = DistributedPoissonBatchSampler(
            population_size=N, sampling_probability=Q, steps=STEPS, seed=SEED
        )
        tie_ledger = PrivacyLedger() if rank == 0 else None
        dp = DPOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1),
            model=m,
            sampler=sampler,
            ledger=tie_ledger,
            l2_norm_bound=1.0,
            noise_multiplier=1.0,
        )
        xs, ys = dataset().tensors
        idx = sampler.sample() if rank == 0 else list(range(3))
        dp.zero_grad()
        F.cross_entropy(m(xs[idx]), ys[idx]).backward()
        try:
            dp.step()
        except SamplerMismatchError as err:
            refusals.append("other rank" if "other rank" in str(err) else "no draw")
        if tie_ledger is not None:
            refusals.append(f"steps:{tie_ledger.num_steps}")
        torch.save(refusals, path / f"refusals{rank}.pt")
        # both ranks past every collective before either tears gloo down: a rank that destroys
        # its process group while the other still talks to it aborts under load
        dist.barrier()
    finally:
        dist.destroy_process_group()
