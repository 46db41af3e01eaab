"""DPKerasModel writes the run's intent into a ledger it creates, and warns when δ ≥ 1/n."""

from __future__ import annotations

import logging

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


def test_a_given_ledger_keeps_its_header_and_the_intent_is_logged(caplog) -> None:
    sampler = PoissonDatasetSampler(population_size=1000, sampling_probability=0.01, seed=0)
    ledger = PrivacyLedger(metadata={"model": "dense"})
    with caplog.at_level(logging.INFO, logger="dpledger"):
        dp = DPKerasModel(
            _model(), l2_norm_bound=1.0, noise_multiplier=1.1, sampler=sampler, ledger=ledger
        )
    assert dp.ledger is ledger and ledger.header.metadata == {"model": "dense"}
    assert "the ledger was created without the run's intent" in caplog.text


def test_delta_of_at_least_one_over_n_is_warned_about() -> None:
    sampler = PoissonDatasetSampler(population_size=100, sampling_probability=0.1, seed=0)
    config = DPConfig(l2_norm_bound=1.0, noise_multiplier=1.1, delta=0.01)
    with pytest.warns(DeltaTooLargeWarning) as caught:
        DPKerasModel(_model(), config=config, sampler=sampler)
    assert [str(w.message).split(":")[0] for w in caught] == [
        "delta=0.01 is at least 1/n = 1/100 (population_size=100)"
    ]
    assert caught[0].filename == __file__
