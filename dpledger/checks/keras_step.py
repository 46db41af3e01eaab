"""Keras 3 convenience for the DP-SGD implementation-bug checks (the only audit module that
imports Keras / TensorFlow).

The user supplies a *step function* ::

    step(model, x, y, *, max_grad_norm, noise_multiplier, lr, generator) -> None

that performs one DP step on the batch (x, y) in place (updating ``model.trainable_variables``),
drawing its noise N(0, (σC)² I) from ``generator``, a seeded ``tf.random.Generator``, and a
``model_factory()`` returning a fresh ``keras.Model`` whose output is the prediction (MSE) or the
logits (cross-entropy). x and y arrive as ``tf.Tensor``; y holds probabilities (soft labels) or
int64 class indices (hard labels). The API mirrors :mod:`dpledger.checks.torch_step`.

Models are built with ``keras.config.floatx()`` set to ``dtype`` ("float64" by default, so that
one-step loss changes are resolved); per-example losses are computed in float64 from the model's
outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from dpledger.checks.checker import CHECK_NAMES, DPSGDChecker
from dpledger.checks.config import CheckConfig
from dpledger.checks.report import CheckReport
from dpledger.checks.step_harness import StepOutcome
from dpledger.checks.synthetic_data import LabelKind, LossKind, ordinary_batch, softmax
from dpledger.errors import InvalidParameterError
from dpledger.validation import check_positive_finite

__all__ = [
    "KerasStepHarness",
    "assert_dp_sgd_correct",
    "check_dp_optimizer",
    "check_dp_sgd",
]

StepFunction = Callable[..., Any]


def _per_example_loss(out: np.ndarray, y: np.ndarray, loss: LossKind) -> np.ndarray:
    f = np.asarray(out, dtype=np.float64).reshape(out.shape[0], -1)
    if loss is LossKind.MSE:
        return np.mean((f - np.asarray(y, np.float64).reshape(f.shape)) ** 2, axis=1)
    logp = np.log(np.maximum(softmax(f), 1e-300))
    yy = np.asarray(y)
    if np.issubdtype(yy.dtype, np.integer):
        return -logp[np.arange(f.shape[0]), yy.astype(np.int64)]
    return -np.sum(yy.astype(np.float64) * logp, axis=1)


class KerasStepHarness:
    """A :class:`~dpledger.checks.step_harness.StepHarness` for a Keras model and DP step function.

    One model instance is built; every :meth:`run` restores its starting weights, builds the
    step with ``make_step(model)`` (a fresh optimiser state), replays the σ = 0 warm-up steps
    and runs the measured steps.

    Args:
        make_step: ``make_step(model) -> step``; for a stateless step ``lambda model: step``.
        model_factory: returns a fresh ``keras.Model`` (called once, under ``init_seed``).
        input_shape: shape of one input.
        loss: ``"mse"`` or ``"cross_entropy"``.
        labels: ``"soft"`` or ``"hard"``.
        lr: learning rate passed to the step.
        dtype: ``"float64"`` or ``"float32"``: ``keras.config.floatx()`` while the model is built.
        init_seed: seed of the initialisation (``keras.utils.set_random_seed``) and warm-up batch.
        warmup_steps: σ = 0 steps before each measured step.
        warmup_clip_norm: C of the warm-up steps.
        warmup_batch_size: size of the warm-up batch.
    """

    def __init__(
        self,
        make_step: Callable[[Any], StepFunction],
        model_factory: Callable[[], Any],
        *,
        input_shape: Sequence[int],
        loss: str | LossKind,
        labels: str | LabelKind = "soft",
        lr: float,
        dtype: str = "float64",
        init_seed: int = 0,
        warmup_steps: int = 0,
        warmup_clip_norm: float = 1.0,
        warmup_batch_size: int = 8,
    ) -> None:
        if not callable(make_step):
            raise InvalidParameterError("make_step", make_step, "a callable")
        if not callable(model_factory):
            raise InvalidParameterError("model_factory", model_factory, "a callable")
        if dtype not in ("float32", "float64"):
            raise InvalidParameterError("dtype", dtype, "'float32' or 'float64'")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise InvalidParameterError("warmup_steps", warmup_steps, "an integer >= 0")
        self._make_step = make_step
        self._loss = LossKind.parse(loss)
        self._labels = LabelKind.parse(labels)
        self._lr = check_positive_finite("lr", lr)
        self._dtype = dtype
        self._input_shape = tuple(int(s) for s in input_shape)
        self._warmup_steps = warmup_steps
        self._warmup_clip = check_positive_finite("warmup_clip_norm", warmup_clip_norm)
        previous = keras.config.floatx()
        # Keras caches its global dtype policy from floatx the first time a layer is made, so
        # both are set (and restored) for the model to be built in ``dtype``.
        previous_policy = keras.config.dtype_policy()
        keras.config.set_floatx(dtype)
        keras.config.set_dtype_policy(dtype)
        try:
            keras.utils.set_random_seed(int(init_seed))
            model = model_factory()
        finally:
            keras.config.set_floatx(previous)
            keras.config.set_dtype_policy(previous_policy)
        if not isinstance(model, keras.Model):
            raise InvalidParameterError(
                "model_factory", model_factory, "a callable returning a keras.Model"
            )
        model(np.zeros((1, *self._input_shape), dtype=dtype))  # build the weights
        if not model.trainable_variables:
            raise InvalidParameterError("model_factory", model_factory, "a model with weights")
        self._model = model
        self._base = [np.array(w) for w in model.get_weights()]
        self._warm_batch: tuple[Any, Any] | None = None
        self._start = self._base
        if warmup_steps:
            num_outputs = int(np.asarray(model(np.zeros((1, *self._input_shape), dtype))).shape[-1])
            wx, wy = ordinary_batch(
                input_shape=self._input_shape,
                num_outputs=num_outputs,
                batch_size=warmup_batch_size,
                loss=self._loss,
                labels=self._labels,
                rng=np.random.default_rng([int(init_seed), 99]),
            )
            self._warm_batch = (self._x(wx), self._y(wy))
            self._fresh()
            self._start = [np.array(w) for w in model.get_weights()]

    def _x(self, x: np.ndarray) -> Any:
        return tf.constant(np.asarray(x), dtype=self._dtype)

    def _y(self, y: np.ndarray) -> Any:
        arr = np.asarray(y)
        if np.issubdtype(arr.dtype, np.integer):
            return tf.constant(arr, dtype=tf.int64)
        return tf.constant(arr, dtype=self._dtype)

    def _flat(self) -> np.ndarray:
        return np.concatenate([np.asarray(v).reshape(-1) for v in self._model.trainable_variables])

    def _fresh(self) -> StepFunction:
        self._model.set_weights(self._base)
        step = self._make_step(self._model)
        if self._warm_batch is not None:
            wx, wy = self._warm_batch
            for t in range(self._warmup_steps):
                step(
                    self._model,
                    wx,
                    wy,
                    max_grad_norm=self._warmup_clip,
                    noise_multiplier=0.0,
                    lr=self._lr,
                    generator=tf.random.Generator.from_seed(t),
                )
        return step

    def _losses(self, x: Any, y: np.ndarray) -> np.ndarray:
        out = np.asarray(self._model(x, training=False))
        return _per_example_loss(out, y, self._loss)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Outputs of the starting model (after warm-up)."""
        current = self._model.get_weights()
        self._model.set_weights(self._start)
        try:
            return np.asarray(self._model(self._x(x), training=False))
        finally:
            self._model.set_weights(current)

    def run(
        self,
        x: np.ndarray,
        y: np.ndarray,
        *,
        max_grad_norm: float,
        noise_multiplier: float,
        seed: int,
        num_steps: int = 1,
    ) -> StepOutcome:
        """Restore the start, warm up, take ``num_steps`` steps; see ``StepHarness``."""
        step = self._fresh()
        xt, yt = self._x(x), self._y(y)
        before = self._flat()
        losses_before = self._losses(xt, y)
        generator = tf.random.Generator.from_seed(int(seed))
        for _ in range(num_steps):
            step(
                self._model,
                xt,
                yt,
                max_grad_norm=max_grad_norm,
                noise_multiplier=noise_multiplier,
                lr=self._lr,
                generator=generator,
            )
        return StepOutcome(
            params_before=before,
            params_after=self._flat(),
            losses_before=losses_before,
            losses_after=self._losses(xt, y),
        )


