"""Registering rules for new layer types, and the automatic fallback to the vectorised path."""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

from dpledger.adapters.tensorflow import LayerRule, PerExampleGradientEngine, register_layer_rule
from dpledger.adapters.tensorflow.layer_rules import DenseRule
from dpledger.adapters.tensorflow.registry import (
    layer_rule,
    registered_layer_types,
    unregister_layer_rule,
)
from dpledger.errors import InvalidParameterError, UnsupportedLayerError
from tests.adapters.tensorflow.helpers import (
    assert_close,
    per_example_gradients,
    squared_norms,
    weighted_sums,
)

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
ENGINE_LOGGER = "dpledger.adapters.tensorflow.engine"


class Scale(keras.layers.Layer):
    """y = x ⊙ w on the last axis: a layer type without a built-in rule."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="random_normal", name="w")

    def call(self, x):
        return x * self.w


class ScaleRule(LayerRule):
    """∂ℓ_i/∂w = Σ_positions x_i ⊙ G_i."""

    def variables(self, layer):
        return (layer.w,)

    def forward(self, layer, call, args, kwargs, tap):
        x = args[0]
        return tap(x * layer.w), x

    def squared_norms(self, layer, calls, *, batch_size):
        per_example = None
        for c in calls:
            g = c.output_gradients[0] * c.saved
            g = tf.reduce_sum(g, axis=list(range(1, g.shape.rank - 1))) if g.shape.rank > 2 else g
            per_example = g if per_example is None else per_example + g
        return (tf.reduce_sum(tf.square(per_example), axis=1),), per_example

    def weighted_sums(self, layer, residual, factors):
        return (tf.tensordot(factors[0], residual, axes=1),)


def _scale_model() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((3, 4)),
            keras.layers.Dense(4),
            Scale(),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )


def _data(rng, shape=(5, 3, 4)):
    return rng.normal(size=shape).astype(np.float32), rng.integers(0, 2, size=shape[0]).astype(
        np.int32
    )


def _check_against_loop(engine, model, x, y, rng):
    expected = per_example_gradients(model, LOSS, x, y)
    factors = [rng.uniform(0.2, 1.0, size=len(y)).astype(np.float32) for _ in expected]

    @tf.function
    def step(x, y):
        norms = engine.norms(x, y)
        return norms.squared_norms, engine.clipped_sum(norms, factors=factors)

    sq, sums = step(x, y)
    for got, want in zip(sq, squared_norms(expected), strict=True):
        assert_close(got, want, dtype=tf.float32)
    for got, want in zip(sums, weighted_sums(expected, factors), strict=True):
        assert_close(got, want, dtype=tf.float32)


def test_unregistered_layer_falls_back_and_logs_once(caplog):
    rng = np.random.default_rng(0)
    model = _scale_model()
    x, y = _data(rng)
    engine = PerExampleGradientEngine(model, LOSS)
    with caplog.at_level(logging.WARNING, logger=ENGINE_LOGGER):
        _check_against_loop(engine, model, x, y, rng)
        # Another trace (a new shape) and an eager call must not log again.
        tf.function(lambda x, y: engine.norms(x, y).squared_norms)(x[:2], y[:2])
        engine.norms(x, y)
    assert engine.path == "generic"
    messages = [r.getMessage() for r in caplog.records if r.name == ENGINE_LOGGER]
    assert len(messages) == 1
    assert "vectorised" in messages[0] and "/w" in messages[0]


def test_strategy_ghost_refuses_an_unregistered_layer_at_construction():
    with pytest.raises(UnsupportedLayerError, match=r"no fast-path rule.*/w"):
        PerExampleGradientEngine(_scale_model(), LOSS, strategy="ghost")


def test_registering_a_rule_enables_the_fast_path():
    rng = np.random.default_rng(2)
    model = _scale_model()
    x, y = _data(rng)
    register_layer_rule(Scale, ScaleRule())
    try:
        assert layer_rule(Scale) is not None and Scale in registered_layer_types()
        engine = PerExampleGradientEngine(model, LOSS, strategy="ghost")
        _check_against_loop(engine, model, x, y, rng)
        assert engine.path == "ghost"
    finally:
        unregister_layer_rule(Scale)
    assert layer_rule(Scale) is None


def test_registry_rejects_bad_registrations():
    with pytest.raises(InvalidParameterError, match="layer_type"):
        register_layer_rule(int, ScaleRule())
    with pytest.raises(InvalidParameterError, match="rule"):
        register_layer_rule(Scale, object())
    with pytest.raises(InvalidParameterError, match="replace=True"):
        register_layer_rule(keras.layers.Dense, DenseRule())
    register_layer_rule(keras.layers.Dense, layer_rule(keras.layers.Dense), replace=True)
    with pytest.raises(InvalidParameterError, match="layer_type"):
        unregister_layer_rule(Scale)


def test_subclass_of_a_registered_type_is_not_matched():
    class MyDense(keras.layers.Dense):
        def call(self, inputs, training=None):
            return super().call(inputs) * 2.0

    model = keras.Sequential([keras.Input((3,)), MyDense(2)])
    with pytest.raises(UnsupportedLayerError, match="no fast-path rule"):
        PerExampleGradientEngine(model, LOSS, strategy="ghost")


class TiedOutput(keras.Model):
    """Reads the embedding table outside the Embedding layer (weight tying)."""

    def __init__(self):
        super().__init__()
        self.embed = keras.layers.Embedding(6, 4)
        self.dense = keras.layers.Dense(4, activation="tanh")

    def call(self, ids):
        h = tf.reduce_mean(self.dense(self.embed(ids)), axis=1)
        return tf.matmul(h, self.embed.embeddings, transpose_b=True)


class FoldsTimeIntoBatch(keras.Model):
    """Runs a Dense on (B·T, d): the layer does not see the records along axis 0."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3)
        self.head = keras.layers.Dense(2)

    def call(self, x):
        folded = tf.reshape(x, [-1, x.shape[-1]])
        h = tf.reshape(self.dense(folded), [-1, x.shape[1] * 3])
        return self.head(h)


