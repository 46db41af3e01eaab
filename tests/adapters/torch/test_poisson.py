"""Poisson sampling: inclusion probabilities, empty batches, reproducibility, bad input."""

from __future__ import annotations

import math

import pytest
import scipy.stats
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

from dpledger.adapters.torch import (
    PerExampleGradientEngine,
    PoissonBatchSampler,
    poisson_data_loader,
)
from dpledger.errors import InvalidParameterError


@pytest.mark.statistical
def test_inclusion_frequencies_match_q():
    n, q, steps = 200, 0.1, 2000
    sampler = PoissonBatchSampler(population_size=n, sampling_probability=q, steps=steps, seed=1234)
    counts = torch.zeros(n)
    sizes = []
    both = 0
    for batch in sampler:
        assert batch == sorted(set(batch)) and all(0 <= i < n for i in batch)
        counts[batch] += 1
        sizes.append(len(batch))
        both += (0 in batch) and (1 in batch)
    total = n * steps
    # overall rate: within 4 standard errors of q
    se = math.sqrt(q * (1 - q) / total)
    assert abs(counts.sum().item() / total - q) < 4 * se
    # every record: counts ~ Binomial(steps, q); Pearson statistic ~ χ²(n) (approximately)
    mean = steps * q
    chi2 = ((counts - mean) ** 2 / (mean * (1 - q))).sum().item()
    assert scipy.stats.chi2.sf(chi2, df=n) > 1e-3
    assert scipy.stats.chi2.cdf(chi2, df=n) > 1e-3
    # batch sizes ~ Binomial(n, q): mean and variance
    sizes_t = torch.tensor(sizes, dtype=torch.float64)
    assert abs(sizes_t.mean().item() - n * q) < 4 * math.sqrt(n * q * (1 - q) / steps)
    var = n * q * (1 - q)  # the sample variance's standard error ≈ var·sqrt(2/(steps-1))
    assert abs(sizes_t.var().item() - var) < 4 * var * math.sqrt(2 / (steps - 1))
    # independence of two records: P(both) = q²
    se_pair = math.sqrt(q * q * (1 - q * q) / steps)
    assert abs(both / steps - q * q) < 4 * se_pair


def test_properties_and_default_steps():
    s = PoissonBatchSampler(population_size=50, sampling_probability=0.3, seed=0)
    assert (s.population_size, s.sampling_probability, s.steps, len(s)) == (50, 0.3, 3, 3)
    assert s.expected_batch_size == pytest.approx(15.0)
    assert len(list(s)) == 3
    assert PoissonBatchSampler(population_size=5, sampling_probability=0.6, seed=0).steps == 2
    full = PoissonBatchSampler(population_size=4, sampling_probability=1.0, seed=0)
    assert list(full) == [[0, 1, 2, 3]]


def test_reproducible_from_seed_and_resumable():
    def run(seed, epochs=2):
        s = PoissonBatchSampler(population_size=30, sampling_probability=0.2, seed=seed)
        return [list(s) for _ in range(epochs)]

    a, b, c = run(7), run(7), run(8)
    assert a == b and a != c
    assert a[0] != a[1]  # a new epoch continues the stream
    s = PoissonBatchSampler(population_size=30, sampling_probability=0.2, seed=7)
    first = list(s)
    state = s.state_dict(include_generator_state=True)  # the bit-for-bit opt-in
    second = list(s)
    s.load_state_dict(state)
    assert list(s) == second and first == a[0]
    g = torch.Generator().manual_seed(7)
    assert (
        list(PoissonBatchSampler(population_size=30, sampling_probability=0.2, generator=g))
        == (a[0])
    )


