"""DPKerasModel.save / keras.models.load_model: the model, its weights and its DP configuration
come back; the ledger (the user's file) does not, and a loaded model trains only after
attach_ledger."""

from __future__ import annotations

import json
import math
import warnings

import attrs
import keras
import numpy as np
import pytest

from dpledger import PrivacyLedger
from dpledger.adapters.tensorflow import DPKerasModel, PoissonDatasetSampler, ShuffleDatasetSampler
from dpledger.adapters.tensorflow.model_saving import (
    RecordedSampling,
    config_from_json,
    config_to_json,
    event_from_json,
    event_to_json,
)
from dpledger.errors import InvalidParameterError, LedgerNotAttachedError, UnrecordedTrainingWarning
from dpledger.ledger import SamplingEvent
from dpledger.mechanisms import AutomaticClipping, DPConfig, FlatClipping, GaussianSumQuery

N = 24


def _data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(N, 5)).astype(np.float32), rng.integers(0, 3, N).astype(np.int32)


def _inner(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(3)]
    )


def _compile(model: DPKerasModel) -> None:
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )


CONFIG = DPConfig(
    l2_norm_bound=2.0,
    noise_multiplier=1.3,
    delta=1e-3,
    clipping=AutomaticClipping(stability=0.05),
    groups="per_layer",
    clip_split="dimension",
    noise_allocation="dimension",
    clip_margin=1e-3,
)


