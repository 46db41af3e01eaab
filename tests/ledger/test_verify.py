"""verify_ledger(): the report, its requirements and its bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dpledger import InvalidParameterError, PrivacyLedger, verify_ledger
from dpledger.errors import NotALedgerError

from .conftest import SMALL_EVENTS, lines_of


def test_report_of_an_intact_closed_ledger(small_file: Path) -> None:
    report = verify_ledger(small_file, require_closed=True)
    head = json.loads(lines_of(small_file)[-1])["hash"]
    assert report.ok and report.intact and report.closed and report.problems == ()
    assert report.num_events == len(SMALL_EVENTS) and report.num_steps == 4
    assert report.head_hash == head
    assert verify_ledger(small_file, expect_head=head).ok
    assert report.to_dict()["problems"] == []


def test_report_names_the_first_bad_line(small_file: Path) -> None:
    lines = lines_of(small_file)
    lines[3], lines[4] = lines[4], lines[3]
    small_file.write_bytes(b"".join(lines))
    report = verify_ledger(small_file)
    assert not report.ok and not report.intact and report.first_bad_line == 4
    assert "sequence number" in report.reason and report.problems[0].startswith("line 4:")


def test_report_of_a_torn_unclosed_ledger(tmp_path: Path) -> None:
    path = tmp_path / "torn.dpl"
    ledger = PrivacyLedger(path)
    ledger.record_sample(sampling_probability=0.5)
    ledger.flush()
    with open(path, "ab") as fp:
        fp.write(b'{"seq":2')
    report = verify_ledger(path)
    assert not report.ok and not report.intact and report.first_bad_line == 3
    assert report.num_events == 1 and not report.closed
    ledger.close()


def test_bad_arguments(small_file: Path, tmp_path: Path) -> None:
    for bad in ("ABC", "A" * 64, 5, "0" * 63):
        with pytest.raises(InvalidParameterError, match="expect_head"):
            verify_ledger(small_file, expect_head=bad)
    with pytest.raises(InvalidParameterError, match="require_closed"):
        verify_ledger(small_file, require_closed="yes")
    with pytest.raises(NotALedgerError):
        verify_ledger(tmp_path)
    with pytest.raises(FileNotFoundError):
        verify_ledger(tmp_path / "missing.dpl")
