"""Independent oracles for the engine tests: one GradientTape per example."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

# Relative tolerances for comparing two float computations of the same quantity that sum
# terms in different orders: a few hundred units in the last place of the dtype (float32
# eps ≈ 1.2e-7, float64 eps ≈ 2.2e-16), enough for sums of up to ~10⁴ terms.
RTOL = {tf.float32: 2e-5, tf.float64: 1e-11}


def per_example_gradients(
    model: Any, loss: Any, x: Any, y: Any, *, sample_weight: Any = None
) -> list[np.ndarray]:
    """Per-example gradients (B, *shape) per trainable variable, each from its own tape."""
    x = tf.nest.map_structure(tf.convert_to_tensor, x)
    batch = int(tf.nest.flatten(x)[0].shape[0])
    variables = model.trainable_variables
    rows = []
    for i in range(batch):
        xi = tf.nest.map_structure(lambda t, i=i: t[i : i + 1], x)
        yi = None if y is None else y[i : i + 1]
        with tf.GradientTape() as tape:
            value = tf.reshape(loss(yi, model(xi, training=True)), [-1])
            if sample_weight is not None:
                value = value * tf.cast(sample_weight[i], value.dtype)
            value = tf.reduce_sum(value)
        grads = tape.gradient(value, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        rows.append([np.asarray(tf.convert_to_tensor(g)) for g in grads])
    return [np.stack([r[j] for r in rows]) for j in range(len(variables))]


def squared_norms(per_example: Sequence[np.ndarray]) -> list[np.ndarray]:
    """‖g_i‖² per variable from per-example gradients, accumulated in float64."""
    return [
        np.sum(np.square(g.astype(np.float64)).reshape(g.shape[0], -1), axis=1) for g in per_example
    ]


def weighted_sums(per_example: Sequence[np.ndarray], factors: Sequence[np.ndarray]):
    """Σ_i f_i g_i per variable, in float64."""
    return [
        np.tensordot(np.asarray(f, np.float64), g.astype(np.float64), axes=1)
        for g, f in zip(per_example, factors, strict=True)
    ]


def assert_close(actual: Any, expected: Any, *, dtype: tf.DType, scale: float | None = None):
    """Elementwise |a − e| < rtol·(scale + |e|), scale the largest |e| by default."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, (a.shape, e.shape)
    ref = scale if scale is not None else (float(np.max(np.abs(e))) if e.size else 0.0)
    tol = RTOL[dtype] * max(ref, np.finfo(np.float64).tiny)
    np.testing.assert_array_less(np.abs(a - e), tol + np.abs(e) * RTOL[dtype] + 1e-300)
