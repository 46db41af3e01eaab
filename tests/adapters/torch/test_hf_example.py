"""The README's Hugging Face example: BERT trains under make_private unchanged, on its ledger."""

from __future__ import annotations

import runpy
from pathlib import Path

import dp_accounting
import pytest

pytest.importorskip("transformers", reason="dpledger[hf] is not installed")

from dpledger import PrivacyLedger

EXAMPLE = Path(__file__).parents[3] / "examples" / "hf_text_classifier.py"


@pytest.mark.slow
def test_bert_example_trains_and_reports_the_epsilon_of_its_ledger(tmp_path, capsys):
    main = runpy.run_path(str(EXAMPLE))["main"]
    path = tmp_path / "bert.dpl"
    result = main(["--ledger", str(path), "--noise-seed", "0"])  # the README's defaults: 3 epochs
    assert str(path) in capsys.readouterr().out
    ledger = PrivacyLedger.load(path)
    assert ledger.num_steps == result["steps"] == 30  # q = 0.1: an epoch is 10 Poisson steps
    (run,) = ledger.compressed().runs
    # An independent oracle: dp-accounting's PLD on the recorded (q, z, steps).
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(
            run.sampling_probability, dp_accounting.GaussianDpEvent(run.noise_multiplier)
        ),
        run.count,
    )
    pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    pld.compose(event)
    assert result["epsilon"] == pytest.approx(pld.get_epsilon(1e-5), rel=2e-2)
    assert result["epsilon"] <= 8.0
    assert result["accuracy"] > 0.9
