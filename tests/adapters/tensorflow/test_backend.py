"""TensorFlowBackend: the mechanisms' array protocol on tf tensors, against the NumPy backend."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from dpledger import PrivacyLedger
from dpledger.adapters.tensorflow.backend import TensorFlowBackend, make_generator
from dpledger.errors import InvalidParameterError
from dpledger.mechanisms import ArrayBackend, GaussianSumQuery, ScaledGaussianSumQuery, sampled_step
from dpledger.mechanisms.backend import NumpyBackend

BE = TensorFlowBackend()
NP = NumpyBackend()


def test_satisfies_the_protocol():
    assert isinstance(BE, ArrayBackend)
    assert BE.name == "tensorflow"


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64, tf.float16])
def test_norms_are_accumulated_in_float64(dtype):
    x = np.random.default_rng(1).normal(size=(6, 3, 4))
    t = tf.constant(x, dtype)
    exact = np.sqrt(np.sum(np.asarray(t, np.float64).reshape(6, -1) ** 2, axis=1))
    got = BE.record_norms(t)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, exact, rtol=16 * np.finfo(np.float64).eps)
    assert BE.norm(t) == pytest.approx(math.sqrt(float(np.sum(exact**2))), rel=1e-14)


def test_norm_overflow_is_rescued_and_nan_reported():
    x = tf.constant([[1e300, 1e300], [np.nan, 1.0], [np.inf, 0.0], [0.0, 0.0]], tf.float64)
    got = BE.record_norms(x)
    assert got[0] == pytest.approx(math.sqrt(2) * 1e300, rel=1e-14)
    assert math.isnan(got[1]) and got[2] == math.inf and got[3] == 0.0


def test_weighted_sum_and_scaling_match_numpy_and_zero_subnormal_factors():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(5, 3)).astype(np.float32)
    f = np.array([1.0, 0.5, 1e-40, 2.0, 0.0])  # 1e-40 is subnormal in float32: counts as 0
    got = BE.weighted_sum(tf.constant(x), f)
    assert got.dtype == tf.float32
    np.testing.assert_array_equal(np.asarray(got), NP.weighted_sum(x, f))
    np.testing.assert_array_equal(
        np.asarray(BE.scale_records(tf.constant(x), f)), NP.scale_records(x, f)
    )
    assert np.asarray(BE.scale_records(tf.constant(x), f))[2].tolist() == [0.0, 0.0, 0.0]
    np.testing.assert_array_equal(np.asarray(BE.scale(tf.constant(x), 0.25)), x * 0.25)
    assert BE.weighted_sum(tf.zeros([0, 3]), np.zeros(0)).shape == (3,)


def test_noise_is_drawn_in_float64_and_rounded_once():
    x = tf.constant(np.random.default_rng(3).normal(size=(50,)), tf.float32)
    out = BE.add_gaussian_noise(x, stddev=0.7, generator=make_generator(5))
    twin = make_generator(5).normal([50], dtype=tf.float64)
    expected = (np.asarray(x, np.float64) + 0.7 * np.asarray(twin)).astype(np.float32)
    assert out.dtype == tf.float32
    np.testing.assert_array_equal(np.asarray(out), expected)
    assert out.device == x.device


@pytest.mark.statistical
def test_noise_standard_deviation():
    # The sample standard deviation of m draws has standard error ≈ σ/√(2m); allow 4 of them.
    m, sigma = 40_000, 2.5
    noise = np.asarray(
        BE.add_gaussian_noise(tf.zeros([m]), stddev=sigma, generator=make_generator(9))
    )
    assert abs(noise.std(ddof=1) - sigma) < 4 * sigma / math.sqrt(2 * m)
    assert stats.kstest(noise / sigma, "norm").pvalue > 1e-3


def test_mechanisms_run_unchanged_on_tensors():
    rng = np.random.default_rng(4)
    records = [rng.normal(size=(9, 3, 2)), rng.normal(size=(9, 2))]
    query = ScaledGaussianSumQuery(
        l2_norm_bound=1.3, noise_stddev=0.0, scales=(1.0, 2.0), label="layer"
    )
    expected = query.run(
        records, ledger=_ledger_with_step(), generator=np.random.default_rng(0), backend=NP
    )
    ledger = PrivacyLedger()
    with sampled_step(
        ledger,
        sampling_probability=0.1,
        population_size=90,
        generator=make_generator(0),
        backend=BE,
    ) as step:
        got = step.run(query, [tf.constant(r) for r in records])
        average = step.average(got)
    for g, e, a in zip(got, expected, average, strict=True):
        assert isinstance(g, tf.Tensor)
        np.testing.assert_allclose(np.asarray(g), e, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(np.asarray(a), e / 9.0, rtol=1e-12, atol=1e-12)
    event = ledger.runs()[0]
    assert event.noise_multiplier == 0.0


def test_release_adds_noise_of_the_recorded_stddev():
    ledger = PrivacyLedger()
    query = GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=3.0, label="g")
    with sampled_step(
        ledger,
        sampling_probability=0.5,
        population_size=10,
        generator=make_generator(1),
        backend=BE,
    ) as step:
        (noised,) = step.release(query, tf.zeros([20_000], tf.float64), num_records=0)
    assert abs(float(np.std(np.asarray(noised))) - 3.0) < 4 * 3.0 / math.sqrt(2 * 20_000)
    assert [e.noise_stddev for e in next(iter(ledger.steps())).queries] == [3.0]


def _ledger_with_step() -> PrivacyLedger:
    ledger = PrivacyLedger()
    ledger.record_sample(sampling_probability=0.1, population_size=90)
    return ledger


def test_bad_inputs():
    with pytest.raises(InvalidParameterError, match="generator"):
        BE.add_gaussian_noise(tf.zeros([2]), stddev=1.0, generator=np.random.default_rng(0))
    with pytest.raises(InvalidParameterError, match="x"):
        BE.record_norms(tf.constant(1.0))
    with pytest.raises(InvalidParameterError, match="x"):
        BE.norm(tf.constant(["a"]))
    with pytest.raises(InvalidParameterError, match="seed"):
        make_generator(-1)
    assert isinstance(make_generator(None), tf.random.Generator)


def test_host_round_trip_and_integer_inputs():
    x = tf.constant([[1, 2], [3, 4]], tf.int32)
    assert BE.float_info(x) == (float(np.finfo(np.float64).eps), float(np.finfo(np.float64).tiny))
    np.testing.assert_array_equal(BE.to_host(x), [[1.0, 2.0], [3.0, 4.0]])
    like = tf.zeros([2], tf.float16)
    assert BE.from_host(np.array([1.5, 2.0]), like=like).dtype == tf.float16
    assert BE.from_host(np.array([1.5]), like=None).dtype == tf.float32
    assert BE.shape(tf.zeros([2, 3])) == (2, 3)
