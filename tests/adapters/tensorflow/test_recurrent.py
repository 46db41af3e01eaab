"""Recurrent layers, dropout and mixed precision in the TensorFlow adapter.

Per-example gradients of LSTM / GRU / SimpleRNN (plain, stacked, Bidirectional, masked) against
one float64 ``GradientTape`` per example; DP ``fit`` of small text classifiers with a ledger;
the refused configurations; dropout; clipping under Keras's mixed-precision policies.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import keras
import numpy as np
import pytest
import tensorflow as tf

from dpledger import PrivacyLedger
from dpledger.adapters.tensorflow import (
    DPKerasModel,
    PerExampleGradientEngine,
    PoissonDatasetSampler,
    PrivateGradients,
)
from dpledger.adapters.tensorflow.dp_step import default_clip_margin
from dpledger.errors import RecordMixingLayerError, UnsupportedLayerError
from tests.adapters.tensorflow.helpers import (
    assert_close,
    per_example_gradients,
    squared_norms,
    weighted_sums,
)

BATCH, STEPS, VOCAB = 4, 5, 12
F64 = "float64"
L = keras.layers

RECURRENT_COVERED_TYPES = {
    keras.layers.LSTM: "lstm",
    keras.layers.GRU: "stacked_bidirectional_gru_masked",
    keras.layers.SimpleRNN: "simple_rnn_sequences",
}


def _loss(dtype: str = "float32") -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="none", dtype=dtype
    )


def _text(model_layers: list, *, mask_zero: bool = False, dtype: str = F64) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((STEPS,), dtype="int32"),
            L.Embedding(VOCAB, 3, mask_zero=mask_zero, dtype=dtype),
            *model_layers,
            L.Dense(2, dtype=dtype),
        ]
    )


def _ids(rng: np.random.Generator, n: int = BATCH, *, padded: bool = False) -> np.ndarray:
    ids = rng.integers(1, VOCAB, size=(n, STEPS)).astype(np.int32)
    if padded:  # right padding of different lengths, one record fully padded after step 1
        for i in range(n):
            ids[i, STEPS - (i % 3) :] = 0
        ids[0, 1:] = 0
    return ids


def case_lstm(rng):
    return _text([L.LSTM(3, dtype=F64)]), _ids(rng)


def case_gru_reset_before_backwards(rng):
    return _text([L.GRU(3, reset_after=False, go_backwards=True, dtype=F64)]), _ids(rng)


def case_simple_rnn_sequences(rng):
    layers = [
        L.SimpleRNN(3, return_sequences=True, dtype=F64),
        L.GlobalAveragePooling1D(dtype=F64),
    ]
    return _text(layers), _ids(rng)


def case_stacked_bidirectional_gru_masked(rng):
    layers = [
        L.Bidirectional(L.GRU(2, return_sequences=True, dtype=F64), dtype=F64),
        L.Bidirectional(L.GRU(2, dtype=F64), dtype=F64),
    ]
    return _text(layers, mask_zero=True), _ids(rng, padded=True)


def case_bidirectional_lstm_masked_into_lstm(rng):
    layers = [
        L.Bidirectional(L.LSTM(2, return_sequences=True, dtype=F64), dtype=F64),
        L.LSTM(2, dtype=F64),
    ]
    return _text(layers, mask_zero=True), _ids(rng, padded=True)


def case_lstm_state_into_lstm(rng):
    # An encoder's final states start a decoder: return_state and initial_state.
    ids = keras.Input((STEPS,), dtype="int32")
    h = L.Embedding(VOCAB, 3, dtype=F64)(ids)
    _, state_h, state_c = L.LSTM(2, return_state=True, dtype=F64)(h)
    out = L.LSTM(2, dtype=F64)(h, initial_state=[state_h, state_c])
    return keras.Model(ids, L.Dense(2, dtype=F64)(out)), _ids(rng)


CASES: dict[str, Callable] = {
    name[len("case_") :]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_per_example_gradients_equal_a_float64_loop(name):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    keras.utils.set_random_seed(3)
    model, x = CASES[name](rng)
    y = rng.integers(0, 2, size=BATCH).astype(np.int32)
    loss = _loss(F64)
    expected = per_example_gradients(model, loss, x, y)
    expected_sq = squared_norms(expected)
    factors = [rng.uniform(0.1, 1.0, size=BATCH) for _ in expected]
    expected_sums = weighted_sums(expected, factors)
    engine = PerExampleGradientEngine(model, loss, strategy="ghost")

    @tf.function
    def step(x, y):
        norms = engine.norms(x, y)
        return norms.squared_norms, engine.clipped_sum(
            norms, factors=[tf.constant(f, tf.float64) for f in factors]
        )

    sq, sums = step(x, y)
    assert engine.path == "ghost"
    sq_scale = max(float(np.max(e)) for e in expected_sq)
    sum_scale = max(float(np.max(np.abs(e))) for e in expected_sums)
    for j in range(len(expected)):
        assert_close(sq[j], expected_sq[j], dtype=tf.float64, scale=sq_scale)
        assert_close(sums[j], expected_sums[j], dtype=tf.float64, scale=sum_scale)
    if "masked" in name:  # the fully padded record still has gradients (its first step)
        assert np.all(np.sum(expected_sq, axis=0) > 0)


def test_recurrent_layers_without_a_rule_run_one_record_at_a_time():
    # A generic keras.layers.RNN of a cell has no fast-path rule; the vectorised path cannot
    # vectorise its while loop and runs the records in a loop instead.
    rng = np.random.default_rng(5)
    keras.utils.set_random_seed(5)
    model = _text([L.RNN(L.LSTMCell(2, dtype=F64), dtype=F64)])
    x, y = _ids(rng), rng.integers(0, 2, size=BATCH).astype(np.int32)
    expected_sq = squared_norms(per_example_gradients(model, _loss(F64), x, y))
    engine = PerExampleGradientEngine(model, _loss(F64))
    sq = tf.function(lambda x, y: engine.norms(x, y).squared_norms)(x, y)
    assert engine.path == "generic"
    scale = max(float(np.max(e)) for e in expected_sq)
    for got, want in zip(sq, expected_sq, strict=True):
        assert_close(got, want, dtype=tf.float64, scale=scale)


@pytest.mark.slow
def test_private_gradients_of_an_lstm_equal_the_clipped_per_example_loop():
    rng = np.random.default_rng(11)
    keras.utils.set_random_seed(11)
    model, x = case_bidirectional_lstm_masked_into_lstm(rng)
    x = np.concatenate([x, _ids(rng)])
    y = rng.integers(0, 2, size=len(x)).astype(np.int32)
    per_example = per_example_gradients(model, _loss(F64), x, y)
    rows = np.concatenate([g.reshape(len(x), -1) for g in per_example], axis=1)
    norms = np.linalg.norm(rows, axis=1)
    bound = float(np.median(norms))
    q, n = 0.5, 16
    private = PrivateGradients(
        model,
        _loss(F64),
        l2_norm_bound=bound,
        noise_multiplier=0.0,
        sampling_probability=q,
        population_size=n,
        seed=0,
    )
    got = np.concatenate([np.ravel(g) for g in private(x, y)]) * (q * n)
    factors = np.minimum(1.0, bound * (1 - default_clip_margin(F64)) / norms)
    np.testing.assert_allclose(got, factors @ rows, rtol=1e-10, atol=1e-12 * bound)
    assert private.engine.path == "ghost"
    assert private.ledger.num_steps == 1
    assert 0 < np.count_nonzero(norms > bound) < len(x)


def _lstm_classifier() -> keras.Model:
    keras.utils.set_random_seed(2)
    return _text(
        [L.LSTM(4, dropout=0.2, dtype="float32"), L.Dropout(0.3)],
        mask_zero=True,
        dtype="float32",
    )


def _bigru_classifier() -> keras.Model:
    keras.utils.set_random_seed(2)
    return _text(
        [
            L.Bidirectional(L.GRU(2, return_sequences=True)),
            L.Bidirectional(L.GRU(2)),
        ],
        dtype="float32",
    )


@pytest.mark.parametrize(
    ("build", "probe"),
    # the record-independence probe runs eagerly; one model with it keeps the test short
    [(_lstm_classifier, True), (_bigru_classifier, False)],
)
@pytest.mark.slow
def test_dp_fit_of_a_text_classifier_records_every_step(build, probe):
    rng = np.random.default_rng(0)
    n = 24
    x = _ids(rng, n, padded=True)
    y = (x[:, 1] > VOCAB // 2).astype(np.int32)  # the label depends on one token
    model = build()
    before = [v.numpy().copy() for v in model.trainable_variables]
    sampler = PoissonDatasetSampler(population_size=n, sampling_probability=0.25, seed=3)
    dp = DPKerasModel(
        model,
        l2_norm_bound=1.0,
        noise_multiplier=1.1,
        sampler=sampler,
        ledger=PrivacyLedger(),
        seed=1,
        check_record_independence=probe,
    )
    dp.compile(optimizer=keras.optimizers.Adam(0.01), loss=_loss(), metrics=["accuracy"])
    history = dp.fit(sampler.sample((x, y)), epochs=1, verbose=0)
    assert dp.ledger.num_steps == 4 == dp.optimizer.iterations.numpy()
    for step in dp.ledger.steps():
        assert step.sampling.sampling_probability == 0.25
        assert [(e.l2_norm_bound, e.noise_stddev) for e in step.queries] == [(1.0, 1.1)]
    assert dp.dp_step is not None and dp.dp_step.engine.path == "ghost"
    assert all(np.isfinite(history.history["loss"]))
    after = model.trainable_variables
    assert all(not np.array_equal(b, a.numpy()) for b, a in zip(before, after, strict=True))


def _refused(layer: keras.layers.Layer, **input_kwargs) -> keras.Model:
    return keras.Sequential([keras.Input(**input_kwargs), L.Embedding(VOCAB, 3), layer, L.Dense(2)])


@pytest.mark.parametrize(
    ("layer", "error", "advice"),
    [
        (lambda: L.LSTM(2, stateful=True), RecordMixingLayerError, "stateful=False"),
        (lambda: L.GRU(2, recurrent_dropout=0.2), UnsupportedLayerError, "dropout="),
        (
            lambda: L.Bidirectional(L.SimpleRNN(2, recurrent_dropout=0.1)),
            UnsupportedLayerError,
            "dropout=",
        ),
        (
            lambda: L.LSTM(2, dropout=0.2, implementation=1),
            UnsupportedLayerError,
            "implementation=2",
        ),
    ],
)
def test_unsupported_recurrent_configurations_are_refused_before_recording(layer, error, advice):
    model = _refused(layer(), batch_shape=(BATCH, STEPS), dtype="int32")
    ledger = PrivacyLedger()
    with pytest.raises(error, match=advice):
        DPKerasModel(
            model,
            l2_norm_bound=1.0,
            noise_multiplier=1.0,
            sampling_probability=0.5,
            population_size=8,
            ledger=ledger,
        )
    with pytest.raises(error, match=advice):
        PrivateGradients(
            model,
            _loss(),
            l2_norm_bound=1.0,
            noise_multiplier=1.0,
            sampling_probability=0.5,
            population_size=8,
            ledger=ledger,
        )
    assert ledger.num_steps == 0


@pytest.mark.slow
def test_dropout_per_example_gradients_are_those_of_the_same_masks():
    # In training, dropout draws an independent mask for every record; the per-example
    # gradient of record i is ∂ℓ_i/∂θ of the batch's forward with those masks. Both runs start
    # from the same seed-generator state, so they draw the same masks.
    rng = np.random.default_rng(4)
    keras.utils.set_random_seed(4)
    model = _text(
        [
            L.LSTM(3, dropout=0.4, return_sequences=True, dtype=F64),
            L.Dropout(0.5, dtype=F64),
            L.GRU(2, dropout=0.3, dtype=F64),
        ],
        mask_zero=True,
    )
    x, y = _ids(rng, padded=True), rng.integers(0, 2, size=BATCH).astype(np.int32)
    model(x)  # build
    state = [v.numpy() for v in model.non_trainable_variables]
    assert state, "the dropout seed generators keep their state in variables"
    variables = model.trainable_variables
    with tf.GradientTape(persistent=True) as tape:
        losses = _loss(F64)(y, model(x, training=True))
        per_record = [losses[i] for i in range(BATCH)]
    expected = [
        [np.asarray(tf.convert_to_tensor(g)) for g in tape.gradient(l_i, variables)]
        for l_i in per_record
    ]
    expected_sq = squared_norms([np.stack([e[j] for e in expected]) for j in range(len(variables))])
    for v, s in zip(model.non_trainable_variables, state, strict=True):
        v.assign(s)
    engine = PerExampleGradientEngine(model, _loss(F64), strategy="ghost")
    sq = tf.function(lambda x, y: engine.norms(x, y).squared_norms)(x, y)
    scale = max(float(np.max(e)) for e in expected_sq)
    for got, want in zip(sq, expected_sq, strict=True):
        assert_close(got, want, dtype=tf.float64, scale=scale)
    # the masks matter: the next batch draws other masks and the same records other gradients
    again = tf.function(lambda x, y: engine.norms(x, y).squared_norms)(x, y)
    assert not np.allclose(again[1], expected_sq[1])


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_clipped_contributions_stay_within_the_bound(policy):
    # The forward runs in float16/bfloat16; norms, factors, sums and noise in float32 or
    # higher. Every clipped per-example contribution, its norm computed in float64, is at most
    # C, and at least C·(1 − 2ρ) (clipped to C·(1 − ρ) up to float32 rounding).
    rng = np.random.default_rng(6)
    keras.utils.set_random_seed(6)
    model = keras.Sequential(
        [
            keras.Input((STEPS,), dtype="int32"),
            L.Embedding(VOCAB, 4, dtype=policy),
            L.Bidirectional(L.LSTM(3, return_sequences=True, dtype=policy), dtype=policy),
            L.GRU(3, dtype=policy),
            L.Dropout(0.2, dtype=policy),
            L.Dense(2, dtype=policy),
        ]
    )
    assert model.layers[1].compute_dtype != "float32"
    assert {v.dtype for v in model.trainable_variables} == {"float32"}
    x, y = _ids(rng, 6), rng.integers(0, 2, size=6).astype(np.int32)
    bound = 1e-2
    private = PrivateGradients(
        model,
        _loss(),
        l2_norm_bound=bound,
        noise_multiplier=0.0,
        sampling_probability=1.0,
        population_size=1,
        seed=0,
        check_record_independence=False,
    )
    unclipped = squared_norms(per_example_gradients(model, _loss(), x, y))
    assert np.all(np.sqrt(np.sum(unclipped, axis=0)) > bound)  # every record is clipped
    for i in range(len(x)):
        grads = private(x[i : i + 1], y[i : i + 1])
        assert {g.dtype for g in grads} == {tf.float32}
        norm = np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64))) for g in grads))
        assert norm <= bound
        assert norm >= bound * (1 - 2 * default_clip_margin("float32"))
    assert private.engine.path == "ghost"
