"""Virtual batches: a logical step in physical chunks equals the step on the whole sample."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch.utils.data import TensorDataset

from dpledger import PrivacyLedger
from dpledger.adapters.torch import DPOptimizer, make_private, poisson_data_loader
from dpledger.adapters.torch.virtual_batches import split_batch, virtual_batches
from dpledger.errors import EngineStateError, InvalidParameterError
from tests.adapters.torch.dp_helpers import batch, small_cnn
from tests.adapters.torch.reference import DEVICES


def _dp(model, ledger, **kwargs):
    return DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.2),
        model=model,
        l2_norm_bound=1.0,
        noise_multiplier=0.8,
        ledger=ledger,
        seed=9,
        **kwargs,
    )


@pytest.mark.parametrize("device", DEVICES)
def test_chunks_with_virtual_step_equal_the_whole_logical_step(device):
    x, y = (t.to(device) for t in batch(10))
    whole, chunked = small_cnn().to(device), small_cnn().to(device)
    led_whole, led_chunked = PrivacyLedger(), PrivacyLedger()
    dp_whole = _dp(whole, led_whole, sampling_probability=0.1, population_size=100)
    dp_chunked = _dp(chunked, led_chunked, sampling_probability=0.1, population_size=100)
    for _ in range(2):
        dp_whole.zero_grad()
        F.cross_entropy(whole(x), y).backward()
        dp_whole.step()
        chunks = split_batch((x, y), max_size=3)
        assert [len(c[1]) for c in chunks] == [3, 3, 3, 1]
        for k, (xc, yc) in enumerate(chunks):
            dp_chunked.zero_grad()  # keeps the chunks already accumulated
            F.cross_entropy(chunked(xc), yc).backward()
            if k < len(chunks) - 1:
                dp_chunked.virtual_step()
                with pytest.raises(EngineStateError, match="virtual_step"):
                    dp_chunked.virtual_step()
        dp_chunked.step()
    for (n, a), b in zip(whole.named_parameters(), chunked.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13, msg=n)
    assert list(led_chunked.events()) == list(led_whole.events())
    assert led_chunked.num_steps == 2  # one sampling event per logical step


def test_virtual_batches_loader_keeps_the_loop_and_the_ledger():
    data = TensorDataset(*batch(30))
    ledgers, models = [], []
    for physical in (None, 4):
        loader = poisson_data_loader(data, sampling_probability=0.4, steps=3, seed=1)
        model = small_cnn()
        ledger = PrivacyLedger()
        dp = _dp(model, ledger, sampler=loader)
        source = (
            loader
            if physical is None
            else virtual_batches(loader, dp, max_physical_batch_size=physical)
        )
        sizes = []
        for x, y in source:
            dp.zero_grad()
            F.cross_entropy(model(x), y).backward()
            dp.step()
            sizes.append(len(y))
        if physical is not None:
            assert max(sizes) <= physical and len(sizes) > 3
        ledgers.append(ledger)
        models.append(model)
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    assert list(ledgers[0].events()) == list(ledgers[1].events())
    assert ledgers[1].num_steps == 3 and ledgers[1].runs()[0].sampling_probability == 0.4


def test_make_private_with_a_physical_batch_limit():
    data = TensorDataset(*batch(40, dtype=torch.float32))
    model = small_cnn(dtype=torch.float32)
    ledger = PrivacyLedger()
    model, dp, loader = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        sampling_probability=0.5,
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        ledger=ledger,
        seed=0,
        max_physical_batch_size=5,
    )
    chunks = 0
    for x, y in loader:
        dp.zero_grad()
        F.cross_entropy(model(x), y).backward()
        dp.step()
        chunks += 1
        assert len(y) <= 5
    assert ledger.num_steps == 2 and chunks >= 4  # default steps: round(1/q) = 2
    assert loader.batch_sampler.sampling_probability == 0.5


def test_split_batch_edge_cases():
    empty = (torch.zeros(0, 3), torch.zeros(0, dtype=torch.long))
    (only,) = split_batch(empty, max_size=4)
    assert only[0].shape == (0, 3)
    parts = split_batch({"x": torch.arange(5), "meta": "tag"}, max_size=2)
    assert [p["x"].tolist() for p in parts] == [[0, 1], [2, 3], [4]]
    assert all(p["meta"] == "tag" for p in parts)
    with pytest.raises(InvalidParameterError, match="max_size"):
        split_batch(empty, max_size=0)
    with pytest.raises(InvalidParameterError, match="batch"):
        split_batch((torch.zeros(2), torch.zeros(3)), max_size=1)
    with pytest.raises(InvalidParameterError, match="optimizer"):
        next(virtual_batches([empty], object(), max_physical_batch_size=2))