def check_dp_optimizer(
    make_step: Callable[[Any], StepFunction],
    model_factory: Callable[[], Any],
    *,
    loss: str,
    input_shape: Sequence[int],
    labels: str = "soft",
    lr: float = 0.01,
    plain_sgd: bool = False,
    warmup_steps: int = 5,
    warmup_clip_norm: float = 1.0,
    denominator: str | float = "batch",
    noise_multiplier: float | None = None,
    dtype: str = "float64",
    seed: int = 0,
    config: CheckConfig | None = None,
    checks: Sequence[str] = CHECK_NAMES,
) -> CheckReport:
    """Check a Keras DP step whose optimiser keeps state; see
    :func:`dpledger.checks.torch_step.check_dp_optimizer` for the arguments."""
    harness = KerasStepHarness(
        make_step,
        model_factory,
        input_shape=input_shape,
        loss=loss,
        labels=labels,
        lr=lr,
        dtype=dtype,
        init_seed=seed,
        warmup_steps=warmup_steps,
        warmup_clip_norm=warmup_clip_norm,
    )
    checker = DPSGDChecker(
        harness,
        input_shape=input_shape,
        loss=loss,
        labels=labels,
        learning_rate=lr if plain_sgd else None,
        denominator=denominator,
        plain_sgd=plain_sgd,
        noise_multiplier=noise_multiplier,
        seed=seed,
        config=config,
    )
    report = checker.run(checks)
    settings = {**report.settings, "learning_rate": lr, "dtype": dtype, "framework": "keras"}
    if not plain_sgd:
        settings["warmup_steps"] = warmup_steps
    return CheckReport(results=report.results, settings=settings)


