"""examples/hf_trainer_finetune.py runs, on fewer records and steps than its defaults."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_trainer_finetune.py"


@pytest.mark.slow
def test_the_hf_trainer_example_runs_and_its_ledger_meets_the_target(tmp_path):
    spec = importlib.util.spec_from_file_location("hf_trainer_finetune", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    summary = example.main(["--out", str(tmp_path / "run"), "--records", "600", "--epochs", "1"])
    # q = 300 / 600: an epoch is round(1/q) = 2 steps
    assert summary["steps"] == 2
    assert summary["epsilon_prv"] <= 8.0  # calibrated for ε = 8 over the planned steps
    assert (tmp_path / "run" / "checkpoint-2" / "dpledger.json").is_file()
