"""What ``dpledger epsilon`` warns about is on the report too, from the same checks: δ ≥ 1/n, the
shuffle gap of a shuffled ledger; and the report states n, the run's intent and when it was
generated, in all three formats."""

from __future__ import annotations

import datetime
import html
import json
from pathlib import Path

import pytest

from dpledger.accountants.sampling_report import shuffle_gap
from dpledger.cli import main
from dpledger.ledger import PrivacyLedger, SamplingEvent
from dpledger.ledger.commands import intent_text
from dpledger.report import build_report, render_html, render_markdown
from dpledger.report.build import PrivacyReport
from dpledger.report.markdown import escape_markdown
from dpledger.report.sections import report_sections
from dpledger.validation import delta_too_large_message

N = 1000
INTENT = {"target_epsilon": 2.0, "delta": 1e-5, "calibrated_by": "prv", "population_size": N}


def _poisson(path: Path, *, intent: bool, z: float = 1.0, q: float = 0.1) -> Path:
    metadata = {"intent": INTENT} if intent else {}
    with PrivacyLedger(path, metadata=metadata) as ledger:
        for _ in range(10):
            ledger.record_sample(sampling_probability=q, population_size=N)
            ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=z)
    return path


def _shuffled(path: Path) -> Path:
    with PrivacyLedger(path, neighboring="replace_one") as ledger:
        for _ in range(3):
            for i in range(10):
                ledger.record_sample(event=SamplingEvent.shuffle(100, N, epoch_start=i == 0))
                ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0)
    return path


def _in_every_format(report: PrivacyReport, text: str) -> None:
    assert escape_markdown(text) in render_markdown(report)
    assert html.escape(text) in render_html(report)
    assert text in json.dumps(report.to_dict(), ensure_ascii=False)


def _run_table(report: PrivacyReport) -> dict[str, str]:
    (section,) = [s for s in report_sections(report) if s.key == "run"]
    return dict(section.tables[0].rows)


@pytest.mark.slow
def test_delta_at_least_one_over_n_is_warned_about(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _poisson(tmp_path / "run.dpl", intent=False)
    expected = delta_too_large_message(1e-3, N)
    assert expected is not None
    report = build_report(path, delta=1e-3, accountants=["rdp"], curve_points=1)
    assert report.findings == (expected,)
    (summary,) = [s for s in report_sections(report) if s.key == "summary"]
    assert summary.alerts == (expected,)
    _in_every_format(report, expected)
    assert build_report(path, delta=1e-4, accountants=["rdp"], curve_points=1).findings == ()
    out = tmp_path / "review"
    argv = ["report", str(path), "--delta", "1e-3", "--accountant", "rdp", "--curve", "1"]
    assert main([*argv, "--out", str(out)]) == 0
    assert f"dpledger report: warning: {expected}" in capsys.readouterr().err


@pytest.mark.slow
def test_n_the_intent_and_the_generation_time_are_stated(tmp_path: Path) -> None:
    before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    with_intent = build_report(
        _poisson(tmp_path / "a.dpl", intent=True), delta=1e-5, accountants=["rdp"]
    )
    without = build_report(
        _poisson(tmp_path / "b.dpl", intent=False), delta=1e-5, accountants=["rdp"]
    )
    after = datetime.datetime.now(datetime.timezone.utc)
    rows = _run_table(with_intent)
    assert rows["records (n)"] == str(N)
    assert rows["intent"] == intent_text(INTENT) and "target ε = 2 at δ = 1e-05" in rows["intent"]
    assert with_intent.intent == INTENT and with_intent.population_sizes == (N,)
    assert _run_table(without)["intent"] == "not recorded" and without.intent is None
    for report in (with_intent, without):
        assert report.generated is not None
        generated = datetime.datetime.fromisoformat(report.generated)
        assert before <= generated <= after
        assert _run_table(report)["report generated"] == report.generated
        _in_every_format(report, report.generated)
    _in_every_format(with_intent, intent_text(INTENT))
    _in_every_format(without, "not recorded")


@pytest.mark.slow
def test_a_shuffled_ledger_carries_the_shuffle_gap(tmp_path: Path) -> None:
    path = _shuffled(tmp_path / "shuffled.dpl")
    delta = 1e-5
    gap = shuffle_gap(PrivacyLedger.load(path).compressed(), delta=delta)
    assert gap is not None and gap.refutes_poisson and gap.lower_bound is not None
    report = build_report(path, delta=delta, accountants=["pld"], curve_points=1)
    assert report.findings == (f"SHUFFLED BATCHES: {gap.describe()}",)
    assert report.shuffle_gap == {
        "sampling": gap.sampling,
        "relation": "replace_one",
        "poisson_epsilon": gap.poisson_epsilon.epsilon,
        "lower_bound": gap.lower_bound.epsilon,
        "refutes_poisson": True,
    }
    assert gap.describe() in report.sampling_notes
    _in_every_format(report, gap.describe())
    (summary,) = [s for s in report_sections(report) if s.key == "summary"]
    (line,) = [p for p in summary.paragraphs if p.startswith("The Poisson ε")]
    assert "is not valid for this run" in line and "this run's ε is at least" in line
    assert escape_markdown(line) in render_markdown(report)  # the JSON holds its numbers
    assert html.escape(line) in render_html(report)


def test_a_vacuous_attacker_bound_says_so(tmp_path: Path) -> None:
    # ten full-batch steps at z = 0.25: μ = √10 / 0.25 ≈ 12.6, TPR at FPR 0.01 is 1 − 1e-20
    path = _poisson(tmp_path / "noisy.dpl", intent=False, z=0.25, q=1.0)
    report = build_report(path, delta=1e-5, accountants=["rdp"], curve_points=1)
    (summary,) = [s for s in report_sections(report) if s.key == "summary"]
    (line,) = [p for p in summary.paragraphs if p.startswith("Best membership attacker")]
    assert "at FPR 0.01, TPR ≤ 1;" in line
    assert "rules out no attacker" in line
