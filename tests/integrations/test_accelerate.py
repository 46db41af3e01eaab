"""Accelerate without the Trainer: ``Accelerator.prepare_model`` with dpledger's loader and
optimizer records the same ledger, and takes the same steps, as the plain loop
(docs/how-to/fine-tune-hf-trainer.md, "Accelerate without the Trainer")."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from torch import nn
from torch.nn import functional
from torch.utils.data import TensorDataset

from dpledger.adapters.torch import make_private


def _data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 5, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _train(accelerator: Accelerator | None, steps: int = 4):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))
    model, optimizer, loader = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        _data(),
        sampling_probability=0.125,
        l2_norm_bound=1.0,
        noise_multiplier=1.1,
        seed=3,
    )
    device = torch.device("cpu")
    if accelerator is not None:
        # the model only: the recorded sampler must draw the batches (prepare on the loader
        # would re-shard them) and the DPOptimizer reduces over ranks itself
        model = accelerator.prepare_model(model)
        device = accelerator.device
    taken = 0
    while taken < steps:
        for x, y in loader:
            optimizer.zero_grad()
            loss = functional.cross_entropy(model(x.to(device)), y.to(device))
            if accelerator is not None:
                accelerator.backward(loss)
            else:
                loss.backward()
            optimizer.step()
            taken += 1
            if taken == steps:
                break
    ledger = optimizer.ledger
    events = [
        (
            s.sampling_probability,
            s.population_size,
            [(q.l2_norm_bound, q.noise_stddev) for q in s.queries],
        )
        for s in ledger.steps()
    ]
    return events, [p.detach().clone() for p in model.parameters()]


def test_accelerate_records_the_same_ledger_as_the_plain_loop():
    plain_events, plain_params = _train(None)
    accelerated_events, accelerated_params = _train(Accelerator(cpu=True))
    assert len(plain_events) == 4
    assert accelerated_events == plain_events
    for a, b in zip(accelerated_params, plain_params, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
