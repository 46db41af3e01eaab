"""Every PyTorch DP step is tied to a draw of the sampler whose q the ledger records.

A training loop that keeps iterating its own DataLoader (``shuffle=True``, fixed-size batches)
after ``make_private`` returned a Poisson loader would otherwise have its batches recorded as
Poisson-sampled with rate q: the ledger's ε would be the wrong one, silently.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional
from torch.utils.data import DataLoader, TensorDataset

from dpledger import PrivacyLedger
from dpledger.adapters.torch import PoissonBatchSampler, make_private
from dpledger.errors import SamplerMismatchError

N = 64


def _setup(**kwargs):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(N, 5), torch.randint(0, 3, (N,)))
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    ledger = PrivacyLedger()
    training = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        sampling_probability=0.25,
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        ledger=ledger,
        seed=0,
        **kwargs,
    )
    model, optimizer, loader = training
    return data, model, optimizer, loader, ledger


def _step(model, optimizer, x, y):
    optimizer.zero_grad()
    functional.cross_entropy(model(x), y).backward()
    optimizer.step()


def test_own_shuffled_loader_is_refused_before_anything_is_recorded():
    data, model, optimizer, _, ledger = _setup()
    before = [p.detach().clone() for p in model.parameters()]
    x, y = next(iter(DataLoader(data, batch_size=16, shuffle=True)))
    with pytest.raises(SamplerMismatchError, match="drew no batch"):
        _step(model, optimizer, x, y)
    assert ledger.num_steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_batch_cut_after_sampling_is_refused():
    _, model, optimizer, loader, ledger = _setup()
    for x, y in loader:
        if len(x) >= 2:
            break
        optimizer.empty_step() if len(x) == 0 else _step(model, optimizer, x, y)
    steps = ledger.num_steps
    with pytest.raises(SamplerMismatchError, match="drew a batch of"):
        _step(model, optimizer, x[:-1], y[:-1])
    assert ledger.num_steps == steps


def test_poisson_loader_epochs_with_skips_and_abandoned_passes_train():
    _, model, optimizer, loader, ledger = _setup()
    recorded = 0
    for epoch in range(3):
        for i, (x, y) in enumerate(loader):
            if epoch == 1 and i == 2:
                break  # an abandoned pass
            if len(x) == 0:
                optimizer.empty_step()
            elif i == 1:  # a skipped batch: backward, then zero_grad without step
                functional.cross_entropy(model(x), y).backward()
                optimizer.zero_grad()
                continue
            else:
                _step(model, optimizer, x, y)
            recorded += 1
    assert ledger.num_steps == recorded > 0


def test_prefetching_workers_draw_ahead_and_steps_claim_in_order():
    _, model, optimizer, loader, ledger = _setup()
    sampler = loader.batch_sampler
    assert isinstance(sampler, PoissonBatchSampler)
    prefetching = DataLoader(
        loader.dataset,
        batch_sampler=sampler,
        collate_fn=loader.collate_fn,
        num_workers=1,
        prefetch_factor=2,
    )
    for steps, (x, y) in enumerate(prefetching, start=1):
        if len(x) == 0:
            optimizer.empty_step()
        else:
            _step(model, optimizer, x, y)
        if steps == 3:
            break
    assert ledger.num_steps == 3


def test_claim_draw_directly():
    sampler = PoissonBatchSampler(population_size=10, sampling_probability=0.5, seed=1)
    with pytest.raises(SamplerMismatchError):
        sampler.claim_draw(3)
    batch = sampler.sample()
    assert sampler.unclaimed_draws == 1
    sampler.claim_draw(len(batch))
    assert sampler.unclaimed_draws == 0
    sampler.sample()
    sampler.discard_draw()
    assert sampler.unclaimed_draws == 0
