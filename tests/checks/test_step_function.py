"""The shared driver of the check-step conveniences (``StepFunctionChecks``), on a NumPy
"framework": a harness written only from the framework operations, with no PyTorch or Keras.

Oracles: a hand-written float64 DP-SGD step on a linear model (per-example gradients of the MSE
loss in closed form, clipped per example, noise N(0, (σC)² I)), which every check must pass, and
the same step with the noise divided by the batch size (Tramèr et al.'s bug), which only the
magnitude test must flag.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from dpledger.checks import Verdict
from dpledger.checks.checker import CHECK_NAMES
from dpledger.checks.step_function import StepFunctionChecks, StepFunctionHarness
from dpledger.errors import InvalidParameterError

DIM, OUTPUTS = 5, 1


class LinearModel:
    """f(x) = W x + b with parameters θ = [W, b] in one vector, changed in place by a step."""

    def __init__(self, theta: np.ndarray) -> None:
        self.theta = theta

    def forward(self, x: np.ndarray) -> np.ndarray:
        w = self.theta[: OUTPUTS * DIM].reshape(OUTPUTS, DIM)
        return x @ w.T + self.theta[OUTPUTS * DIM :]


def linear_model() -> LinearModel:
    return LinearModel(np.random.default_rng(0).normal(0.0, 0.5, OUTPUTS * (DIM + 1)))


class NumpyStepHarness(StepFunctionHarness):
    """The framework operations for :class:`LinearModel`; everything else is shared."""

    dtypes = (np.float64,)
    default_dtype = np.float64
    index_dtype = np.int64

    def _set_up(self, model_factory: Callable[[], Any], init_seed: int) -> None:
        model = model_factory()
        if not isinstance(model, LinearModel):
            raise InvalidParameterError("model_factory", model_factory, "a LinearModel")
        self._base = model

    def _base_model(self) -> Any:
        return self._base

    def _snapshot(self, model: Any) -> Any:
        return model.theta.copy()

    def _num_outputs(self) -> int:
        return OUTPUTS

    def _starting_model(self) -> Any:
        return LinearModel(self._base.theta.copy())

    def _tensor(self, array: np.ndarray, dtype: Any) -> Any:
        return np.asarray(array, dtype=dtype)

    def _flat(self, model: Any) -> np.ndarray:
        return model.theta.copy()

    def _losses(self, model: Any, x: Any, y: Any, y_array: np.ndarray) -> np.ndarray:
        return np.mean((model.forward(x) - y) ** 2, axis=1)

    def _generator(self, seed: int) -> Any:
        return np.random.default_rng(seed)

    def _before_step(self, model: Any) -> None:
        """Nothing to switch on."""

    def predict(self, x: np.ndarray) -> np.ndarray:
        return LinearModel(self._start).forward(np.asarray(x, dtype=np.float64))


def make_step(*, noise_over_batch: bool = False) -> Callable[..., None]:
    """DP-SGD on the realised batch: clip each example's gradient to C, sum, add N(0, (σC)² I)
    (or, with the bug, N(0, (σC/B)² I)), divide by B."""

    def step(model, x, y, *, l2_norm_bound, noise_multiplier, lr, generator):
        residual = (2.0 / OUTPUTS) * (model.forward(x) - y)
        grads = np.concatenate(
            [(residual[:, :, None] * x[:, None, :]).reshape(len(x), -1), residual], axis=1
        )
        norms = np.linalg.norm(grads, axis=1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            clipped = grads * np.where(norms > l2_norm_bound, l2_norm_bound / norms, 1.0)
        std = noise_multiplier * l2_norm_bound / (len(x) if noise_over_batch else 1.0)
        noise = generator.normal(0.0, std, grads.shape[1])
        model.theta -= lr * (clipped.sum(axis=0) + noise) / len(x)

    return step


CHECKS = StepFunctionChecks(NumpyStepHarness)


@pytest.mark.statistical
def test_a_correct_step_passes_every_check_through_the_shared_driver():
    report = CHECKS.assert_dp_sgd_correct(make_step(), linear_model, loss="mse", input_shape=(DIM,))
    assert report.verdicts == dict.fromkeys(CHECK_NAMES, Verdict.PASS)
    assert report.settings["dtype"] == str(np.float64)
    assert report.settings["learning_rate"] == 0.01
    assert report.settings["plain_sgd"] is True


@pytest.mark.statistical
def test_the_noise_over_batch_bug_fails_only_the_magnitude_test():
    report = CHECKS.check_dp_sgd(
        make_step(noise_over_batch=True), linear_model, loss="mse", input_shape=(DIM,)
    )
    assert set(report.failed) == {"noise_magnitude"}, report.summary()
    with pytest.raises(AssertionError, match="noise_magnitude"):
        CHECKS.assert_dp_sgd_correct(
            make_step(noise_over_batch=True), linear_model, loss="mse", input_shape=(DIM,)
        )


def test_a_stateful_check_warms_up_and_skips_the_magnitude_test():
    report = CHECKS.check_dp_optimizer(
        lambda model: make_step(),
        linear_model,
        loss="mse",
        input_shape=(DIM,),
        noise_multiplier=1.0,
        checks=("noise_magnitude",),
    )
    assert report.verdicts == {"noise_magnitude": Verdict.SKIPPED}
    assert report.settings["warmup_steps"] == 5


@pytest.mark.parametrize(
    "harness_type",
    [
        object,
        LinearModel,
        NumpyStepHarness(
            lambda model: make_step(), linear_model, input_shape=(DIM,), loss="mse", lr=0.01
        ),
    ],
)
def test_the_driver_needs_a_harness_class(harness_type):
    with pytest.raises(InvalidParameterError) as info:
        StepFunctionChecks(harness_type)
    assert info.value.parameter == "harness_type"


@pytest.mark.parametrize(
    ("module", "framework"),
    [("dpledger.checks.torch_step", "torch"), ("dpledger.checks.keras_step", "keras")],
)
def test_each_framework_exports_the_methods_of_its_one_driver(module, framework):
    pytest.importorskip(framework)
    checks = importlib.import_module(module)
    assert isinstance(checks.STEP_CHECKS, StepFunctionChecks)
    for name in ("check_dp_optimizer", "check_dp_sgd", "assert_dp_sgd_correct"):
        exported = getattr(checks, name)
        assert exported.__self__ is checks.STEP_CHECKS
        assert exported.__func__ is getattr(StepFunctionChecks, name)
