"""The per-process body of the FSDP2 test (imported by spawned processes)."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data._utils.collate import default_collate

from dpledger import PrivacyLedger
from dpledger.adapters.torch import DistributedPoissonBatchSampler, DPOptimizer, PoissonBatchSampler
from dpledger.adapters.torch.poisson import EmptyBatchCollate
from dpledger.errors import (
    InvalidParameterError,
    RecordDependenceError,
    SamplerMismatchError,
    UnsupportedLayerError,
)
from tests.adapters.torch.dp_helpers import batch, small_cnn

N, Q, STEPS, SEED, NOISE_SEED, CLIP = 40, 0.25, 3, 3, 7, 0.05  # CLIP binds: every g_i clipped
SIGMAS = (0.0, 1.0)


def dataset() -> TensorDataset:
    return TensorDataset(*batch(N, seed=2))


def sharded_cnn(mesh=None) -> torch.nn.Module:
    """The test CNN with every layer and the root sharded by FSDP2 (the same initialisation on
    every rank, as FSDP2 shards each rank's own copy)."""
    model = small_cnn(seed=0)
    for layer in (model.conv, model.norm, model.fc1, model.fc2):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def train(model, sampler, ledger, sigma: float, out: Path, *, cheap_backward: bool) -> None:
    data = dataset()
    loader = DataLoader(
        data, batch_sampler=sampler, collate_fn=EmptyBatchCollate(default_collate, data[0])
    )
    dp = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.3),
        model=model,
        sampler=sampler,
        ledger=ledger,
        l2_norm_bound=CLIP,
        noise_multiplier=sigma,
        seed=NOISE_SEED,
        check_steps=0 if cheap_backward else 1,
    )
    sizes = []
    for x, y in loader:
        dp.zero_grad()
        loss = F.cross_entropy(model(x), y)
        dp.backward(loss) if cheap_backward else loss.backward()
        dp.step()
        sizes.append(len(y))
    params = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.named_parameters()
    }
    local = {
        n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
        for n, p in model.named_parameters()
    }
    torch.save({"params": params, "local": local, "sizes": sizes}, out)


def single_process(directory: Path) -> None:
    """The reference: one process, the same seeds, the whole data set."""
    torch.set_num_threads(1)
    for sigma in SIGMAS:
        sampler = PoissonBatchSampler(
            population_size=N, sampling_probability=Q, steps=STEPS, seed=SEED
        )
        ledger = PrivacyLedger(directory / f"single_{sigma}.dpl")
        train(
            small_cnn(seed=0),
            sampler,
            ledger,
            sigma,
            directory / f"single_{sigma}.pt",
            cheap_backward=False,
        )
        ledger.close()


class Centre(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0)


def _dp(model, rank: int, **kwargs) -> DPOptimizer:
    return DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        sampler=DistributedPoissonBatchSampler(
            population_size=N, sampling_probability=Q, seed=SEED
        ),
        ledger=PrivacyLedger() if rank == 0 else None,
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        **kwargs,
    )


def _model_refusals(rank: int) -> list[str]:
    refusals = []
    # The probe runs on every rank or on none: at the first forward rank 1 has one record, so
    # no rank probes (rank 0 alone would wait in FSDP2's all-gathers); at the next forward
    # every rank has three and every rank refuses the model that mixes records.
    torch.manual_seed(0)
    mixing = torch.nn.Sequential(torch.nn.Linear(4, 4), Centre(), torch.nn.Linear(4, 2)).double()
    fully_shard(mixing[0])
    fully_shard(mixing[2])
    fully_shard(mixing)
    _keep = _dp(mixing, rank)  # its hooks stay on the model
    mixing(torch.randn(3 if rank == 0 else 1, 4, dtype=torch.float64))
    try:
        mixing(torch.randn(3, 4, dtype=torch.float64))
    except RecordDependenceError:
        refusals.append("mixing")
    recurrent = fully_shard(torch.nn.Sequential(torch.nn.LSTM(4, 4)).double())
    try:
        _dp(recurrent, rank)
    except UnsupportedLayerError as err:
        refusals.append("lstm" if "LSTM" in str(err) else str(err))
    try:
        _dp(sharded_cnn(), rank, loss_fn=F.cross_entropy)
    except UnsupportedLayerError as err:
        refusals.append("loss_fn" if "loss_fn" in str(err) else str(err))
    return refusals


def _refusals(rank: int, world: int, path: Path) -> list[str]:
    refusals = _model_refusals(rank)
    try:  # hybrid sharding (a two-dimensional mesh) is refused before the first step
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
        m = sharded_cnn(mesh)
        DPOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1),
            model=m,
            sampler=DistributedPoissonBatchSampler(
                population_size=N, sampling_probability=Q, seed=SEED
            ),
            ledger=PrivacyLedger() if rank == 0 else None,
            l2_norm_bound=1.0,
            noise_multiplier=1.0,
        )
    except InvalidParameterError as err:
        refusals.append(f"hybrid:{err.parameter}")
    # Rank 1 steps on records its sampler did not draw: every rank refuses the step together
    # and nothing is recorded.
    m = sharded_cnn()
    sampler = DistributedPoissonBatchSampler(
        population_size=N, sampling_probability=Q, steps=STEPS, seed=SEED
    )
    ledger = PrivacyLedger() if rank == 0 else None
    dp = DPOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1),
        model=m,
        sampler=sampler,
        ledger=ledger,
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
    if ledger is not None:
        refusals.append(f"steps:{ledger.num_steps}")
    return refusals


def worker(rank: int, world: int, directory: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    path = Path(directory)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{path / 'rendezvous'}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),  # a rank left waiting fails instead of hanging
    )
    try:
        for sigma in SIGMAS:
            for cheap in (False, True):
                sampler = DistributedPoissonBatchSampler(
                    population_size=N, sampling_probability=Q, steps=STEPS, seed=SEED
                )
                name = f"{sigma}_{cheap}"
                ledger = PrivacyLedger(path / f"fsdp_{name}.dpl") if rank == 0 else None
                train(
                    sharded_cnn(),
                    sampler,
                    ledger,
                    sigma,
                    path / f"rank{rank}_{name}.pt",
                    cheap_backward=cheap,
                )
                if ledger is not None:
                    ledger.close()
        torch.save(_refusals(rank, world, path), path / f"refusals{rank}.pt")
        dist.barrier()  # both ranks past every collective before either tears gloo down
    finally:
        dist.destroy_process_group()
