"""Keras 3 convenience for the DP-SGD implementation-bug checks (imports Keras / TensorFlow).

The user supplies a *step function* ::

    step(model, x, y, *, l2_norm_bound, noise_multiplier, lr, generator) -> None

that performs one DP step on the batch (x, y) in place (updating ``model.trainable_variables``),
drawing its noise N(0, (σC)² I) from ``generator``, a seeded ``tf.random.Generator``, and a
``model_factory()`` returning a fresh ``keras.Model`` whose output is the prediction (MSE) or the
logits (cross-entropy). x and y arrive as ``tf.Tensor``; y holds probabilities (soft labels) or
int64 class indices (hard labels). The API mirrors :mod:`dpledger.checks.torch_step`; both
share :mod:`dpledger.checks.step_function`.

Models are built with ``keras.config.floatx()`` set to ``dtype`` ("float64" by default, so that
one-step loss changes are resolved); per-example losses are computed in float64 from the model's
outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from dpledger.checks.step_function import StepFunctionChecks, StepFunctionHarness
from dpledger.checks.synthetic_data import LossKind, softmax
from dpledger.errors import InvalidParameterError

__all__ = [
    "STEP_CHECKS",
    "KerasStepHarness",
    "assert_dp_sgd_correct",
    "check_dp_optimizer",
    "check_dp_sgd",
]


def _per_example_loss(out: np.ndarray, y: np.ndarray, loss: LossKind) -> np.ndarray:
    f = np.asarray(out, dtype=np.float64).reshape(out.shape[0], -1)
    if loss is LossKind.MSE:
        return np.mean((f - np.asarray(y, np.float64).reshape(f.shape)) ** 2, axis=1)
    logp = np.log(np.maximum(softmax(f), 1e-300))
    yy = np.asarray(y)
    if np.issubdtype(yy.dtype, np.integer):
        return -logp[np.arange(f.shape[0]), yy.astype(np.int64)]
    return -np.sum(yy.astype(np.float64) * logp, axis=1)


class KerasStepHarness(StepFunctionHarness):
    """A :class:`~dpledger.checks.step_harness.StepHarness` for a Keras model and DP step.

    One model instance is built; every :meth:`run` restores its starting weights, builds the
    step with ``make_step(model)`` (a fresh optimiser state), replays the σ = 0 warm-up steps
    and runs the measured steps. The arguments are those of
    :class:`~dpledger.checks.step_function.StepFunctionHarness`; ``model_factory`` returns a
    ``keras.Model``, ``dtype`` is ``"float64"`` (default) or ``"float32"``, the value of
    ``keras.config.floatx()`` while the model is built, and ``init_seed`` seeds
    ``keras.utils.set_random_seed``.
    """

    dtypes = ("float32", "float64")
    default_dtype = "float64"
    index_dtype = tf.int64

    @classmethod
    def report_settings(cls, dtype: Any) -> dict[str, Any]:
        """The dtype's floatx name and ``framework: keras``."""
        return {"dtype": str(dtype), "framework": "keras"}

    def _set_up(self, model_factory: Callable[[], Any], init_seed: int) -> None:
        model = _build(model_factory, self._dtype, init_seed)
        model(np.zeros((1, *self._input_shape), dtype=self._dtype))  # build the weights
        if not model.trainable_variables:
            raise InvalidParameterError("model_factory", model_factory, "a model with weights")
        self._model = model
        self._base = [np.array(w) for w in model.get_weights()]

    def _base_model(self) -> Any:
        return self._model

    def _snapshot(self, model: Any) -> Any:
        return [np.array(w) for w in model.get_weights()]

    def _num_outputs(self) -> int:
        probe = np.zeros((1, *self._input_shape), self._dtype)
        return int(np.asarray(self._model(probe)).shape[-1])

    def _starting_model(self) -> Any:
        self._model.set_weights(self._base)
        return self._model

    def _tensor(self, array: np.ndarray, dtype: Any) -> Any:
        return tf.constant(array, dtype=dtype)

    def _flat(self, model: Any) -> np.ndarray:
        return np.concatenate([np.asarray(v).reshape(-1) for v in model.trainable_variables])

    def _losses(self, model: Any, x: Any, y: Any, y_array: np.ndarray) -> np.ndarray:
        out = np.asarray(model(x, training=False))
        return _per_example_loss(out, y_array, self._loss)

    def _generator(self, seed: int) -> Any:
        return tf.random.Generator.from_seed(seed)

    def _before_step(self, model: Any) -> None:
        """Nothing: a Keras step passes ``training=True`` to the model itself."""

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Outputs of the starting model (after warm-up)."""
        current = self._model.get_weights()
        self._model.set_weights(self._start)
        try:
            return np.asarray(self._model(self._inputs(x), training=False))
        finally:
            self._model.set_weights(current)


def _build(model_factory: Callable[[], Any], dtype: str, init_seed: int) -> Any:
    """``model_factory()`` under ``init_seed`` with ``keras.config.floatx()`` set to ``dtype``."""
    previous = keras.config.floatx()
    # Keras caches its global dtype policy from floatx the first time a layer is made, so
    # both are set (and restored) for the model to be built in ``dtype``.
    previous_policy = keras.config.dtype_policy()
    keras.config.set_floatx(dtype)
    keras.config.set_dtype_policy(dtype)
    try:
        keras.utils.set_random_seed(init_seed)
        model = model_factory()
    finally:
        keras.config.set_floatx(previous)
        keras.config.set_dtype_policy(previous_policy)
    if not isinstance(model, keras.Model):
        raise InvalidParameterError(
            "model_factory", model_factory, "a callable returning a keras.Model"
        )
    return model


STEP_CHECKS = StepFunctionChecks(KerasStepHarness)
"""The checks bound to :class:`KerasStepHarness`: ``check_dp_optimizer``, ``check_dp_sgd`` and
``assert_dp_sgd_correct`` are its methods, with the arguments of the PyTorch ones
(:mod:`dpledger.checks.torch_step`); ``dtype`` is a Keras floatx name."""

check_dp_optimizer = STEP_CHECKS.check_dp_optimizer
check_dp_sgd = STEP_CHECKS.check_dp_sgd
assert_dp_sgd_correct = STEP_CHECKS.assert_dp_sgd_correct
