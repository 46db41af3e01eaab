"""Synthetic data for the checks: zero-gradient fillers and large-gradient points (section 3.1)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from dpledger.checks.synthetic_data import (
    check_input_shape,
    cross_entropy_residual,
    large_gradient_targets,
    make_clipping_pool,
    ordinary_batch,
    softmax,
    zero_gradient_targets,
)
from dpledger.errors import InvalidParameterError

logits = arrays(
    np.float64,
    st.tuples(st.integers(1, 6), st.integers(2, 6)),
    elements=st.floats(-20, 20, allow_nan=False),
)


def mse_output_gradient(f, y):
    """∂/∂f of (1/m)‖f − y‖² per example."""
    return 2.0 * (f - y) / f.shape[1]


def ce_output_gradient(f, y):
    """∂/∂f of −Σ y log softmax(f) per example (y one-hot or probabilities)."""
    y = np.asarray(y)
    if y.ndim == 1:
        y = np.eye(f.shape[1])[y.astype(np.int64)]
    return softmax(f) - y


@given(logits)
def test_mse_fillers_have_exactly_zero_gradient(f):
    y = zero_gradient_targets(f, loss="mse")
    assert np.array_equal(mse_output_gradient(f, y), np.zeros_like(f))


@given(logits)
def test_soft_cross_entropy_fillers_have_zero_gradient(f):
    y = zero_gradient_targets(f, loss="cross_entropy", labels="soft")
    assert np.allclose(y.sum(axis=1), 1.0)
    assert np.max(np.abs(ce_output_gradient(f, y))) < 1e-12
    assert np.max(cross_entropy_residual(f, y)) < 1e-12


@given(logits)
def test_hard_cross_entropy_fillers_have_the_stated_residual(f):
    y = zero_gradient_targets(f, loss="cross_entropy", labels="hard")
    assert y.dtype == np.int64 and np.array_equal(y, np.argmax(f, axis=1))
    p = softmax(f)
    k = np.argmax(p, axis=1)
    others = p.copy()
    others[np.arange(len(k)), k] = 0.0
    closed_form = np.sqrt((1 - p.max(axis=1)) ** 2 + (others**2).sum(axis=1))
    direct = np.linalg.norm(ce_output_gradient(f, y), axis=1)
    assert np.allclose(cross_entropy_residual(f, y), closed_form)
    assert np.allclose(direct, closed_form)
    assert np.all(closed_form > 0)  # never exactly zero


@given(logits, st.floats(1.0, 100.0))
def test_mse_large_targets_have_gradient_at_least_2a_over_m(f, a):
    y = large_gradient_targets(f, loss="mse", scale=a)
    grad = mse_output_gradient(f, y)
    assert np.all(np.abs(grad) >= 2 * a / f.shape[1] * (1 - 1e-12))


@given(logits)
@settings(max_examples=50)
def test_cross_entropy_large_target_is_the_least_likely_class(f):
    hard = large_gradient_targets(f, loss="cross_entropy", labels="hard")
    soft = large_gradient_targets(f, loss="cross_entropy", labels="soft")
    assert np.array_equal(hard, np.argmin(f, axis=1))
    assert np.array_equal(np.argmax(soft, axis=1), hard) and np.allclose(soft.sum(axis=1), 1)
    m = f.shape[1]
    norm = np.linalg.norm(ce_output_gradient(f, hard), axis=1)
    assert np.all(norm >= 1 - 1 / m - 1e-12)


def test_clipping_pool_batches_share_the_same_points():
    w = np.arange(12.0).reshape(3, 4) / 10

    def predict(x):
        return x @ w.T

    pool = make_clipping_pool(
        predict, input_shape=(4,), loss="mse", max_fillers=7, rng=np.random.default_rng(0)
    )
    assert pool.max_batch_size == 8
    x5, y5 = pool.batch(5, num_large=2)
    x8, y8 = pool.batch(8, num_large=1)
    assert x5.shape == (5, 4) and y5.shape == (5, 3)
    np.testing.assert_array_equal(x5[:3], x8[:3])  # same fillers
    np.testing.assert_array_equal(x5[3], pool.large_x[0])
    np.testing.assert_array_equal(x5[4], x8[7])  # same large point
    np.testing.assert_array_equal(y8[:7], predict(x8[:7]))  # fillers labelled by the model
    x0, _ = pool.batch(7, num_large=0)
    assert not np.any(np.all(x0 == pool.large_x[0], axis=1))
    for bad in ({"batch_size": 0}, {"batch_size": 9}, {"batch_size": 3, "num_large": 4}):
        with pytest.raises(InvalidParameterError):
            pool.batch(**{"num_large": 1, **bad})
    with pytest.raises(InvalidParameterError, match="num_large"):
        pool.batch(3, num_large=1.0)


def test_ordinary_batch_layouts():
    rng = np.random.default_rng(1)
    x, y = ordinary_batch(input_shape=(2, 3), num_outputs=4, batch_size=5, loss="mse", rng=rng)
    assert x.shape == (5, 2, 3) and y.shape == (5, 4) and y.dtype == np.float64
    _, soft = ordinary_batch(
        input_shape=(3,), num_outputs=4, batch_size=5, loss="cross_entropy", rng=rng
    )
    assert soft.shape == (5, 4) and np.allclose(soft.sum(axis=1), 1)
    _, hard = ordinary_batch(
        input_shape=(3,),
        num_outputs=4,
        batch_size=5,
        loss="cross_entropy",
        labels="hard",
        rng=rng,
    )
    assert hard.shape == (5,) and hard.dtype == np.int64 and hard.max() < 4


@pytest.mark.parametrize(
    ("call", "parameter"),
    [
        (lambda: zero_gradient_targets(np.zeros(3), loss="mse"), "predictions"),
        (lambda: zero_gradient_targets(np.full((2, 2), np.nan), loss="mse"), "predictions"),
        (lambda: zero_gradient_targets(np.zeros((2, 2)), loss="l1"), "loss"),
        (lambda: zero_gradient_targets(np.zeros((2, 1)), loss="cross_entropy"), "predictions"),
        (
            lambda: zero_gradient_targets(np.zeros((2, 2)), loss="cross_entropy", labels="x"),
            "labels",
        ),
        (lambda: large_gradient_targets(np.zeros((2, 2)), loss="mse", scale=0), "scale"),
        (
            lambda: ordinary_batch(
                input_shape=(0,),
                num_outputs=2,
                batch_size=2,
                loss="mse",
                rng=np.random.default_rng(),
            ),
            "input_shape",
        ),
        (
            lambda: ordinary_batch(
                input_shape=(2,),
                num_outputs=1,
                batch_size=2,
                loss="cross_entropy",
                rng=np.random.default_rng(),
            ),
            "num_outputs",
        ),
        (
            lambda: make_clipping_pool(
                lambda x: x,
                input_shape=(2,),
                loss="mse",
                max_fillers=0,
                rng=np.random.default_rng(),
            ),
            "max_fillers",
        ),
    ],
)
def test_bad_inputs_are_rejected(call, parameter):
    with pytest.raises(InvalidParameterError) as info:
        call()
    assert info.value.parameter == parameter


@pytest.mark.parametrize("bad", [(), (0,), (3, -1), ("a",), None, 5])
def test_input_shape_is_positive_integers_or_a_typed_error(bad) -> None:
    assert check_input_shape([1, 28, np.int64(28)]) == (1, 28, 28)
    with pytest.raises(InvalidParameterError, match="input_shape"):
        check_input_shape(bad)
