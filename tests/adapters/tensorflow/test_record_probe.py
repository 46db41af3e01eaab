"""The Keras record-independence probe: layers that mix records are refused before any step."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

from dpledger import PrivacyLedger
from dpledger.adapters.tensorflow import DPKerasModel, PrivateGradients
from dpledger.errors import RecordDependenceError, RecordMixingLayerError, RecordProbeError

B, D, C = 8, 5, 3
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")


def _model(*middle, seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((D,))
    h = keras.layers.Dense(6, activation="tanh", name="dense_in")(inputs)
    for layer in middle:
        h = layer(h)
    return keras.Model(inputs, keras.layers.Dense(C, name="head")(h))


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((B, D)).astype("float32"), rng.integers(0, C, B)


def _private(model, **kwargs):
    return PrivateGradients(
        model,
        LOSS,
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        sampling_probability=0.1,
        population_size=100,
        ledger=PrivacyLedger(),
        seed=0,
        **kwargs,
    )


MIXING = {
    "batch_mean": lambda: keras.layers.Lambda(lambda x: x - ops.mean(x, axis=0), name="centre"),
    "softmax_axis0": lambda: keras.layers.Lambda(lambda x: ops.softmax(x, axis=0), name="centre"),
}


@pytest.mark.parametrize("case", sorted(MIXING))
def test_private_gradients_refuses_a_mixing_layer_naming_it(case):
    model = _model(MIXING[case]())
    private = _private(model)
    x, y = _batch()
    with pytest.raises(RecordDependenceError, match="'centre'") as info:
        private(x, y)
    assert info.value.layer_name == "centre"  # the probe's refusal is the PyTorch adapter's one
    assert private.ledger.num_events == 0


def test_dp_keras_model_fit_refuses_a_mixing_layer_before_any_step():
    model = _model(MIXING["batch_mean"]())
    dp = DPKerasModel(
        model,
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        sampling_probability=0.1,
        population_size=100,
        seed=0,
    )
    dp.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)
    x, y = _batch()
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(B)
    with pytest.raises(RecordDependenceError, match="'centre'"):
        dp.fit(data, epochs=1, verbose=0)
    assert dp.ledger.num_events == 0


def test_batch_normalization_is_refused_structurally():
    model = _model(keras.layers.BatchNormalization())
    with pytest.raises(RecordMixingLayerError, match="BatchNormalization"):
        _private(model)


CORRECT = {
    "mlp": lambda: _model(keras.layers.Dense(4, activation="relu")),
    "layer_norm": lambda: _model(keras.layers.LayerNormalization()),
    "dropout": lambda: _model(keras.layers.Dropout(0.5, seed=3)),
    "record_wise_lambda": lambda: _model(
        keras.layers.Lambda(lambda x: x - ops.mean(x, axis=-1, keepdims=True))
    ),
}


@pytest.mark.parametrize("case", sorted(CORRECT))
def test_correct_model_passes_and_trains_as_without_the_probe(case):
    results = []
    for probe in (True, False):
        model = CORRECT[case]()
        private = _private(model, check_record_independence=probe)
        x, y = _batch()
        grads = private(x, y)
        results.append([g.numpy() for g in grads])
        assert private.ledger.num_steps == 1
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(a, b)


def test_switching_off_logs_a_warning_and_accepts_the_mixing_model(caplog):
    model = _model(MIXING["batch_mean"]())
    with caplog.at_level("WARNING"):
        private = _private(model, check_record_independence=False)
    assert "check_record_independence=False" in caplog.text
    private(*_batch())
    assert private.ledger.num_steps == 1


@pytest.mark.slow
def test_fit_with_the_probe_trains_on_the_batches_it_would_have_drawn_without_it():
    # The probe peeks at the first batch of the sampler's dataset; the sampler's generator is
    # restored, so the Poisson batches (and so the trained weights) are those of a run without
    # the probe.
    from dpledger.adapters.tensorflow import PoissonDatasetSampler

    rng = np.random.default_rng(1)
    x = rng.standard_normal((40, D)).astype("float32")
    y = rng.integers(0, C, 40)
    weights = []
    for check in (True, False):
        sampler = PoissonDatasetSampler(population_size=40, sampling_probability=0.2, seed=3)
        dp = DPKerasModel(
            _model(),
            l2_norm_bound=1.0,
            noise_multiplier=1.0,
            sampler=sampler,
            seed=0,
            check_record_independence=check,
        )
        dp.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)
        dp.fit(sampler.sample((x, y)), epochs=1, verbose=0)
        weights.append(np.concatenate([np.ravel(v) for v in dp.model.get_weights()]))
    np.testing.assert_array_equal(weights[0], weights[1])


def test_the_probe_switch_is_checked_and_switching_it_off_is_logged(caplog):
    from dpledger.adapters.tensorflow.record_probe import check_probe_switch
    from dpledger.errors import InvalidParameterError

    with caplog.at_level("WARNING", logger="dpledger.adapters.tensorflow.record_probe"):
        assert check_probe_switch(True) is True
        assert caplog.text == ""
        assert check_probe_switch(False) is False
    assert "record-independence probe is off" in caplog.text
    with pytest.raises(InvalidParameterError, match="check_record_independence"):
        check_probe_switch(1)


def _quantised(levels=16, seed=0):
    """Pixels in [0, 1) turned into token ids: an input outside [0, 1) indexes out of range."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((D,))
    ids = keras.layers.Lambda(lambda x: ops.cast(x * levels, "int32"), name="quantise")(inputs)
    h = keras.layers.Embedding(levels, 4, name="embed")(ids)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(inputs, keras.layers.Dense(C, name="head")(h))


def test_probe_perturbs_within_the_inputs_own_values():
    model = _quantised()
    private = _private(model)
    rng = np.random.default_rng(3)
    x = rng.random((B, D)).astype("float32")
    y = rng.integers(0, C, B)
    assert private.probe(x, y)
    private(x, y)
    assert private.ledger.num_steps == 1


def test_changed_probe_batch_holds_only_values_the_batch_takes():
    from dpledger.adapters.tensorflow.record_probe import _changed_record_zero

    x = tf.constant(np.random.default_rng(1).random((4, D)), dtype=tf.float32)
    y = tf.constant([2, 0, 1, 1])
    (cx, cy), other = _changed_record_zero((x, y), 4)
    assert other == 1
    np.testing.assert_array_equal(cx.numpy()[0], x.numpy()[1])
    assert int(cy[0]) == 0
    np.testing.assert_array_equal(cx.numpy()[1:], x.numpy()[1:])


def test_forward_error_in_the_probe_is_a_typed_error_naming_the_probe():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((D,))
    h = keras.layers.Lambda(lambda x: ops.reshape(x, (B, D)), name="fixed_batch")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(C, name="head")(h))
    private = _private(model)
    x, y = _batch()
    with pytest.raises(RecordProbeError, match="check_record_independence=False") as info:
        private(x, y)
    assert info.value.run == "original"
    assert "record-independence probe" in str(info.value)
    assert info.value.__cause__ is not None
    assert private.ledger.num_events == 0
