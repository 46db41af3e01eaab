"""Where a DPKerasModel's noise comes from: recorded in its ledger; a saved model carries no
noise generator and no sampler state."""

from __future__ import annotations

import zipfile

import keras
import numpy as np
import tensorflow as tf

from dpledger import PrivacyLedger
from dpledger.adapters.tensorflow import DPKerasModel, PoissonDatasetSampler
from dpledger.ledger.provenance import provenance_of

N = 24


def _inner() -> keras.Model:
    keras.utils.set_random_seed(0)  # the model's initialisation, not the noise
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])


def _model(ledger: PrivacyLedger, **seeds) -> tuple[DPKerasModel, PoissonDatasetSampler]:
    sampler = PoissonDatasetSampler(
        population_size=N, sampling_probability=0.25, seed=seeds.pop("sampler_seed", None)
    )
    dp = DPKerasModel(
        _inner(),
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        sampler=sampler,
        ledger=ledger,
        **seeds,
    )
    return dp, sampler


def test_keras_records_os_entropy_or_the_callers_seed_never_the_seed():
    ledger = PrivacyLedger()
    _model(ledger)
    (record,) = provenance_of(ledger.notes)
    assert record.entry_point == "keras.DPKerasModel"
    assert record.generator == "tf.random.Generator(philox)"
    assert (record.seeding, record.sampler_seeding) == ("os_entropy", "os_entropy")
    assert record.checkpoint == "excluded"

    ledger = PrivacyLedger()
    _model(ledger, seed=98765, sampler_seed=4321)
    (record,) = provenance_of(ledger.notes)
    assert (record.seeding, record.sampler_seeding) == ("caller_seed", "caller_seed")
    assert "98765" not in str(ledger.notes) and "4321" not in str(ledger.notes)

    ledger = PrivacyLedger()
    _model(ledger, generator=tf.random.Generator.from_non_deterministic_state())
    assert provenance_of(ledger.notes)[0].seeding == "caller_generator"


def test_a_saved_model_holds_neither_generator_state(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 5)).astype(np.float32)
    y = rng.integers(0, 3, N).astype(np.int32)
    dp, sampler = _model(PrivacyLedger())
    dp.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    dp.fit(sampler.sample((x, y)), epochs=1, verbose=0)
    path = tmp_path / "model.keras"
    dp.save(path)
    with zipfile.ZipFile(path) as archive:
        saved = b"".join(archive.read(name) for name in archive.namelist())
    for generator in (dp._dp_generator, sampler._generator):
        state = generator.state.numpy()
        assert state.tobytes() not in saved  # the raw int64 words
        assert all(str(int(word)).encode() not in saved for word in state if abs(word) > 10**6)


def test_keras_refuses_secure_noise_until_it_draws_it():
    import pytest

    from dpledger.errors import InvalidParameterError
    from dpledger.mechanisms import DPConfig

    sampler = PoissonDatasetSampler(population_size=N, sampling_probability=0.25)
    config = DPConfig(l2_norm_bound=1.0, noise_multiplier=1.0, secure_noise=True)
    with pytest.raises(InvalidParameterError, match="secure_noise"):
        DPKerasModel(_inner(), config=config, sampler=sampler)
