"""Hand-written Keras/TensorFlow DP-SGD steps (correct and deliberately buggy) for the tests.

Per-example gradients come from one ``tf.GradientTape`` per example; clipping is flat; the noise
N(0, (σC)² I) is drawn from the ``tf.random.Generator`` the checks pass in.
"""

from __future__ import annotations

import keras
import tensorflow as tf

__all__ = ["BUGS", "keras_mlp", "make_keras_dp_sgd_step"]

BUGS = {
    None: "correct DP-SGD",
    "no_clip": "no clipping",
    "clip_mean": "clips the batch-mean gradient instead of each example's",
    "uncalibrated": "noise N(0, σ²) instead of N(0, (σC)²)",
    "noise_over_batch": "noise standard deviation σC/B",
}


def keras_mlp(n_in: int = 10, n_out: int = 3, hidden: int = 16) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((n_in,)),
            keras.layers.Dense(hidden, activation="tanh"),
            keras.layers.Dense(n_out),
        ]
    )


def _per_example(loss: str, y: tf.Tensor, out: tf.Tensor) -> tf.Tensor:
    if loss == "mse":
        return tf.reduce_mean(tf.square(out - y), axis=-1)
    if y.dtype.is_integer:
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=out)
    return tf.nn.softmax_cross_entropy_with_logits(labels=y, logits=out)


def make_keras_dp_sgd_step(*, loss: str = "mse", bug: str | None = None, denominator=None):
    """A plain DP-SGD step with the protocol of ``keras_step.check_dp_sgd``."""
    assert bug in BUGS

    def step(model, x, y, *, l2_norm_bound, noise_multiplier, lr, generator):
        variables = model.trainable_variables
        rows = []
        for i in range(int(x.shape[0])):
            with tf.GradientTape() as tape:
                value = tf.reduce_mean(_per_example(loss, y[i : i + 1], model(x[i : i + 1])))
            grads = tape.gradient(value, variables)
            rows.append(tf.concat([tf.reshape(g, [-1]) for g in grads], 0))
        flat = tf.stack(rows)
        b = flat.shape[0]
        d = float(b if denominator is None else denominator)
        c, s = float(l2_norm_bound), float(noise_multiplier)
        std = {"uncalibrated": s, "noise_over_batch": s * c / b}.get(bug, s * c)
        noise = generator.normal([flat.shape[1]], dtype=flat.dtype) * std
        if bug == "no_clip":
            update = (tf.reduce_sum(flat, 0) + noise) / d
        elif bug == "clip_mean":
            update = tf.clip_by_norm(tf.reduce_sum(flat, 0) / d, c) + noise / d
        else:
            norms = tf.norm(flat, axis=1, keepdims=True)
            factor = tf.minimum(1.0, c / tf.maximum(norms, 1e-12))
            update = (tf.reduce_sum(flat * tf.cast(factor, flat.dtype), 0) + noise) / d
        start = 0
        for v in variables:
            n = int(tf.size(v))
            v.assign_sub(lr * tf.reshape(update[start : start + n], v.shape))
            start += n

    return step
