"""DP training of a model sharded with FSDP2 over two gloo ranks equals one process.

Every layer and the root are sharded with ``fully_shard``; each step's update must equal the
single-process ``DPOptimizer`` update on the union of the ranks' batches (float64, a binding
clip bound), with σ = 0 and with σ > 0 (rank 0 draws all the noise from the generator state a
single process would, so the noise is the single-process noise, draw for draw: one
N(0, σ̃² I) vector for the whole gradient, never one stream per rank), with the user's
``loss.backward()`` and with ``optimizer.backward(loss)``. Each rank's parameter shards are its
shard of the single-process parameters; rank 0's ledger is the single-process ledger. A sampler
mismatch on one rank is refused on every rank with nothing recorded; the record-independence
probe runs on every rank together (or on none); hybrid sharding, the functional path and layers
whose rule needs the full weights after the backward are refused before the first step.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from dpledger import PrivacyLedger
from tests.adapters.torch import fsdp_worker as w


@pytest.mark.slow
def test_fsdp2_two_gloo_ranks_equal_one_process_on_the_union(tmp_path):
    mp.start_processes(w.worker, args=(2, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    w.single_process(tmp_path)
    for sigma in w.SIGMAS:
        single = torch.load(tmp_path / f"single_{sigma}.pt")
        reference = list(PrivacyLedger.load(tmp_path / f"single_{sigma}.dpl").events())
        for cheap in (False, True):
            name = f"{sigma}_{cheap}"
            ranks = [torch.load(tmp_path / f"rank{r}_{name}.pt") for r in range(2)]
            union = [a + b for a, b in zip(ranks[0]["sizes"], ranks[1]["sizes"], strict=True)]
            assert union == single["sizes"] and sum(union) > 0
            for n, ref in single["params"].items():
                assert not torch.equal(ref, w.small_cnn(seed=0).state_dict()[n])  # trained
                for r in range(2):
                    torch.testing.assert_close(ranks[r]["params"][n], ref, rtol=1e-12, atol=1e-13)
                    shard = ref.chunk(2, dim=0)[r]  # FSDP2's shard of rank r
                    torch.testing.assert_close(ranks[r]["local"][n], shard, rtol=1e-12, atol=1e-13)
            assert list(PrivacyLedger.load(tmp_path / f"fsdp_{name}.dpl").events()) == reference
    assert not list(tmp_path.glob("rank1*.dpl"))
    models = ["mixing", "lstm", "loss_fn", "hybrid:model"]
    assert torch.load(tmp_path / "refusals0.pt") == [*models, "other rank", "steps:0"]
    assert torch.load(tmp_path / "refusals1.pt") == [*models, "no draw"]
