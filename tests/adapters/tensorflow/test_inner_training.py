"""Training the model inside a DPKerasModel directly warns that those steps are neither private
nor recorded; the wrapper's own steps, predict and evaluate do not warn."""

from __future__ import annotations

import logging
import warnings

import keras
import numpy as np
import pytest

from dpledger.adapters.tensorflow import DPKerasModel, PoissonDatasetSampler
from dpledger.errors import UnrecordedTrainingWarning

N = 16


def _setup() -> tuple[keras.Model, DPKerasModel, PoissonDatasetSampler, np.ndarray, np.ndarray]:
    keras.utils.set_random_seed(0)
    inner = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    inner.compile(optimizer="sgd", loss="mse")
    sampler = PoissonDatasetSampler(population_size=N, sampling_probability=0.25, seed=1)
    dp = DPKerasModel(inner, l2_norm_bound=1.0, noise_multiplier=1.0, sampler=sampler, seed=2)
    dp.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError())
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 3)).astype(np.float32)
    y = rng.normal(size=(N, 2)).astype(np.float32)
    return inner, dp, sampler, x, y


@pytest.mark.parametrize("method", ["fit", "train_on_batch", "train_step"])
def test_training_the_wrapped_model_directly_warns(method, caplog):
    inner, dp, _, x, y = _setup()
    calls = {
        "fit": lambda: inner.fit(x, y, epochs=1, verbose=0),
        "train_on_batch": lambda: inner.train_on_batch(x, y),
        "train_step": lambda: inner.train_step((x, y)),
    }
    with (
        caplog.at_level(logging.WARNING, logger="dpledger.adapters.tensorflow"),
        pytest.warns(UnrecordedTrainingWarning) as record,
    ):
        calls[method]()
    assert len(record) == 1  # once per call: fit's train_step does not warn again
    message = str(record[0].message)
    assert f"its own {method}()" in message
    assert "NOT private" in message and "NOT recorded in the ledger" in message
    assert repr(dp.name) in message
    assert any("NOT recorded in the ledger" in r.getMessage() for r in caplog.records)
    assert dp.ledger.num_steps == 0  # nothing was recorded for those steps


@pytest.mark.slow
def test_the_wrappers_own_steps_and_inference_do_not_warn():
    inner, dp, sampler, x, y = _setup()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnrecordedTrainingWarning)
        dp.fit(sampler.sample((x, y)), epochs=1, verbose=0)
        dp.train_on_batch(x[:4], y[:4])
        inner.predict(x, verbose=0)
        inner.evaluate(x, y, verbose=0)
        dp.predict(x, verbose=0)
    assert dp.ledger.num_steps == 5


def test_wrapping_twice_keeps_one_warning_naming_the_latest_wrapper():
    inner, _, sampler, x, y = _setup()
    second = DPKerasModel(
        inner, l2_norm_bound=1.0, noise_multiplier=1.0, sampler=sampler, name="second"
    )
    assert second.model is inner
    with pytest.warns(UnrecordedTrainingWarning, match="'second'") as record:
        inner.train_on_batch(x, y)
    assert len(record) == 1
