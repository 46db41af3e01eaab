"""DP training over two processes (gloo on the CPU) equals one process on the union of records.

With σ = 0 the update of every step must equal the single-process update on the union of the
ranks' batches (the acceptance test); with σ > 0 it must too, draw for draw, because rank 0 draws
the noise from the same generator state a single process would (see
``dpledger.adapters.torch.distributed``). Only rank 0 writes a ledger, and it is the
single-process ledger: one sampling event per step with the global q and n.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from dpledger import PrivacyLedger
from dpledger.adapters.torch import DistributedPoissonBatchSampler, PoissonBatchSampler
from dpledger.errors import InvalidParameterError
from dpledger.ledger import SamplingEvent
from dpledger.ledger.provenance import provenance_of
from tests.adapters.torch import distributed_worker as w


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process_on_the_union(tmp_path):
    mp.start_processes(w.worker, args=(2, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    w.single_process(tmp_path)
    for mode, sigma in w.CONFIGS:
        ranks = [torch.load(tmp_path / f"rank{r}_{mode}_{sigma}.pt") for r in range(2)]
        single = torch.load(tmp_path / f"single_{sigma}.pt")
        union_sizes = [a + b for a, b in zip(ranks[0]["sizes"], ranks[1]["sizes"], strict=True)]
        assert union_sizes == single["sizes"] and sum(union_sizes) > 0
        assert all(min(r["sizes"]) >= 0 for r in ranks)
        for mine, other, ref in zip(
            ranks[0]["params"], ranks[1]["params"], single["params"], strict=True
        ):
            assert torch.equal(mine, other)  # every rank takes the same step
            torch.testing.assert_close(mine, ref, rtol=1e-12, atol=1e-13)
        ledger = PrivacyLedger.load(tmp_path / f"{mode}_{sigma}.dpl")
        reference = PrivacyLedger.load(tmp_path / f"single_{sigma}.dpl")
        assert list(ledger.events()) == list(reference.events())
        assert [s.sampling for s in ledger.steps()] == [SamplingEvent(w.Q, w.N)] * w.STEPS
        # rank 0 wrote each step to the file before its step() returned
        assert ranks[0]["on_disk"] == list(range(1, w.STEPS + 1))
        assert ranks[1]["on_disk"] == []  # no ledger on rank 1
        (record,) = provenance_of(ledger.notes)  # rank 0 recorded where the noise came from
        assert record.state_location.startswith("rank 0's memory")
        assert (record.seeding, record.sampler_seeding) == ("caller_seed", "caller_seed")
    assert not list(tmp_path.glob("rank1*.dpl"))
    assert torch.load(tmp_path / "refusals0.pt") == [
        "sampler",
        "mixing:module.1",
        "other rank",
        "steps:0",
    ]
    assert torch.load(tmp_path / "refusals1.pt") == [
        "sampler",
        "ledger",
        "mixing:module.1",
        "no draw",
    ]


def test_ranks_share_one_poisson_sample_with_the_global_q():
    kwargs = {"population_size": 50, "sampling_probability": 0.3, "steps": 4, "seed": 8}
    single = list(PoissonBatchSampler(**kwargs))
    shards = [
        list(DistributedPoissonBatchSampler(rank=r, world_size=3, **kwargs)) for r in range(3)
    ]
    for step, whole in enumerate(single):
        parts = [shards[r][step] for r in range(3)]
        assert sorted(i for part in parts for i in part) == whole
        assert all(i % 3 == r for r, part in enumerate(parts) for i in part)
    sampler = DistributedPoissonBatchSampler(rank=1, world_size=3, **kwargs)
    assert (sampler.sampling_probability, sampler.population_size) == (0.3, 50)
    assert (sampler.rank, sampler.world_size) == (1, 3)
    with pytest.raises(InvalidParameterError, match="rank"):
        DistributedPoissonBatchSampler(rank=3, world_size=3, **kwargs)
    with pytest.raises(InvalidParameterError, match="world_size"):
        DistributedPoissonBatchSampler(rank=0, world_size=0, **kwargs)
    unseeded = {k: v for k, v in kwargs.items() if k != "seed"}
    a = DistributedPoissonBatchSampler(rank=0, world_size=1, **unseeded)
    b = DistributedPoissonBatchSampler(rank=0, world_size=1, **unseeded)
    assert not torch.equal(a.generator.get_state(), b.generator.get_state())
