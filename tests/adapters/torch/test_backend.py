"""TorchBackend: the ArrayBackend protocol on tensors, checked against the NumPy backend."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dpledger import PrivacyLedger
from dpledger.adapters.torch.backend import TorchBackend
from dpledger.errors import InvalidParameterError
from dpledger.mechanisms import ArrayBackend, GaussianSumQuery, ScaledGaussianSumQuery
from dpledger.mechanisms.backend import NumpyBackend

BE = TorchBackend()
NP = NumpyBackend()


def test_satisfies_the_protocol():
    assert isinstance(BE, ArrayBackend) and BE.name == "torch"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_norms_accumulate_in_float64_like_numpy(dtype):
    x = torch.randn(6, 3, 4, generator=torch.Generator().manual_seed(0)).to(dtype)
    as_np = x.to(torch.float64).numpy()
    got = BE.record_norms(x)
    assert got.dtype == np.float64 and got.shape == (6,)
    np.testing.assert_allclose(got, NP.record_norms(as_np), rtol=1e-14)
    assert BE.norm(x) == pytest.approx(NP.norm(as_np), rel=1e-14)
    assert BE.shape(x) == (6, 3, 4)
    assert BE.float_info(x) == (torch.finfo(dtype).eps, torch.finfo(dtype).tiny)


def test_norms_of_extreme_records():
    x = torch.tensor(
        [
            [1e300, 1e300, 0.0],  # the float64 sum of squares overflows: rescaled
            [0.0, 0.0, 0.0],
            [math.nan, 1.0, 0.0],
            [math.inf, 1.0, 0.0],
        ],
        dtype=torch.float64,
    )
    got = BE.record_norms(x)
    assert got[0] == pytest.approx(math.sqrt(2) * 1e300, rel=1e-15)
    assert got[1] == 0.0 and math.isnan(got[2]) and got[3] == math.inf
    assert BE.norm(x[:1]) == pytest.approx(math.sqrt(2) * 1e300, rel=1e-15)
    assert BE.record_norms(torch.zeros(0, 3)).shape == (0,)
    assert BE.record_norms(torch.zeros(2, 0)).tolist() == [0.0, 0.0]
    with pytest.raises(InvalidParameterError, match="x"):
        BE.record_norms(torch.tensor(1.0))


def test_factors_are_rounded_to_the_dtype_and_subnormal_ones_are_zero():
    x = torch.ones(3, 2, dtype=torch.float32)
    factors = np.array([1e-39, 2.0, 0.5])  # 1e-39 is subnormal in float32
    out = BE.weighted_sum(x, factors)
    assert out.dtype == torch.float32 and out.tolist() == [2.5, 2.5]
    scaled = BE.scale_records(x, factors)
    assert scaled[0].tolist() == [0.0, 0.0] and scaled[1].tolist() == [2.0, 2.0]
    np.testing.assert_array_equal(out.numpy(), NP.weighted_sum(x.numpy(), factors))
    empty = BE.weighted_sum(torch.zeros(0, 2, 3), np.zeros(0))
    assert empty.shape == (2, 3) and not empty.any()
    assert BE.scale(x, 0.25).tolist() == [[0.25, 0.25]] * 3
    assert BE.weighted_sum(torch.ones(2, 2, dtype=torch.int64), np.ones(2)).dtype == torch.float32


def test_noise_is_drawn_in_float64_on_the_device_and_rounded_once():
    x = torch.full((5000,), 0.1, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    out = BE.add_gaussian_noise(x, stddev=0.5, generator=g)
    assert out.dtype == torch.float32 and out.device == x.device
    expected = torch.randn(5000, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    expected = (expected * 0.5 + x.double()).float()
    assert torch.equal(out, expected)
    assert torch.equal(x, torch.full((5000,), 0.1))  # input untouched
    again = BE.add_gaussian_noise(x, stddev=0.5, generator=torch.Generator().manual_seed(7))
    assert torch.equal(out, again)
    state = g.get_state()
    assert torch.equal(BE.add_gaussian_noise(x, stddev=0.0, generator=g), x)
    assert torch.equal(g.get_state(), state)  # σ̃ = 0 draws nothing


def test_noise_generator_must_be_a_torch_generator_on_the_tensor_device():
    with pytest.raises(InvalidParameterError, match="generator"):
        BE.add_gaussian_noise(torch.zeros(2), stddev=1.0, generator=np.random.default_rng())
    meta = torch.zeros(2, device="meta")
    with pytest.raises(InvalidParameterError, match="device"):
        BE.add_gaussian_noise(meta, stddev=1.0, generator=torch.Generator())


def test_host_round_trip_keeps_dtype_and_device():
    like = torch.zeros(3, dtype=torch.float16)
    back = BE.from_host(np.array([1.5, 2.0, -3.0]), like=like)
    assert back.dtype == torch.float16 and back.tolist() == [1.5, 2.0, -3.0]
    host = BE.to_host(back)
    assert host.dtype == np.float64 and host.tolist() == [1.5, 2.0, -3.0]
    assert BE.from_host(np.ones(2), like=None).dtype == torch.get_default_dtype()


def test_a_sum_query_runs_on_tensors_as_on_arrays():
    records = torch.randn(9, 4, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for query in (
        GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=0.0, label="w"),
        ScaledGaussianSumQuery(l2_norm_bound=1.0, noise_stddev=0.0, scales=(1.0, 3.0)),
    ):
        members = [records, records[:, 0]] if isinstance(query, ScaledGaussianSumQuery) else records
        np_members = [m.numpy() for m in members] if isinstance(members, list) else members.numpy()
        ledger_t, ledger_n = PrivacyLedger(), PrivacyLedger()
        for led in (ledger_t, ledger_n):
            led.record_sample(sampling_probability=0.1, population_size=90)
        got = query.run(members, ledger=ledger_t, generator=torch.Generator(), backend=BE)
        want = query.run(np_members, ledger=ledger_n, generator=np.random.default_rng(), backend=NP)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a.numpy(), b, rtol=1e-12, atol=1e-14)
        assert list(ledger_t.events()) == list(ledger_n.events())


def test_batched_noise_is_one_float64_draw_over_the_concatenation():
    backend = TorchBackend()
    xs = [torch.ones(3, 2), torch.zeros(5), torch.full((4,), 2.0)]
    out = backend.add_gaussian_noise_many(
        xs, stddevs=[0.5, 0.0, 3.0], generator=torch.Generator().manual_seed(3)
    )
    z = torch.randn(10, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert [t.dtype for t in out] == [torch.float32] * 3
    assert torch.equal(out[0], (1.0 + 0.5 * z[:6]).to(torch.float32).view(3, 2))
    assert torch.equal(out[1], xs[1])  # σ = 0 draws nothing
    assert torch.equal(out[2], (2.0 + 3.0 * z[6:]).to(torch.float32))
    norms = backend.norms(
        [torch.full((4,), 3.0), torch.zeros(0), torch.tensor([1e200, 1e200], dtype=torch.float64)]
    )
    assert norms.dtype == np.float64 and list(norms[:2]) == [6.0, 0.0]
    assert norms[2] == pytest.approx(math.sqrt(2) * 1e200, rel=1e-15)  # overflow-safe
    scaled = backend.scale_many(xs, 0.5)
    assert all(torch.equal(s, x * 0.5) for s, x in zip(scaled, xs, strict=True))


def test_a_subclass_that_changes_the_one_array_noise_keeps_it_when_batched():
    class Halved(TorchBackend):
        def add_gaussian_noise(self, x, *, stddev, generator):
            return super().add_gaussian_noise(x, stddev=stddev / 2, generator=generator)

    xs = [torch.zeros(20, dtype=torch.float64), torch.zeros(30, dtype=torch.float64)]
    got = Halved().add_gaussian_noise_many(
        xs, stddevs=[2.0, 2.0], generator=torch.Generator().manual_seed(0)
    )
    gen = torch.Generator().manual_seed(0)
    want = [TorchBackend().add_gaussian_noise(x, stddev=1.0, generator=gen) for x in xs]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
