"""A Monte-Carlo upper bound (the ``balls_in_bins`` accountant's, which holds only with a
probability over its random draws) is shown in a place of its own, labelled as not certified,
never in the certified-upper column and never as the claim."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dpledger.accountants.balls_in_bins_mc import BallsInBinsAccountant
from dpledger.accountants.base import make_accountant
from dpledger.ledger import PrivacyLedger
from dpledger.ledger.events import SamplingEvent
from dpledger.report import build, build_report, render_html, render_markdown
from dpledger.report.build import PrivacyReport
from dpledger.report.sections import report_sections

DELTA = 1e-3
SAMPLES = 4000
LABEL = "Monte-Carlo bound (not certified, probability 0.99 over the random draws)"


def _small(name: str, **kwargs: Any) -> Any:
    # the default 200,000 draws take seconds; the report shows whatever the accountant answers
    if name == "balls_in_bins":
        return BallsInBinsAccountant(samples=SAMPLES)
    return make_accountant(name, **kwargs)


@pytest.fixture(scope="module")
def bins_ledger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bins") / "bins.dpl"
    with PrivacyLedger(path) as ledger:
        for _ in range(2):
            for i in range(4):
                ledger.record_sample(event=SamplingEvent.balls_in_bins(4, 400, epoch_start=i == 0))
                ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0)
    return path


@pytest.fixture(scope="module")
def report(bins_ledger: Path) -> PrivacyReport:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(build, "make_accountant", _small)
        return build_report(
            bins_ledger, delta=DELTA, accountants=["balls_in_bins", "rdp"], curve_points=1
        )


@pytest.mark.slow
def test_the_row_carries_the_accountants_own_confidence_bound(
    report: PrivacyReport, bins_ledger: Path
) -> None:
    own = BallsInBinsAccountant(samples=SAMPLES).epsilon(
        PrivacyLedger.load(bins_ledger), delta=DELTA
    )
    assert own.upper is None and own.upper_confidence is not None
    row = next(r for r in report.accountants if r.accountant == "balls_in_bins")
    assert row.upper is None
    assert (row.epsilon, row.upper_confidence, row.confidence) == (
        own.epsilon,
        own.upper_confidence,
        0.99,
    )
    data = json.loads(json.dumps(report.to_dict()))
    twin = next(r for r in data["accountants"] if r["accountant"] == "balls_in_bins")
    assert twin["upper"] is None and twin["confidence"] == 0.99
    assert report.to_dict()["claim"]["accountant"] == "rdp"


def test_the_bound_has_its_own_labelled_place_in_every_format(report: PrivacyReport) -> None:
    row = next(r for r in report.accountants if r.accountant == "balls_in_bins")
    assert row.upper_confidence is not None
    (section,) = [s for s in report_sections(report) if s.key == "accountants"]
    main, *others = section.tables
    certified = main.headers.index("certified upper")
    (bins_row,) = [r for r in main.rows if r[0] == "balls_in_bins"]
    assert bins_row[certified] == "-"
    (own,) = [t for t in others if LABEL in t.headers]
    assert own.headers == ("accountant", LABEL)
    (cells,) = own.rows
    assert cells[0] == "balls_in_bins" and float(cells[1]) >= row.upper_confidence
    markdown = render_markdown(report)
    page = render_html(report)
    assert LABEL in markdown and f"<th>{LABEL}</th>" in page
    assert f"| balls\\_in\\_bins | {cells[1]} |" in markdown
    assert f"<td>balls_in_bins</td><td>{cells[1]}</td>" in page
