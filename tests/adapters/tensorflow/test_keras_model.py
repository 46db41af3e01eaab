"""DPKerasModel: DP training through compile/fit, one ledger step per executed step."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from dpledger import PrivacyLedger
from dpledger.adapters.tensorflow import (
    DPKerasModel,
    PoissonDatasetSampler,
    ShuffleDatasetSampler,
    make_private,
)
from dpledger.checks.keras_step import assert_dp_sgd_correct
from dpledger.errors import (
    InvalidParameterError,
    PerExampleLossError,
    RecordMixingLayerError,
    SamplerMismatchError,
    UnsupportedLayerError,
)
from tests.checks.keras_steps import keras_mlp

HUGE = 1e30


def _model(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((6, 6, 1)),
            keras.layers.Conv2D(3, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(4, activation="tanh"),
            keras.layers.Dense(3),
        ]
    )


def _data(n: int = 60, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 6, 6, 1)).astype(np.float32), rng.integers(0, 3, n).astype(np.int32)


def _loss(reduction: str = "sum_over_batch_size") -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)


@pytest.mark.slow
@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_fit_records_one_sampling_event_per_executed_step(steps_per_execution):
    x, y = _data(20)
    sampler = PoissonDatasetSampler(population_size=20, sampling_probability=0.1, seed=4)
    dp = DPKerasModel(_model(), l2_norm_bound=1.0, noise_multiplier=1.0, sampler=sampler, seed=1)
    dp.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=_loss(),
        metrics=["accuracy"],
        steps_per_execution=steps_per_execution,
    )
    history = dp.fit(sampler.sample((x, y)), epochs=3, shuffle=False, verbose=0)
    # 10 steps per epoch, batches of Binomial(20, 0.1) records
    assert dp.optimizer.iterations.numpy() == 30
    assert dp.ledger.num_steps == 30
    for step in dp.ledger.steps():
        assert step.sampling.sampling_probability == 0.1
        assert step.sampling.population_size == 20
        assert [(e.l2_norm_bound, e.noise_stddev) for e in step.queries] == [(1.0, 1.0)]
    assert set(history.history) == {"loss", "accuracy"}
    # the batches fit saw (a sampler with the same seed repeats them) had varying sizes,
    # empty ones included, and every one was a step
    twin = PoissonDatasetSampler(population_size=20, sampling_probability=0.1, seed=4)
    sizes = [int(b[0].shape[0]) for _ in range(3) for b in twin.sample((x, y))]
    assert len(sizes) == 30 and min(sizes) == 0 and len(set(sizes)) >= 3
    # a second fit continues the same ledger
    dp.fit(sampler.sample((x, y)), epochs=1, shuffle=False, verbose=0)
    assert dp.ledger.num_steps == 40 == dp.optimizer.iterations.numpy()


def test_train_on_batch_with_sigma_zero_is_the_non_private_sgd_step():
    x, y = _data(9)
    model = _model()
    reference = _model()
    q, n = 0.05, 100  # q·n = 5, not the batch size: the denominator is fixed
    dp = DPKerasModel(
        model, l2_norm_bound=HUGE, noise_multiplier=0.0, sampling_probability=q, population_size=n
    )
    dp.compile(optimizer=keras.optimizers.SGD(0.3), loss=_loss())
    with tf.GradientTape() as tape:
        total = tf.reduce_sum(_loss("none")(y, reference(x, training=True)))
    grads = tape.gradient(total, reference.trainable_variables)
    dp.train_on_batch(x, y)
    for v, r, g in zip(
        model.trainable_variables, reference.trainable_variables, grads, strict=True
    ):
        expected = np.asarray(r) - 0.3 * np.asarray(g) / (q * n)
        np.testing.assert_allclose(np.asarray(v), expected, rtol=1e-5, atol=1e-6)
    assert dp.ledger.num_steps == 1


@pytest.mark.slow
def test_wrapped_adam_and_adamw_take_their_own_steps_on_private_gradients():
    x, y = _data(12)
    for optimizer in (keras.optimizers.Adam(0.01), keras.optimizers.AdamW(0.01)):
        model = _model()
        before = [np.asarray(v).copy() for v in model.trainable_variables]
        dp = make_private(
            model,
            l2_norm_bound=1.0,
            noise_multiplier=0.5,
            sampling_probability=0.2,
            population_size=60,
            seed=3,
        )
        dp.compile(optimizer=optimizer, loss=_loss())
        dp.train_on_batch(x, y)
        moved = [
            np.max(np.abs(np.asarray(v) - b))
            for v, b in zip(model.trainable_variables, before, strict=True)
        ]
        assert all(m > 0 for m in moved)
        assert optimizer.iterations.numpy() == 1 and dp.ledger.num_steps == 1


def test_update_queries_changes_what_later_steps_record_without_retracing():
    x, y = _data(8)
    dp = DPKerasModel(
        _model(),
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        groups="per_layer",
        sampling_probability=0.1,
        population_size=80,
        seed=0,
    )
    dp.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss())
    dp.train_on_batch(x, y)
    function = dp.train_function
    dp.update_queries(l2_norm_bound=2.0, noise_multiplier=0.5)
    dp.train_on_batch(x, y)
    assert dp.train_function is function
    runs = dp.ledger.runs()
    assert [r.noise_multiplier for r in runs] == pytest.approx([1.0, 0.5], rel=1e-12)
    last = list(dp.ledger.steps())[-1]
    assert [e.label for e in last.queries] == [
        e.label for e in next(iter(dp.ledger.steps())).queries
    ]
    assert sum(e.l2_norm_bound**2 for e in last.queries) == pytest.approx(4.0, rel=1e-12)


@pytest.mark.slow
def test_bias_callback_is_called_once_per_nonempty_step():
    x, y = _data()
    sampler = PoissonDatasetSampler(population_size=60, sampling_probability=0.1, seed=2)
    seen = []
    dp = DPKerasModel(
        _model(),
        l2_norm_bound=0.1,
        noise_multiplier=1.0,
        sampler=sampler,
        seed=1,
        bias_callback=lambda step, metrics: seen.append((step, metrics.fraction_clipped)),
    )
    dp.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss())
    dp.fit(sampler.sample((x, y)), epochs=2, shuffle=False, verbose=0)
    steps = [s for s, _ in seen]
    assert steps == sorted(set(steps)) and len(steps) >= 15 and steps[-1] <= 19
    assert all(0.0 <= f <= 1.0 for _, f in seen)


@pytest.mark.slow
def test_evaluate_and_predict_use_the_wrapped_model():
    x, y = _data(10)
    model = _model()
    dp = DPKerasModel(
        model, l2_norm_bound=1.0, noise_multiplier=1.0, sampling_probability=0.5, population_size=20
    )
    dp.compile(optimizer="sgd", loss=_loss(), metrics=["accuracy"])
    np.testing.assert_allclose(dp.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)
    assert len(dp.evaluate(x, y, verbose=0)) == 2
    assert dp.ledger.num_steps == 0


def test_bad_inputs_are_refused_with_what_to_change():
    model = _model()
    ok = {
        "l2_norm_bound": 1.0,
        "noise_multiplier": 1.0,
        "sampling_probability": 0.1,
        "population_size": 10,
    }
    with pytest.raises(InvalidParameterError, match="l2_norm_bound"):
        DPKerasModel(model, **{**ok, "l2_norm_bound": -1.0})
    with pytest.raises(InvalidParameterError, match="noise_multiplier"):
        DPKerasModel(model, **{**ok, "noise_multiplier": float("nan")})
    with pytest.raises(InvalidParameterError, match="sampling_probability"):
        DPKerasModel(model, **{**ok, "sampling_probability": 1.01})
    with pytest.raises(InvalidParameterError, match="strategy"):
        DPKerasModel(model, **ok, strategy="fast")
    with pytest.raises(InvalidParameterError, match="sampler"):
        DPKerasModel(model, sampler=object(), l2_norm_bound=1.0, noise_multiplier=1.0)
    with pytest.raises(InvalidParameterError, match="model"):
        DPKerasModel(keras.Sequential([keras.layers.Dense(2)]), **ok)
    dp = DPKerasModel(model, **ok)
    with pytest.raises(PerExampleLossError, match="loss"):
        dp.compile(optimizer="sgd")
    with pytest.raises(PerExampleLossError, match="per output"):
        dp.compile(optimizer="sgd", loss={"out": "mse"})
    batch_norm = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3), keras.layers.BatchNormalization()]
    )
    with pytest.raises(RecordMixingLayerError, match="LayerNormalization"):
        DPKerasModel(batch_norm, **ok)
    regularised = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, kernel_regularizer="l2")]
    )
    with pytest.raises(UnsupportedLayerError, match="weight_decay"):
        DPKerasModel(regularised, **ok)


@pytest.mark.slow
def test_fit_refuses_arrays_that_keras_would_cut_into_fixed_size_batches():
    # Keras's fit(x, y, batch_size=...) shuffles the arrays and cuts fixed-size batches: not the
    # Poisson sample of rate q the ledger would record for every step. Arrays are drawn from
    # by Poisson sampling at the recorded q only, so a batch_size that gives another q is refused.
    x, y = _data(40)
    sampler = PoissonDatasetSampler(population_size=40, sampling_probability=0.1, seed=0)
    dp = DPKerasModel(_model(), l2_norm_bound=1.0, noise_multiplier=1.0, sampler=sampler, seed=1)
    dp.compile(optimizer="sgd", loss=_loss())
    with pytest.raises(InvalidParameterError, match=r"batch_size=20 is invalid.*= 0.1"):
        dp.fit(x, y, batch_size=20, epochs=1, verbose=0)
    with pytest.raises(InvalidParameterError, match="x='<30 records>' is invalid"):
        dp.fit(x[:30], y[:30], epochs=1, verbose=0)
    shuffled = DPKerasModel(
        _model(),
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        sampler=ShuffleDatasetSampler(population_size=40, batch_size=4, seed=0),
        ledger=PrivacyLedger(neighboring="replace_one"),
    )
    shuffled.compile(optimizer="sgd", loss=_loss())
    with pytest.raises(InvalidParameterError, match="x='<ndarray>' is invalid"):
        shuffled.fit(x, y, epochs=1, verbose=0)
    assert shuffled.ledger.num_steps == 0
    with pytest.raises(InvalidParameterError, match="batch_size"):
        dp.fit(sampler.sample((x, y)), batch_size=20, epochs=1, verbose=0)
    assert dp.ledger.num_steps == 0
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*shuffle")  # Keras: shuffle=True ignored
        dp.fit(sampler.sample((x, y)), epochs=1, verbose=0)
    assert dp.ledger.num_steps == sampler.steps_per_epoch


def test_a_loss_without_per_example_values_fails_at_the_first_step():
    x, y = _data(4)
    dp = DPKerasModel(
        _model(),
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        sampling_probability=0.1,
        population_size=40,
    )
    dp.compile(optimizer="sgd", loss=lambda t, p: tf.reduce_mean(p))
    with pytest.raises(PerExampleLossError, match="scalar"):
        dp.train_on_batch(x, y)
    assert dp.ledger.num_steps == 0


# ------------------------------------------------------------------ implementation-bug checks
class _KerasTrainStep:
    """The checks' step protocol on DPKerasModel.train_on_batch (one wrapper per model).

    C and σ change through update_queries (no retracing); the checks' generator is copied
    into the wrapper's noise generator before the step and its advanced state copied back.
    The checks vary the batch size, so the step declares a fixed q·n = DENOMINATOR.
    """

    DENOMINATOR = 8.0

    def __init__(self) -> None:
        self._wrappers: dict[int, tuple[DPKerasModel, keras.optimizers.Optimizer]] = {}

    def __call__(self, model, x, y, *, l2_norm_bound, noise_multiplier, lr, generator):
        entry = self._wrappers.get(id(model))
        if entry is None:
            dp = DPKerasModel(
                model,
                l2_norm_bound=l2_norm_bound,
                noise_multiplier=noise_multiplier,
                sampling_probability=self.DENOMINATOR / 1000,
                population_size=1000,
                seed=0,
                clip_margin=0.0,
            )
            optimizer = keras.optimizers.SGD(lr)
            dp.compile(
                optimizer=optimizer,
                loss=keras.losses.MeanSquaredError(reduction="none", dtype="float64"),
            )
            entry = self._wrappers[id(model)] = (dp, optimizer)
        dp, optimizer = entry
        dp.update_queries(l2_norm_bound=l2_norm_bound, noise_multiplier=noise_multiplier)
        optimizer.learning_rate.assign(lr)
        dp._dp_generator.reset(generator.state)
        dp.train_on_batch(x, y)
        generator.reset(dp._dp_generator.state)


@pytest.mark.slow
def test_keras_fit_step_passes_every_implementation_bug_check():
    step = _KerasTrainStep()
    assert_dp_sgd_correct(
        step,
        lambda: keras_mlp(10, 3),
        loss="mse",
        input_shape=(10,),
        denominator=_KerasTrainStep.DENOMINATOR,
    )


def _tied_model(sampler):
    dp = DPKerasModel(_model(), l2_norm_bound=1.0, noise_multiplier=1.0, sampler=sampler, seed=1)
    dp.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss())
    return dp


@pytest.mark.parametrize(
    "pipeline",
    [
        # the migrating user's pipeline: shuffled, fixed-size batches, not the sampler's draws
        lambda s, x, y: tf.data.Dataset.from_tensor_slices((x, y)).shuffle(60).batch(8),
        # the sampler's batches, re-cut after sampling
        lambda s, x, y: s.sample((x, y)).unbatch().batch(8),
        # the sampler's batches, some dropped
        lambda s, x, y: s.sample((x, y)).filter(lambda a, b: tf.shape(b)[0] > 0),
        # another sampler's batches
        lambda s, x, y: PoissonDatasetSampler(population_size=60, sampling_probability=0.1).sample(
            (x, y)
        ),
    ],
    ids=["shuffle_batch", "rebatched", "filtered", "other_sampler"],
)
def test_fit_refuses_batches_the_recorded_sampler_did_not_draw(pipeline):
    x, y = _data(60)
    sampler = PoissonDatasetSampler(population_size=60, sampling_probability=0.1, seed=4)
    dp = _tied_model(sampler)
    with pytest.raises(SamplerMismatchError, match="did not draw"):
        dp.fit(pipeline(sampler, x, y), epochs=1, verbose=0)
    assert dp.ledger.num_steps == 0


@pytest.mark.slow
def test_fit_accepts_the_samplers_draws_behind_prefetch_and_options():
    x, y = _data(20)
    sampler = PoissonDatasetSampler(population_size=20, sampling_probability=0.1, seed=4)
    dp = _tied_model(sampler)
    options = tf.data.Options()
    options.deterministic = True
    data = sampler.sample((x, y)).with_options(options).prefetch(tf.data.AUTOTUNE)
    dp.fit(data, epochs=1, verbose=0)
    assert dp.ledger.num_steps == 10


@pytest.mark.slow
def test_fit_on_arrays_draws_poisson_batches_at_the_recorded_q(caplog):
    x, y = _data(40)
    dp = DPKerasModel(
        _model(),
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        sampling_probability=4 / 40,
        population_size=40,
        seed=1,
    )
    dp.compile(optimizer="sgd", loss=_loss())
    with caplog.at_level("INFO", logger="dpledger"):
        dp.fit(x, y, batch_size=4, epochs=2, verbose=0)
    assert "fit on arrays: Poisson batches with q = 4 / 40 = 0.1" in caplog.text
    assert dp.ledger.num_steps == 20  # round(1/q) per epoch
    assert {(s.sampling_probability, s.population_size) for s in dp.ledger.steps()} == {(0.1, 40)}
    assert {s.sampling.scheme.value for s in dp.ledger.steps()} == {"poisson"}
    # the model's own PoissonDatasetSampler draws the batches when it has one
    sampler = PoissonDatasetSampler(population_size=40, sampling_probability=0.1, seed=0)
    own = DPKerasModel(_model(), l2_norm_bound=1.0, noise_multiplier=1.0, sampler=sampler, seed=1)
    own.compile(optimizer="sgd", loss=_loss())
    own.fit(x, y, epochs=1, verbose=0)
    assert own.ledger.num_steps == sampler.steps_per_epoch == 10
