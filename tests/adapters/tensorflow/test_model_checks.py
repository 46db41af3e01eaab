"""Models and arguments the engine refuses, with errors that say what to change."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from dpledger.adapters.tensorflow import DPKerasModel, PerExampleGradientEngine, PrivateGradients
from dpledger.errors import (
    DPLedgerError,
    InvalidParameterError,
    RecordMixingLayerError,
    UnsupportedLayerError,
)
from tests.adapters.tensorflow.helpers import assert_close, per_example_gradients, squared_norms

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")


def _bn_model() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.Dense(2),
        ]
    )


@pytest.mark.parametrize("strategy", ["auto", "ghost", "generic"])
def test_batch_normalization_in_training_mode_is_refused(strategy):
    with pytest.raises(RecordMixingLayerError) as info:
        PerExampleGradientEngine(_bn_model(), LOSS, strategy=strategy)
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, DPLedgerError)
    assert isinstance(err, UnsupportedLayerError)
    assert err.layer_name == "bn" and err.layer_type == "BatchNormalization"
    message = str(err)
    assert "GroupNormalization" in message and "LayerNormalization" in message
    assert "trainable = False" in message


def test_frozen_batch_normalization_runs_in_inference_mode_and_is_accepted():
    model = _bn_model()
    model.get_layer("bn").trainable = False
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 4)).astype(np.float32)
    y = np.array([0, 1, 1], np.int32)
    expected = squared_norms(per_example_gradients(model, LOSS, x, y))
    norms = PerExampleGradientEngine(model, LOSS, strategy="ghost").norms(x, y)
    for got, want in zip(norms.squared_norms, expected, strict=True):
        assert_close(got, want, dtype=tf.float32)


def test_layer_normalization_over_the_batch_axis_is_refused():
    inputs = keras.Input(batch_shape=(4, 3))
    model = keras.Model(inputs, keras.layers.LayerNormalization(axis=0, name="ln")(inputs))
    with pytest.raises(RecordMixingLayerError, match="axis 0"):
        PerExampleGradientEngine(model, LOSS)


def test_bad_constructor_arguments():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    with pytest.raises(InvalidParameterError, match="model"):
        PerExampleGradientEngine(keras.layers.Dense(2), LOSS)
    with pytest.raises(InvalidParameterError, match="strategy"):
        PerExampleGradientEngine(model, LOSS, strategy="fast")


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)


def test_an_unbuilt_model_is_refused_with_advice():
    engine = PerExampleGradientEngine(_Subclassed(), LOSS)
    with pytest.raises(InvalidParameterError, match=r"model\.build"):
        engine.norms(np.zeros((2, 3), np.float32), np.zeros(2, np.int32))
    privacy = {
        "l2_norm_bound": 1.0,
        "noise_multiplier": 1.0,
        "sampling_probability": 0.1,
        "population_size": 100,
    }
    with pytest.raises(InvalidParameterError, match=r"model\.build"):
        DPKerasModel(_Subclassed(), **privacy)
    with pytest.raises(InvalidParameterError, match=r"model\.build"):
        PrivateGradients(_Subclassed(), LOSS, **privacy)


def test_bad_factors_are_refused():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    engine = PerExampleGradientEngine(model, LOSS)
    norms = engine.norms(np.ones((3, 2), np.float32), np.zeros(3, np.int32))
    with pytest.raises(InvalidParameterError, match="factors"):
        engine.clipped_sum(norms, factors=[tf.ones(3)] * 3)
    with pytest.raises(InvalidParameterError, match="factors"):
        engine.clipped_sum(norms, factors=tf.ones((3, 1)))