class LayerInsideCond(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return tf.cond(tf.reduce_sum(x) > 1e9, lambda: self.dense(x), lambda: self.dense(2 * x))


@pytest.mark.parametrize(
    ("model_type", "x_shape", "reason"),
    [
        (TiedOutput, None, "used outside the forward pass"),
        (FoldsTimeIntoBatch, (4, 3, 5), "leading axis of 12 for a batch of 4"),
        (LayerInsideCond, (4, 3), "nested function or control flow"),
    ],
)
def test_models_the_fast_path_cannot_see_fall_back(model_type, x_shape, reason, caplog):
    rng = np.random.default_rng(3)
    model = model_type()
    if x_shape is None:
        x = rng.integers(0, 6, size=(4, 3)).astype(np.int32)
        y = rng.integers(0, 6, size=4).astype(np.int32)
    else:
        x = rng.normal(size=x_shape).astype(np.float32)
        y = rng.integers(0, 2, size=4).astype(np.int32)
    model(x)
    with caplog.at_level(logging.WARNING, logger=ENGINE_LOGGER):
        engine = PerExampleGradientEngine(model, LOSS)
        _check_against_loop(engine, model, x, y, rng)
    assert engine.path == "generic"
    assert any(reason in r.getMessage() for r in caplog.records)

    strict = PerExampleGradientEngine(model, LOSS, strategy="ghost")
    with pytest.raises(UnsupportedLayerError, match=reason):
        tf.function(lambda x, y: strict.norms(x, y).squared_norms, autograph=False)(x, y)


class Determinant(keras.layers.Layer):
    """Uses MatrixDeterminant, which has no pfor converter."""

    def call(self, x):
        det = tf.linalg.det(tf.reshape(x[:, :4], [-1, 2, 2]))
        return x * det[:, None]


def test_vectorised_path_reports_ops_run_in_a_while_loop(caplog):
    rng = np.random.default_rng(4)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(4), Determinant(), keras.layers.Dense(2)]
    )
    x = rng.normal(size=(3, 4)).astype(np.float32)
    y = np.array([0, 1, 0], np.int32)
    with caplog.at_level(logging.WARNING, logger=ENGINE_LOGGER):
        engine = PerExampleGradientEngine(model, LOSS, strategy="generic")
        _check_against_loop(engine, model, x, y, rng)
        engine.norms(x, y)
    messages = [r.getMessage() for r in caplog.records if "tf.while_loop" in r.getMessage()]
    assert len(messages) == 1
    assert "MatrixDeterminant" in messages[0]