@pytest.fixture(autouse=True)
def _no_unrecorded_training():
    """None of these tests trains the wrapped model directly: the warning would be a bug."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnrecordedTrainingWarning)
        yield


@pytest.mark.slow
def test_round_trip_restores_the_model_its_weights_and_its_dp_configuration(tmp_path):
    """Reference: the saved model itself (its weights, DPConfig, sampling event, optimizer)."""
    x, y = _data()
    sampler = PoissonDatasetSampler(population_size=N, sampling_probability=0.25, seed=3)
    dp = DPKerasModel(_inner(), config=CONFIG, sampler=sampler, seed=1)
    _compile(dp)
    dp.fit(sampler.sample((x, y)), epochs=1, verbose=0)
    path = tmp_path / "model.keras"
    dp.save(path)

    loaded = keras.models.load_model(path)

    assert isinstance(loaded, DPKerasModel)
    assert loaded.dp_config == dp.dp_config == CONFIG
    assert loaded.sampling_event == dp.sampling_event
    assert (loaded.sampling_probability, loaded.population_size) == (0.25, N)
    saved, restored = dp.get_weights(), loaded.get_weights()
    assert len(saved) == len(restored) == 4
    for a, b in zip(saved, restored, strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(loaded.optimizer.iterations.numpy()) == int(dp.optimizer.iterations.numpy()) == 4
    # the loss as compiled (the DP step uses its per-example values, reduction "none")
    assert loaded.loss.get_config() == dp.loss.get_config()
    assert type(loaded.optimizer) is type(dp.optimizer)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), dp.predict(x, verbose=0))


def test_a_loaded_model_records_nothing_until_it_is_given_a_ledger(tmp_path):
    x, y = _data()
    dp = DPKerasModel(
        _inner(), l2_norm_bound=1.0, noise_multiplier=1.0, sampling_probability=0.25,
        population_size=N, seed=1,
    )  # fmt: skip
    _compile(dp)
    dp.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    batches = PoissonDatasetSampler(population_size=N, sampling_probability=0.25, seed=0).sample(
        (x, y)
    )
    with pytest.raises(LedgerNotAttachedError, match="resume=True"):
        loaded.fit(batches, epochs=1, verbose=0)
    with pytest.raises(LedgerNotAttachedError, match="attach_ledger"):
        loaded.train_on_batch(x[:4], y[:4])
    with pytest.raises(LedgerNotAttachedError):
        _ = loaded.ledger
    before = [w.copy() for w in loaded.get_weights()]
    for a, b in zip(before, dp.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)  # no step was taken


@pytest.mark.slow
def test_training_after_load_continues_the_resumed_ledger_file(tmp_path):
    """Reference: closed forms of the step's queries (per-layer groups, equal clip split,
    proportional noise: S_g = C/√G and σ̃_g = z·√G·S_g = z·C) and the steps recorded before the
    save, which the resumed file keeps."""
    x, y = _data()
    ledger_path = tmp_path / "run.ledger"
    sampler = PoissonDatasetSampler(population_size=N, sampling_probability=0.25, seed=3)
    ledger = PrivacyLedger(ledger_path)
    dp = DPKerasModel(
        _inner(), l2_norm_bound=2.0, noise_multiplier=1.5, groups="per_layer",
        sampler=sampler, ledger=ledger, seed=1,
    )  # fmt: skip
    _compile(dp)
    dp.fit(sampler.sample((x, y)), epochs=1, verbose=0)
    dp.save(tmp_path / "model.keras")
    ledger.close()
    before = list(ledger.steps())

    loaded = keras.models.load_model(tmp_path / "model.keras")
    resumed = PrivacyLedger(ledger_path, resume=True)
    loaded.attach_ledger(resumed, seed=2)
    loaded.fit(sampler.sample((x, y)), epochs=1, verbose=0)
    resumed.close()

    reread = PrivacyLedger.load(ledger_path)
    steps = list(reread.steps())
    assert len(steps) == 8  # 4 before the save, 4 after
    assert steps[:4] == before
    bound, sigma = 2.0 / math.sqrt(2), 1.5 * 2.0
    for step in steps:
        assert (step.sampling.sampling_probability, step.sampling.population_size) == (0.25, N)
        assert len(step.queries) == 2
        for query in step.queries:
            assert query.l2_norm_bound == pytest.approx(bound, rel=1e-15)
            assert query.noise_stddev == pytest.approx(sigma, rel=1e-15)


def test_an_epoch_based_scheme_needs_its_sampler_back(tmp_path):
    """Reference: the ShuffleDatasetSampler's own events (epoch_start on each epoch's first
    batch)."""
    x, y = _data()
    sampler = ShuffleDatasetSampler(population_size=N, batch_size=6, seed=5)
    dp = DPKerasModel(
        _inner(), l2_norm_bound=1.0, noise_multiplier=1.0, sampler=sampler,
        ledger=PrivacyLedger(neighboring="replace_one"), seed=1,
    )  # fmt: skip
    _compile(dp)
    dp.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    with pytest.raises(InvalidParameterError, match="shuffle"):
        loaded.attach_ledger(PrivacyLedger(neighboring="replace_one"))
    other = ShuffleDatasetSampler(population_size=N, batch_size=4, seed=5)
    with pytest.raises(InvalidParameterError, match="saved sampling"):
        loaded.attach_ledger(PrivacyLedger(neighboring="replace_one"), sampler=other)
    with pytest.raises(InvalidParameterError):  # shuffling is analysed under replace-one only
        loaded.attach_ledger(PrivacyLedger(), sampler=sampler)
    ledger = PrivacyLedger(neighboring="replace_one")
    loaded.attach_ledger(ledger, sampler=sampler, seed=0)
    loaded.fit(sampler.sample((x, y)), epochs=2, verbose=0)
    events = [step.sampling for step in ledger.steps()]
    expected = [sampler.event_for_step(i) for _ in range(2) for i in range(4)]
    assert events == expected


def test_attach_ledger_is_only_for_a_loaded_model():
    dp = DPKerasModel(
        _inner(), l2_norm_bound=1.0, noise_multiplier=1.0, sampling_probability=0.5,
        population_size=N,
    )  # fmt: skip
    with pytest.raises(InvalidParameterError, match="already records"):
        dp.attach_ledger(PrivacyLedger())


def test_a_model_with_explicit_queries_refuses_to_be_saved(tmp_path):
    model = _inner()
    dp = DPKerasModel(
        model, queries=[GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=1.0)],
        sampling_probability=0.5, population_size=N,
    )  # fmt: skip
    _compile(dp)
    assert dp.dp_config is None
    with pytest.raises(InvalidParameterError, match="explicit queries"):
        dp.save(tmp_path / "model.keras")


def test_update_queries_is_saved(tmp_path):
    dp = DPKerasModel(
        _inner(), l2_norm_bound=1.0, noise_multiplier=1.0, sampling_probability=0.5,
        population_size=N,
    )  # fmt: skip
    _compile(dp)
    dp.update_queries(l2_norm_bound=1.0, noise_multiplier=2.5)
    assert dp.dp_config is not None and dp.dp_config.noise_multiplier == 2.5
    dp.save(tmp_path / "model.keras")
    assert keras.models.load_model(tmp_path / "model.keras").dp_config == dp.dp_config


@pytest.mark.parametrize(
    "config",
    [
        CONFIG,
        DPConfig(
            l2_norm_bound=1.0,
            noise_multiplier=0.7,
            clipping="global",
            groups={"first": ["dense/kernel", "dense/bias"], "second": ["dense_1/kernel"]},
            scales={"dense/kernel": 2.0},
            strategy="generic",
        ),
    ],
)
def test_the_saved_config_is_json_and_comes_back_equal(config):
    """Reference: the config itself, after a JSON round trip of what get_config stores."""
    text = json.dumps(config_to_json(config))
    assert config_from_json(json.loads(text)) == config


@pytest.mark.parametrize(
    "event",
    [
        SamplingEvent.poisson(0.25, 40),
        SamplingEvent.fixed_size(8, 40),
        SamplingEvent.truncated_poisson(0.25, 40, 12),
        SamplingEvent.balls_in_bins(5, 40),
        SamplingEvent.shuffle(8, 40),
    ],
)
def test_the_saved_sampling_event_comes_back_equal(event):
    """Reference: the event itself, and for the epoch-based schemes the scheme's own events."""
    restored = event_from_json(json.loads(json.dumps(event_to_json(event))))
    assert restored == event
    recorded = RecordedSampling(restored)
    assert recorded.sampling_event == event
    if recorded.epoch_based:
        assert recorded.event_for_step(0) == attrs.evolve(event, epoch_start=True)
        assert recorded.event_for_step(1) == event
        assert recorded.steps_per_epoch == 5
    else:
        assert recorded.event_for_step(3) == event


def test_a_custom_clipping_strategy_is_refused_by_name():
    class HalfClipping(FlatClipping):
        name = "half"

    with pytest.raises(InvalidParameterError, match="custom ClippingStrategy"):
        config_to_json(DPConfig(l2_norm_bound=1.0, noise_multiplier=1.0, clipping=HalfClipping()))
