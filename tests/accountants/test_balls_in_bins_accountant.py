"""The balls_in_bins accountant: a labelled Monte-Carlo estimate, run only where it applies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dpledger import PrivacyLedger, SamplingEvent
from dpledger.accountants import make_accountant
from dpledger.accountants.balls_in_bins import balls_in_bins_epsilon
from dpledger.accountants.base import ResultKind
from dpledger.cli import main
from dpledger.errors import ComputationBudgetError, UnsupportedLedgerError

DELTA = 1e-2
# A small population (n = 100) keeps the Monte-Carlo estimates fast, and δ = 1e-2 keeps them
# resolvable with few samples; δ ≥ 1/n is the point of neither test, so its warning is expected.
pytestmark = pytest.mark.filterwarnings("ignore::dpledger.errors.DeltaTooLargeWarning")


def bins_ledger(k: int = 4, epochs: int = 2, sigma: float = 1.0, **kw) -> PrivacyLedger:
    ledger = PrivacyLedger(**kw)
    for t in range(k * epochs):
        ledger.record_sample(event=SamplingEvent.balls_in_bins(k, 100, epoch_start=t % k == 0))
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=sigma)
    return ledger


def test_it_reports_the_estimate_as_an_estimate() -> None:
    """Reference: the estimator called directly with the same parameters and seed; and the
    certified no-amplification bound of the pld accountant, which the estimate stays below."""
    result = make_accountant("balls_in_bins", samples=20_000, seed=3).epsilon(
        bins_ledger(), delta=DELTA
    )
    direct = balls_in_bins_epsilon(DELTA, 1.0, 4, epochs=2, samples=20_000, seed=3)
    assert result.kind is ResultKind.ESTIMATE
    assert result.epsilon == direct.estimate and result.upper == direct.upper_confidence
    assert result.upper >= result.epsilon
    assert result.details["epochs"] == 2 and result.details["num_batches"] == 4
    certified = make_accountant("pld").epsilon(bins_ledger(), delta=DELTA)
    assert result.epsilon < certified.epsilon


def test_too_few_samples_leave_only_the_estimate_with_a_warning() -> None:
    result = make_accountant("balls_in_bins", samples=200).epsilon(bins_ledger(), delta=1e-5)
    assert result.upper == float("inf")
    assert "upper confidence bound" in result.warnings[0]


def test_it_refuses_what_it_cannot_estimate() -> None:
    acc = make_accountant("balls_in_bins", samples=1000)
    with pytest.raises(UnsupportedLedgerError, match="replace-one"):
        acc.epsilon(bins_ledger(neighboring="replace_one"), delta=DELTA)
    poisson = PrivacyLedger()
    poisson.record_sample(sampling_probability=0.1)
    poisson.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0)
    with pytest.raises(UnsupportedLedgerError, match="poisson"):
        acc.epsilon(poisson, delta=DELTA)
    varying = bins_ledger()
    varying.record_sample(event=SamplingEvent.balls_in_bins(4, 100, epoch_start=True))
    varying.record_sum_query(l2_norm_bound=1.0, noise_stddev=2.0)
    with pytest.raises(UnsupportedLedgerError, match="one noise multiplier"):
        acc.epsilon(varying, delta=DELTA)


def test_a_run_beyond_the_time_budget_is_refused_up_front() -> None:
    acc = make_accountant("balls_in_bins", samples=10**9, time_budget_s=1.0)
    with pytest.raises(ComputationBudgetError, match="samples="):
        acc.epsilon(bins_ledger(), delta=DELTA)


def test_the_cli_runs_it_only_on_balls_in_bins_ledgers(tmp_path: Path, capsys) -> None:
    path = tmp_path / "b.dpl"
    with PrivacyLedger(path) as ledger:
        for t in range(8):
            ledger.record_sample(event=SamplingEvent.balls_in_bins(4, 100, epoch_start=t % 4 == 0))
            ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0)
    assert main(["epsilon", str(path), "--delta", "1e-2", "--json"]) == 0
    rows = {
        row["accountant"]: row for row in map(json.loads, capsys.readouterr().out.split("\n")[:-1])
    }
    assert rows["balls_in_bins"]["kind"] == "estimate"
    assert rows["rdp"]["kind"] == "upper_bound" and "error" in rows["prv"]
    poisson = tmp_path / "p.dpl"
    with PrivacyLedger(poisson) as ledger:
        ledger.record_sample(sampling_probability=0.1)
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0)
    assert main(["epsilon", str(poisson), "--delta", "1e-2", "--json"]) == 0
    names = [json.loads(line)["accountant"] for line in capsys.readouterr().out.splitlines()]
    assert "balls_in_bins" not in names and "rdp" in names
