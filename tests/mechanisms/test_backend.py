"""The array backend protocol and its NumPy implementation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dpledger.errors import InvalidParameterError
from dpledger.mechanisms import ArrayBackend
from dpledger.mechanisms.backend import NumpyBackend, resolve_backend
from tests.mechanisms.conftest import exact_norm, exact_record_norms

BE = NumpyBackend()


def test_numpy_backend_satisfies_protocol() -> None:
    assert isinstance(BE, ArrayBackend)
    assert resolve_backend(None).name == "numpy"
    assert resolve_backend(BE) is BE


def test_resolve_backend_rejects_other_objects() -> None:
    with pytest.raises(InvalidParameterError, match="backend"):
        resolve_backend(object())  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_record_norms_match_exact_oracle(dtype: type) -> None:
    x = np.random.default_rng(1).normal(size=(7, 3, 5)).astype(dtype)
    got = BE.record_norms(x)
    assert got.dtype == np.float64 and got.shape == (7,)
    # float64 accumulation: the only error is float64 rounding over 15 terms
    np.testing.assert_allclose(got, exact_record_norms(x), rtol=32 * np.finfo(np.float64).eps)


def test_record_norms_adversarial_values() -> None:
    x = np.array(
        [
            [1e300, 1e300, 0.0],  # sum of squares overflows float64
            [0.0, 0.0, 0.0],
            [5e-324, 5e-324, 0.0],  # denormals
            [np.nan, 1.0, 0.0],
            [np.inf, 1.0, 0.0],
            [1.7e308, 1.7e308, 1.7e308],  # norm itself exceeds float64: inf
        ]
    )
    got = BE.record_norms(x)
    assert got[0] == pytest.approx(math.sqrt(2) * 1e300, rel=1e-15)
    assert got[1] == 0.0
    assert 0.0 <= got[2] <= 1e-323
    assert math.isnan(got[3])
    assert got[4] == math.inf
    assert got[5] == math.inf


def test_record_norms_one_dimensional_records_and_empty() -> None:
    assert BE.record_norms(np.array([3.0, -4.0])).tolist() == [3.0, 4.0]
    assert BE.record_norms(np.zeros((0, 4))).shape == (0,)
    assert BE.record_norms(np.zeros((3, 0))).tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(InvalidParameterError):
        BE.record_norms(np.float64(1.0))


def test_norm_is_overflow_safe() -> None:
    x = np.full((4, 4), 1e200)
    assert BE.norm(x) == pytest.approx(exact_norm(x), rel=1e-15)
    assert BE.norm(np.zeros(3)) == 0.0
    assert BE.norm(np.float32(3.0)) == 3.0


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_weighted_sum_and_scale_records(dtype: type) -> None:
    rng = np.random.default_rng(2)
    x = rng.normal(size=(6, 2, 3)).astype(dtype)
    f = rng.uniform(size=6)
    expected = sum(dtype(f[i]) * x[i] for i in range(6))
    got = BE.weighted_sum(x, f)
    assert got.dtype == dtype and got.shape == (2, 3)
    np.testing.assert_allclose(got, expected, rtol=20 * np.finfo(dtype).eps, atol=1e-6)
    scaled = BE.scale_records(x, f)
    assert scaled.dtype == dtype and scaled.shape == x.shape
    for i in range(6):
        np.testing.assert_array_equal(scaled[i], x[i] * dtype(f[i]))


def test_weighted_sum_of_no_records_is_zero() -> None:
    got = BE.weighted_sum(np.zeros((0, 3), dtype=np.float32), np.zeros(0))
    assert got.shape == (3,) and got.dtype == np.float32 and not got.any()


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_subnormal_factors_count_as_zero(dtype: type) -> None:
    tiny = np.finfo(dtype).tiny
    x = np.full((3, 2), np.finfo(dtype).max / 4, dtype=dtype)
    f = np.array([tiny * 0.5, tiny * 2, 0.0])
    scaled = BE.scale_records(x, f)
    assert not scaled[0].any()
    assert scaled[1].all()
    assert not scaled[2].any()


def test_scale_keeps_dtype() -> None:
    got = BE.scale(np.ones(3, dtype=np.float32), 0.5)
    assert got.dtype == np.float32 and got.tolist() == [0.5, 0.5, 0.5]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_add_gaussian_noise_draws_float64_and_rounds_once(dtype: type) -> None:
    x = np.arange(5, dtype=dtype)
    before = x.copy()
    out = BE.add_gaussian_noise(x, stddev=0.5, generator=np.random.default_rng(3))
    np.testing.assert_array_equal(x, before)  # input untouched
    assert out.dtype == dtype
    expected = (x.astype(np.float64) + 0.5 * np.random.default_rng(3).standard_normal(5)).astype(
        dtype
    )
    np.testing.assert_array_equal(out, expected)


def test_add_gaussian_noise_zero_stddev_is_identity() -> None:
    x = np.array([1.0, -2.0])
    np.testing.assert_array_equal(
        BE.add_gaussian_noise(x, stddev=0.0, generator=np.random.default_rng(0)), x
    )


def test_add_gaussian_noise_requires_a_numpy_generator() -> None:
    with pytest.raises(InvalidParameterError, match="generator"):
        BE.add_gaussian_noise(np.ones(2), stddev=1.0, generator=np.random.RandomState(0))


def test_integer_arrays_are_computed_in_float64() -> None:
    x = np.array([[3, 4], [0, 1]])
    assert BE.record_norms(x).tolist() == [5.0, 1.0]
    assert BE.weighted_sum(x, np.array([1.0, 2.0])).dtype == np.float64
    assert BE.float_info(x) == (np.finfo(np.float64).eps, np.finfo(np.float64).tiny)
    with pytest.raises(InvalidParameterError):
        BE.record_norms(np.array([["a"]]))


def test_host_round_trip() -> None:
    like = np.zeros(1, dtype=np.float32)
    arr = BE.from_host(np.array([1.5, 2.5]), like=like)
    assert arr.dtype == np.float32
    host = BE.to_host(arr)
    assert host.dtype == np.float64 and host.tolist() == [1.5, 2.5]
    assert BE.from_host(np.array(2.0), like=None).dtype == np.float64
    assert BE.shape(np.zeros((2, 3))) == (2, 3)
