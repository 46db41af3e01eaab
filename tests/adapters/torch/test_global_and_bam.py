"""Global clipping and BAM: different updates, the same ledger."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch.utils.data import TensorDataset

from dpledger import PrivacyLedger
from dpledger.adapters.torch import make_private
from dpledger.errors import EngineStateError
from tests.adapters.torch.dp_helpers import batch, clipped_sum, params_of, small_cnn

DATA = TensorDataset(*batch(50, seed=6))


def run(steps: int = 3, **options):
    model = small_cnn()
    ledger = PrivacyLedger()
    model, dp, loader = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.2),
        DATA,
        sampling_probability=0.2,
        l2_norm_bound=2.4,
        noise_multiplier=0.9,
        ledger=ledger,
        seed=12,
        **options,
    )
    for k, (x, y) in enumerate(loader):
        if k == steps:
            break
        dp.zero_grad()
        if "loss_fn" in options:
            dp.compute_gradients(x, y)
        else:
            F.cross_entropy(model(x), y).backward()
        dp.step()
    return params_of(model), ledger


def test_neither_global_clipping_nor_bam_changes_the_ledger():
    flat_params, flat = run()
    runs = {
        "global": run(clipping="global"),
        "functional": run(loss_fn=F.cross_entropy),
        "bam": run(loss_fn=F.cross_entropy, bam_radius=0.05),
        "bam_global": run(loss_fn=F.cross_entropy, bam_radius=0.05, clipping="global"),
    }
    for name, (_, ledger) in runs.items():
        assert list(ledger.events()) == list(flat.events()), name
        assert ledger.compressed() == flat.compressed(), name
    changed = {
        name: any(not torch.allclose(params[n], flat_params[n]) for n in params)
        for name, (params, _) in runs.items()
    }
    assert changed == {"global": True, "functional": False, "bam": True, "bam_global": True}


def _loop_bam_grads(model, x, y, radius):
    names = [n for n, _ in model.named_parameters()]
    out = {n: [] for n in names}
    for i in range(len(y)):
        params = list(model.parameters())
        loss = F.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        grads = torch.autograd.grad(loss, params)
        norm = torch.sqrt(sum(g.square().sum() for g in grads))
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p.add_(radius * g / norm)
        loss = F.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        moved = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p.sub_(radius * g / norm)
        for n, g in zip(names, moved, strict=True):
            out[n].append(g)
    return {n: torch.stack(v) for n, v in out.items()}


@pytest.mark.parametrize("clipping", ["flat", "global"])
def test_bam_step_equals_an_explicit_per_example_ascent_loop(clipping):
    from dpledger.adapters.torch import DPOptimizer

    x, y = batch(7, seed=8)
    model, ref = small_cnn(), small_cnn()
    before = params_of(model)
    radius, c, qn, lr = 0.3, 2.4, 10.0, 0.5
    dp = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr),
        model=model,
        l2_norm_bound=c,
        noise_multiplier=0.0,
        sampling_probability=0.1,
        population_size=100,
        loss_fn=F.cross_entropy,
        bam_radius=radius,
        clipping=clipping,
    )
    loss = dp.compute_gradients(x, y)
    assert loss.item() == pytest.approx(F.cross_entropy(ref(x), y).item(), rel=1e-12)
    with pytest.raises(EngineStateError, match="waiting"):
        dp.compute_gradients(x, y)
    with pytest.raises(EngineStateError, match="compute_gradients"):
        dp.backward(loss)
    dp.step()
    grads = _loop_bam_grads(ref, x, y, radius)
    norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in grads.values()))
    assert (norms < c).any() and (norms > c).any()
    want = clipped_sum(grads, [tuple(grads)], [c], rule=clipping)
    for n, p in model.named_parameters():
        torch.testing.assert_close(
            p.detach(), before[n] - lr * want[n] / qn, rtol=1e-10, atol=1e-12
        )
    hooks = DPOptimizer(
        torch.optim.SGD(ref.parameters(), lr=0.1),
        model=ref,
        l2_norm_bound=1.0,
        noise_multiplier=0.0,
        sampling_probability=0.1,
        population_size=100,
    )
    with pytest.raises(EngineStateError, match="loss_fn"):
        hooks.compute_gradients(x, y)
