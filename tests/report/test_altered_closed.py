"""A file altered at line 3 that still ends in a close marker: verification stopped at line 3,
so whether it is closed was not checked; the report and ``dpledger verify`` say "not checked"
(None in JSON), never "NO"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dpledger.cli import main
from dpledger.ledger import PrivacyLedger
from dpledger.ledger.verify import verify_ledger
from dpledger.report import build_report, render_html, render_markdown
from dpledger.report.sections import report_sections

NOT_CHECKED = "not checked (verification stopped at line 3)"


@pytest.fixture
def edited(tmp_path: Path) -> Path:
    path = tmp_path / "edited.dpl"
    with PrivacyLedger(path) as ledger:
        for _ in range(3):
            ledger.record_sample(sampling_probability=0.1, population_size=100)
            ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0)
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    assert '"noise_stddev":1.0' in lines[2] and '"kind":"close"' in lines[-1]
    lines[2] = lines[2].replace('"noise_stddev":1.0', '"noise_stddev":9.0')
    path.write_text("".join(lines), encoding="utf-8")
    return path


def test_the_report_says_closed_was_not_checked(edited: Path) -> None:
    report = build_report(edited, delta=1e-5)
    v = report.verification
    assert v.altered and v.first_bad_line == 3 and v.closed is None and not v.ok
    (section,) = [s for s in report_sections(report) if s.key == "verification"]
    assert dict(section.tables[0].rows)["closed"] == NOT_CHECKED
    assert f"| closed | {NOT_CHECKED} |" in render_markdown(report)
    assert f"<td>closed</td><td>{NOT_CHECKED}</td>" in render_html(report)
    assert "NO (no close marker)" not in render_markdown(report)
    assert report.to_dict()["verification"]["closed"] is None


def test_verify_says_closed_was_not_checked(
    edited: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert verify_ledger(edited).closed is None
    assert main(["verify", str(edited), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["closed"] is None and out["first_bad_line"] == 3
