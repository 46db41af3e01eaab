"""Training to accuracy on the digits (slow): wrapped SGD and Adam, and the demo's ε table."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import keras
import pytest

from dpledger import PrivacyLedger
from dpledger.accountants import make_accountant

ROOT = Path(__file__).resolve().parents[3]


def _demo():
    spec = importlib.util.spec_from_file_location("keras_digits", ROOT / "examples/keras_digits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_demo_adam_reaches_accuracy_and_prints_the_epsilon_its_ledger_replays_to(
    tmp_path, monkeypatch, capsys
):
    demo = _demo()
    path = tmp_path / "digits.dpl"
    monkeypatch.setattr(sys, "argv", ["keras_digits.py", str(path), "0"])  # a noise seed
    demo.main()
    out = capsys.readouterr().out
    accuracy = float(re.search(r"test accuracy: ([0-9.]+)", out).group(1))
    assert accuracy > 0.7  # chance is 0.1
    printed = {
        m.group(1): float(m.group(2)) for m in re.finditer(r"^  (\w+)\s+([0-9.]+)  \(", out, re.M)
    }
    assert {"rdp", "pld", "gdp"} <= set(printed)
    ledger = PrivacyLedger.load(path)
    for name, value in printed.items():
        replayed = make_accountant(name).epsilon(ledger, delta=demo.DELTA).epsilon
        assert replayed == pytest.approx(value, abs=1e-4)
    assert printed["rdp"] <= demo.TARGET_EPSILON + 1e-4
    assert ledger.num_steps == int(re.search(r"steps: (\d+)", out).group(1))


@pytest.mark.slow
def test_wrapped_sgd_trains_the_digits_cnn_well_above_chance_at_epsilon_8():
    demo = _demo()
    run = demo.train(
        epochs=10, optimizer=keras.optimizers.SGD(0.5, momentum=0.9), seed=1, noise_seed=1
    )
    assert run.test_accuracy > 0.6
    assert run.epsilons["rdp"].epsilon <= demo.TARGET_EPSILON + 1e-9
    assert run.ledger.num_steps == run.steps
