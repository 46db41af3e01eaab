"""Per-example losses: which losses give one value per example, and what happens otherwise."""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

from dpledger.adapters.tensorflow import per_example_loss
from dpledger.adapters.tensorflow.losses import PerExampleLoss
from dpledger.errors import DPLedgerError, PerExampleLossError

Y_TRUE = np.array([0, 2, 1], dtype=np.int32)
LOGITS = np.array([[2.0, 0.5, -1.0], [0.1, 0.2, 3.0], [1.0, 1.0, 1.0]], dtype=np.float32)


def _reference() -> np.ndarray:
    # −log softmax(logits)[y], computed in NumPy.
    z = LOGITS.astype(np.float64)
    log_softmax = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return -log_softmax[np.arange(3), Y_TRUE]


def test_unreduced_keras_loss_is_used_as_is():
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    pel = per_example_loss(loss)
    assert pel.fn is loss
    np.testing.assert_allclose(pel(Y_TRUE, LOGITS), _reference(), rtol=1e-6)
    assert per_example_loss(pel) is pel


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum", "mean"])
def test_reducing_keras_loss_is_switched_to_none_and_logged(reduction, caplog):
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
    with caplog.at_level(logging.INFO, logger="dpledger.adapters.tensorflow.losses"):
        pel = per_example_loss(loss)
    assert pel.fn is not loss and pel.fn.reduction == "none"
    assert loss.reduction == reduction  # the user's loss is not modified
    assert any("reduction='none'" in r.getMessage() for r in caplog.records)
    np.testing.assert_allclose(pel(Y_TRUE, LOGITS), _reference(), rtol=1e-6)


def test_reducing_keras_loss_without_auto_reduction_is_refused():
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with pytest.raises(PerExampleLossError, match=r"reduction='none'") as info:
        per_example_loss(loss, auto_reduction=False)
    assert isinstance(info.value, ValueError) and isinstance(info.value, DPLedgerError)
    assert "sum_over_batch_size" in str(info.value)


def test_loss_that_cannot_be_copied_is_refused_with_advice():
    class Opaque(keras.losses.Loss):
        def __init__(self, scale):
            super().__init__(reduction="sum_over_batch_size")
            self.scale = scale

        def call(self, y_true, y_pred):
            return self.scale * tf.reduce_sum(y_pred, axis=-1)

        def get_config(self):
            return {"name": self.name}  # missing `scale`: from_config fails

    with pytest.raises(PerExampleLossError, match="could not be copied"):
        per_example_loss(Opaque(2.0))


def test_loss_names_resolve_through_keras():
    pel = per_example_loss("mean_squared_error")
    out = pel(np.zeros((3, 2), np.float32), np.ones((3, 2), np.float32))
    np.testing.assert_allclose(out, [1.0, 1.0, 1.0])
    with pytest.raises(PerExampleLossError, match="names no Keras loss"):
        per_example_loss("no_such_loss")


def test_callable_returning_a_scalar_is_refused_when_called():
    pel = per_example_loss(lambda y, p: tf.reduce_mean(p))
    with pytest.raises(PerExampleLossError, match=r"scalar.*reduction='none'"):
        pel(Y_TRUE, LOGITS)


def test_callable_with_wrong_leading_axis_is_refused():
    pel = per_example_loss(lambda y, p: tf.reduce_sum(p, axis=0))
    with pytest.raises(PerExampleLossError, match=r"leading axis must be the batch"):
        pel(Y_TRUE, LOGITS[:, :2])


def test_rank_two_losses_are_averaged_over_non_batch_axes():
    pel = PerExampleLoss(lambda y, p: tf.square(p - y), name="sq")
    y = np.zeros((2, 3), np.float32)
    p = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 3.0]], np.float32)
    np.testing.assert_allclose(pel(y, p), [14.0 / 3.0, 3.0])


def test_integer_losses_are_refused():
    pel = per_example_loss(lambda y, p: tf.cast(y, tf.int32))
    with pytest.raises(PerExampleLossError, match="floating-point"):
        pel(Y_TRUE, LOGITS)


@pytest.mark.parametrize("bad", [3, None, object()])
def test_non_losses_are_refused(bad):
    with pytest.raises(PerExampleLossError):
        per_example_loss(bad)


def test_bad_auto_reduction_is_refused():
    with pytest.raises(ValueError, match="auto_reduction"):
        per_example_loss("mse", auto_reduction="yes")
