"""The Keras 3 convenience on hand-written TensorFlow DP-SGD steps."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from dpledger.checks import CheckConfig, Verdict  # noqa: E402
from dpledger.checks.checker import CHECK_NAMES  # noqa: E402
from dpledger.checks.keras_step import (  # noqa: E402
    KerasStepHarness,
    assert_dp_sgd_correct,
    check_dp_sgd,
)
from dpledger.errors import InvalidParameterError  # noqa: E402
from tests.checks.keras_steps import keras_mlp, make_keras_dp_sgd_step  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.statistical]


# the per-example loop of the reference step is slow in eager TensorFlow: smaller grids
LIGHT = CheckConfig(batch_sizes=(1, 2, 4, 8, 16), large_counts=(1, 2, 4, 8))


def factory():
    return keras_mlp(10, 3)


def test_correct_keras_step_passes_every_check():
    report = assert_dp_sgd_correct(
        make_keras_dp_sgd_step(loss="mse"),
        factory,
        loss="mse",
        input_shape=(10,),
        config=LIGHT,
    )
    assert report.verdicts == dict.fromkeys(CHECK_NAMES, Verdict.PASS)
    assert report.settings["framework"] == "keras"


def test_buggy_keras_step_is_flagged():
    report = check_dp_sgd(
        make_keras_dp_sgd_step(loss="cross_entropy", bug="noise_over_batch"),
        factory,
        loss="cross_entropy",
        input_shape=(10,),
        config=LIGHT,
    )
    assert set(report.failed) == {"noise_magnitude"}, report.summary()


def test_keras_harness_restores_the_start_and_keeps_floatx():
    before = keras.config.floatx()
    harness = KerasStepHarness(
        lambda m: make_keras_dp_sgd_step(), factory, input_shape=(10,), loss="mse", lr=0.1
    )
    assert keras.config.floatx() == before
    x = np.random.default_rng(0).standard_normal((4, 10))
    y = harness.predict(x)
    assert y.dtype == np.float64
    a = harness.run(x, y + 1.0, l2_norm_bound=1.0, noise_multiplier=1.0, seed=3)
    b = harness.run(x, y + 1.0, l2_norm_bound=1.0, noise_multiplier=1.0, seed=3)
    np.testing.assert_array_equal(a.params_after, b.params_after)
    np.testing.assert_array_equal(harness.predict(x), y)
    with pytest.raises(InvalidParameterError, match="dtype"):
        KerasStepHarness(
            lambda m: None, factory, input_shape=(10,), loss="mse", lr=0.1, dtype="float16"
        )
