"""The balls_in_bins accountant: a labelled Monte-Carlo estimate, run only where it applies."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from dpledger import PrivacyLedger, SamplingEvent
from dpledger.accountants import make_accountant
from dpledger.accountants.balls_in_bins import balls_in_bins_epsilon
from dpledger.accountants.base import Answer, ResultKind
from dpledger.cli import main
from dpledger.errors import ComputationBudgetError, InvalidParameterError, UnsupportedLedgerError

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
    assert result.epsilon == direct.estimate
    assert result.upper_confidence == direct.upper_confidence and result.confidence == 0.99
    assert result.upper_confidence >= result.epsilon and result.upper is None
    assert result.details["epochs"] == 2 and result.details["num_batches"] == 4
    certified = make_accountant("pld").epsilon(bins_ledger(), delta=DELTA)
    assert result.epsilon < certified.epsilon


def test_too_few_samples_leave_only_the_estimate_with_a_warning() -> None:
    result = make_accountant("balls_in_bins", samples=200).epsilon(bins_ledger(), delta=1e-5)
    assert result.upper_confidence == float("inf") and result.upper is None
    assert "upper confidence bound" in result.warnings[0]


@pytest.mark.parametrize("quantity", ["epsilon", "delta"])
def test_the_monte_carlo_bound_is_never_labelled_certified(quantity: str) -> None:
    """The 99% confidence bound is ``upper_confidence`` with its ``confidence``; ``upper`` (the
    certified bound of the other accountants) stays None and the kind is never upper_bound."""
    acc = make_accountant("balls_in_bins", samples=20_000, seed=3)
    if quantity == "epsilon":
        result = acc.epsilon(bins_ledger(), delta=DELTA)
    else:
        result = acc.delta(bins_ledger(), epsilon=1.0)
    assert result.kind is not ResultKind.UPPER_BOUND and result.upper is None
    assert result.upper_confidence is not None and result.upper_confidence >= result.value
    assert result.confidence == 0.99
    row = result.to_dict()
    assert row["upper"] is None and row["upper_confidence"] == result.upper_confidence
    with pytest.raises(InvalidParameterError, match="kind"):
        attrs.evolve(result, kind=ResultKind.UPPER_BOUND)
    with pytest.raises(InvalidParameterError, match="confidence"):
        Answer(0.5, upper_confidence=0.7)
    with pytest.raises(InvalidParameterError, match="kind"):
        Answer(0.5, upper_confidence=0.7, confidence=0.99, kind=ResultKind.UPPER_BOUND)


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


@pytest.mark.slow
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
    mc = rows["balls_in_bins"]
    assert mc["kind"] == "estimate" and mc["upper"] is None
    assert mc["upper_confidence"] >= mc["epsilon"] and mc["confidence"] == 0.99
    assert rows["rdp"]["kind"] == "upper_bound" and "error" in rows["prv"]
    assert rows["prv"]["upper_confidence"] is None and rows["rdp"]["upper_confidence"] is None
    # the table: no number in the balls_in_bins row's upper column; the bound on its own line
    assert main(["epsilon", str(path), "--delta", "1e-2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("balls_in_bins"))
    assert lines[at].split()[:5] == ["balls_in_bins", lines[at].split()[1], "estimate", "-", "-"]
    assert "Monte-Carlo bound: epsilon <= " in lines[at + 1]
    assert "with probability 0.99 over the random draws (not certified)" in lines[at + 1]
    poisson = tmp_path / "p.dpl"
    with PrivacyLedger(poisson) as ledger:
        ledger.record_sample(sampling_probability=0.1)
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0)
    assert main(["epsilon", str(poisson), "--delta", "1e-2", "--json"]) == 0
    names = [json.loads(line)["accountant"] for line in capsys.readouterr().out.splitlines()]
    assert "balls_in_bins" not in names and "rdp" in names
