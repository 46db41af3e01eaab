"""DPKerasModel writes the run's intent into a ledger it creates, and warns when δ ≥ 1/n."""

from __future__ import annotations

import json

import keras
import pytest
import tensorflow as tf

from dpledger import PrivacyLedger
from dpledger._version import __version__
from dpledger.adapters.tensorflow import DPKerasModel, PoissonDatasetSampler
from dpledger.errors import DeltaTooLargeWarning
from dpledger.mechanisms import DPConfig


def _model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])


def test_a_new_ledger_holds_the_runs_intent() -> None:
    sampler = PoissonDatasetSampler(population_size=1000, sampling_probability=0.01, seed=0)
    dp = DPKerasModel(
        _model(),
        config=DPConfig(l2_norm_bound=1.0, noise_multiplier=1.1, delta=1e-5),
        sampler=sampler,
    )
    assert dp.ledger.header.metadata == {
        "intent": {
            "delta": 1e-5,
            "noise_multiplier": 1.1,
            "sampling": "poisson",
            "sampling_probability": 0.01,
            "population_size": 1000,
            "unit": "record",
            "versions": {"dpledger": __version__, "tensorflow": tf.__version__},
        }
    }


def test_a_given_ledger_keeps_its_header_and_records_the_intent_in_a_note(tmp_path, capsys) -> None:
    from dpledger.cli import main

    sampler = PoissonDatasetSampler(population_size=1000, sampling_probability=0.01, seed=0)
    path = tmp_path / "keras.dpl"
    ledger = PrivacyLedger(path, metadata={"model": "dense"})
    config = DPConfig(l2_norm_bound=1.0, noise_multiplier=1.1, delta=1e-5)
    dp = DPKerasModel(_model(), config=config, sampler=sampler, ledger=ledger)
    assert dp.ledger is ledger and ledger.header.metadata == {"model": "dense"}
    assert ledger.intent == {
        "delta": 1e-5,
        "noise_multiplier": 1.1,
        "sampling": "poisson",
        "sampling_probability": 0.01,
        "population_size": 1000,
        "unit": "record",
        "versions": {"dpledger": __version__, "tensorflow": tf.__version__},
    }
    ledger.close()
    assert main(["info", "--json", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["intent"] == ledger.intent
    assert main(["info", str(path)]) == 0
    assert "intent        δ = 1e-05; z = 1.1; n = 1000 (records)" in capsys.readouterr().out


def test_delta_of_at_least_one_over_n_is_warned_about() -> None:
    sampler = PoissonDatasetSampler(population_size=100, sampling_probability=0.1, seed=0)
    config = DPConfig(l2_norm_bound=1.0, noise_multiplier=1.1, delta=0.01)
    with pytest.warns(DeltaTooLargeWarning) as caught:
        DPKerasModel(_model(), config=config, sampler=sampler)
    assert [str(w.message).split(":")[0] for w in caught] == [
        "delta=0.01 is at least 1/n = 1/100 (population_size=100)"
    ]
    assert caught[0].filename == __file__