def check_dp_sgd(
    step: StepFunction,
    model_factory: Callable[[], Any],
    *,
    loss: str,
    input_shape: Sequence[int],
    labels: str = "soft",
    lr: float = 0.01,
    denominator: str | float = "batch",
    noise_multiplier: float | None = None,
    dtype: str = "float64",
    seed: int = 0,
    config: CheckConfig | None = None,
    checks: Sequence[str] = CHECK_NAMES,
) -> CheckReport:
    """Run the four checks on a plain-SGD Keras step function; arguments as in
    :func:`dpledger.checks.torch_step.check_dp_sgd` (``dtype`` is a Keras floatx name)."""
    if not callable(step):
        raise InvalidParameterError("step", step, "a callable")
    return check_dp_optimizer(
        lambda _model: step,
        model_factory,
        loss=loss,
        input_shape=input_shape,
        labels=labels,
        lr=lr,
        plain_sgd=True,
        warmup_steps=0,
        denominator=denominator,
        noise_multiplier=noise_multiplier,
        dtype=dtype,
        seed=seed,
        config=config,
        checks=checks,
    )


def assert_dp_sgd_correct(
    step: StepFunction,
    model_factory: Callable[[], Any],
    *,
    loss: str,
    input_shape: Sequence[int],
    allow_inconclusive: bool = False,
    **kwargs: Any,
) -> CheckReport:
    """Assert that a Keras DP-SGD step passes every check; fail with the report's text."""
    report = check_dp_sgd(step, model_factory, loss=loss, input_shape=input_shape, **kwargs)
    report.assert_passed(allow_inconclusive=allow_inconclusive)
    return report
