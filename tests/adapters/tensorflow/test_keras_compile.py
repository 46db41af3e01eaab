"""Training a DPKerasModel that was not compiled names the wrapper as the model to compile."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from dpledger.adapters.tensorflow import DPKerasModel
from dpledger.errors import NotCompiledError

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _wrapped(compile_inner: bool) -> DPKerasModel:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    if compile_inner:
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)
    return DPKerasModel(
        model,
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        sampling_probability=0.1,
        population_size=100,
        seed=0,
    )


def _data():
    rng = np.random.default_rng(0)
    return rng.random((100, 4)).astype("float32"), rng.integers(0, 3, 100)


def test_fit_after_compiling_only_the_inner_model_says_to_compile_the_wrapper():
    dp = _wrapped(compile_inner=True)
    with pytest.raises(NotCompiledError, match="compile the DPKerasModel instead") as info:
        dp.fit(*_data(), epochs=1, verbose=0)
    assert "optimizer SGD, loss SparseCategoricalCrossentropy" in str(info.value)
    assert isinstance(info.value, ValueError)  # what Keras's own error is
    assert dp.ledger.num_events == 0


def test_fit_on_an_uncompiled_wrapper_says_what_to_compile():
    dp = _wrapped(compile_inner=False)
    with pytest.raises(NotCompiledError, match=r"call dp_model.compile\(optimizer=..., loss"):
        dp.fit(*_data(), epochs=1, verbose=0)


def test_the_wrapper_compiled_trains():
    dp = _wrapped(compile_inner=True)
    dp.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)
    dp.fit(*_data(), epochs=1, verbose=0)
    assert dp.ledger.num_steps == 10
