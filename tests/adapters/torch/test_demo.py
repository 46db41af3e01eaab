"""The README's demo: it trains, prints ε from its ledger file, and that ε is the run's."""

from __future__ import annotations

import math
import runpy
from pathlib import Path

import dp_accounting
import pytest

from dpledger import PrivacyLedger
from dpledger.accountants import PrvAccountant, RdpAccountant

DEMO = runpy.run_path(str(Path(__file__).parents[3] / "examples" / "torch_digits.py"))


def _oracle_epsilon(*, q: float, z: float, steps: int, delta: float) -> float:
    """dp-accounting's RDP accountant on the run as planned (independent of the ledger)."""
    accountant = dp_accounting.rdp.RdpAccountant()
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, steps))
    return accountant.get_epsilon(delta)


def _pld_oracle_epsilon(*, q: float, z: float, steps: int, delta: float) -> float:
    """dp-accounting's PLD accountant on the run as recorded (an independent upper bound)."""
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, steps))
    return float(accountant.get_epsilon(delta))


@pytest.mark.slow
def test_demo_prints_the_epsilon_its_ledger_replays_to(tmp_path, capsys):
    path = tmp_path / "digits.dpl"
    rows = DEMO["main"](
        ["--ledger", str(path), "--epochs", "2", "--target-epsilon", "6", "--noise-seed", "0"]
    )
    out = capsys.readouterr().out
    assert "test accuracy:" in out and str(path) in out
    printed = {r.accountant: r for r in rows}
    assert set(printed) == {"rdp", "prv", "gdp", "pld"}
    for name, row in printed.items():
        if row.epsilon is None:
            assert row.note and f"{name}  " in out
        else:
            assert f"{row.epsilon:8.4f}" in out
    ledger = PrivacyLedger.load(path)
    assert ledger.closed_cleanly and ledger.num_steps == 40  # 2 epochs of round(1/0.05)
    replayed = RdpAccountant().epsilon(ledger, delta=1e-5)
    assert printed["rdp"].epsilon == replayed.epsilon
    # the noise was calibrated by PRV's certified upper bound (the default): it meets the target
    assert printed["prv"].kind == "upper_bound" and printed["prv"].epsilon <= 6.0
    (run,) = ledger.runs()
    assert run.sampling_probability == 0.05 and run.count == 40
    z = float(out.split("noise multiplier ")[1].split(",")[0])
    assert run.noise_multiplier == pytest.approx(z, abs=5e-4)
    oracle = _oracle_epsilon(q=0.05, z=run.noise_multiplier, steps=40, delta=1e-5)
    assert math.isclose(replayed.epsilon, oracle, rel_tol=1e-3)
    pld = _pld_oracle_epsilon(q=0.05, z=run.noise_multiplier, steps=40, delta=1e-5)
    assert pld <= 6.0


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
def test_each_wrapped_optimizer_learns_digits_at_epsilon_8(tmp_path, optimizer):
    result = DEMO["train"](
        tmp_path / "run.dpl", optimizer=optimizer, target_epsilon=8.0, epochs=8, noise_seed=0
    )
    ledger = PrivacyLedger.load(result.ledger_path)
    assert PrvAccountant().epsilon(ledger, delta=1e-5).upper <= 8.0  # the calibrating bound
    (run,) = ledger.runs()
    pld = _pld_oracle_epsilon(
        q=run.sampling_probability, z=run.noise_multiplier, steps=run.count, delta=1e-5
    )
    assert pld <= 8.0
    assert result.accuracy > 0.7, result  # chance is 0.1