def test_empty_batches_are_correctly_shaped_tensors():
    x = torch.randn(10, 3, 2)
    y = torch.arange(10)
    loader = poisson_data_loader(TensorDataset(x, y), sampling_probability=0.02, steps=40, seed=0)
    assert loader.batch_sampler.sampling_probability == 0.02
    assert loader.batch_sampler.population_size == 10
    assert len(loader) == 40
    shapes = [(bx.shape, by.shape, bx.dtype, by.dtype) for bx, by in loader]
    empty = [s for s in shapes if s[0][0] == 0]
    assert empty and all(
        s == (torch.Size([0, 3, 2]), torch.Size([0]), torch.float32, torch.int64) for s in empty
    )
    assert any(s[0][0] > 0 for s in shapes)


def test_custom_collate_and_dict_samples():
    class Records(torch.utils.data.Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return {"x": torch.full((2,), float(i)), "id": i}

    def collate(samples):
        return {
            "x": torch.stack([s["x"] for s in samples]),
            "id": torch.tensor([s["id"] for s in samples]),
        }

    loader = poisson_data_loader(
        Records(), sampling_probability=0.2, steps=30, seed=3, collate_fn=collate
    )
    batches = list(loader)
    for b in batches:
        assert b["x"].shape == (len(b["id"]), 2)
        assert torch.equal(b["x"][:, 0], b["id"].float())
    assert any(len(b["id"]) == 0 for b in batches)


def test_loader_with_a_worker_process():
    loader = poisson_data_loader(
        TensorDataset(torch.arange(8.0)), sampling_probability=0.05, steps=6, seed=0, num_workers=1
    )
    batches = [b[0] for b in loader]
    assert len(batches) == 6 and any(b.numel() == 0 for b in batches)


def test_engine_over_poisson_batches_including_empty_ones():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    data = TensorDataset(torch.randn(12, 3), torch.randint(0, 2, (12,)))
    loader = poisson_data_loader(data, sampling_probability=0.1, steps=20, seed=5)
    engine = PerExampleGradientEngine(model, loss_reduction="sum")
    seen_empty = False
    for x, y in loader:
        F.cross_entropy(model(x), y, reduction="sum").backward()
        norms = engine.squared_norms()
        assert all(v.shape == (len(y),) for v in norms.values())
        engine.write_clipped_sum(torch.ones(len(y)))
        seen_empty |= len(y) == 0
    assert seen_empty


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        ({"population_size": 10, "sampling_probability": 0.0}, "sampling_probability"),
        ({"population_size": 10, "sampling_probability": 1.5}, "sampling_probability"),
        ({"population_size": 10, "sampling_probability": float("nan")}, "sampling_probability"),
        ({"population_size": 10, "sampling_probability": True}, "sampling_probability"),
        ({"population_size": 0, "sampling_probability": 0.1}, "population_size"),
        ({"population_size": 2.0, "sampling_probability": 0.1}, "population_size"),
        ({"population_size": 10, "sampling_probability": 0.1, "steps": 0}, "steps"),
        ({"population_size": 10, "sampling_probability": 0.1, "seed": "x"}, "seed"),
        ({"population_size": 10, "sampling_probability": 0.1, "generator": 3}, "generator"),
        (
            {
                "population_size": 10,
                "sampling_probability": 0.1,
                "seed": 1,
                "generator": torch.Generator(),
            },
            "seed",
        ),
    ],
)
def test_sampler_rejects_bad_input(kwargs, parameter):
    with pytest.raises(InvalidParameterError, match=parameter):
        PoissonBatchSampler(**kwargs)


def test_loader_rejects_what_would_replace_the_sampling():
    data = TensorDataset(torch.zeros(4))
    for key, value in (("batch_size", 2), ("shuffle", True), ("drop_last", True)):
        with pytest.raises(InvalidParameterError, match=key):
            poisson_data_loader(data, sampling_probability=0.5, **{key: value})

    class Stream(IterableDataset):
        def __iter__(self):
            yield torch.zeros(1)

    with pytest.raises(InvalidParameterError, match="dataset"):
        poisson_data_loader(Stream(), sampling_probability=0.5)
    with pytest.raises(InvalidParameterError, match="sampling_probability"):
        poisson_data_loader(data, sampling_probability=0)
