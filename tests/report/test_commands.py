"""``dpledger report``: outputs, exit codes, the altered and truncated files, bad options."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from dpledger.cli import main
from dpledger.ledger import PrivacyLedger
from dpledger.report.commands import PROGRESS_PREFIX
from tests.report.conftest import DELTA

FAST = ["--accountant", "rdp,gdp", "--curve", "2"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """The exit code, stdout and stderr of the command, stderr without its progress lines
    (:func:`test_progress_lines_name_each_stage_when_stderr_is_not_a_terminal` checks them)."""
    code = main(list(argv))
    captured = capsys.readouterr()
    err = captured.err.splitlines(keepends=True)
    return code, captured.out, "".join(e for e in err if not e.startswith(PROGRESS_PREFIX))


@pytest.mark.slow
def test_out_writes_the_three_twins(shared_ledger: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "review"
    code, stdout, err = run(
        capsys, "report", str(shared_ledger), "--delta", str(DELTA), "--out", str(out), *FAST
    )
    assert code == 0 and err == ""
    for name in ("report.html", "report.md", "report.json"):
        assert (out / name).is_file() and f"written to {out / name}" in stdout
    data = json.loads((out / "report.json").read_text())
    assert data["format"] == "dpledger-privacy-report"
    assert [r["accountant"] for r in data["accountants"]] == ["rdp", "gdp"]
    assert data["claim"]["accountant"] == "rdp"


@pytest.mark.slow
def test_without_a_file_option_the_markdown_is_printed(shared_ledger: Path, capsys) -> None:
    code, out, err = run(capsys, "report", str(shared_ledger), "--delta", "1e-5", *FAST)
    assert code == 0 and err == "" and out.startswith("# Privacy report: ")


@pytest.mark.slow
def test_expect_head(shared_ledger: Path, tmp_path: Path, capsys) -> None:
    head = PrivacyLedger.load(shared_ledger).head_hash
    assert head is not None
    md = tmp_path / "r.md"
    base = ["report", str(shared_ledger), "--delta", "1e-5", "--markdown", str(md), *FAST]
    code, _, err = run(capsys, *base, "--expect-head", head)
    assert code == 0 and err == "" and f"matches the expected {head}" in md.read_text()
    other = "0" * 64
    code, _, err = run(capsys, *base, "--expect-head", other)
    assert code == 1
    assert err.startswith("dpledger report: warning: HEAD MISMATCH") and err.count("\n") == 1
    text = md.read_text()
    assert text.index("HEAD MISMATCH") < text.index("Claim:")


def test_an_altered_file_fails_and_its_report_says_only_that(
    ledger_file: Path, tmp_path: Path, capsys
) -> None:
    lines = ledger_file.read_bytes().splitlines(keepends=True)
    lines[5] = lines[5].replace(b'"noise_stddev":1.5,', b'"noise_stddev":3.0,')
    ledger_file.write_bytes(b"".join(lines))
    js = tmp_path / "r.json"
    code, _, err = run(capsys, "report", str(ledger_file), "--delta", "1e-5", "--json", str(js))
    assert code == 1 and err.count("\n") == 1
    assert err.startswith("dpledger report: verification failed: ") and "line 6" in err
    data = json.loads(js.read_text())
    assert data["verification"]["altered"] and not data["verification"]["ok"]
    assert data["accountants"] == [] and data["claim"] is None


@pytest.mark.slow
def test_a_truncated_file_is_stated_first_and_strict_refuses_it(
    ledger_file: Path, tmp_path: Path, capsys
) -> None:
    content = ledger_file.read_bytes()
    ledger_file.write_bytes(content[:-10])
    md = tmp_path / "r.md"
    base = ["report", str(ledger_file), "--delta", "1e-5", "--markdown", str(md), *FAST]
    code, out, err = run(capsys, *base)
    assert code == 0
    assert err.startswith("dpledger report: warning: TRUNCATED: line ")
    assert out == f"markdown report written to {md}\n"  # the warning comes before any output
    text = md.read_text()
    assert text.index("TRUNCATED") < text.index("Claim:")
    for flag in ("--strict", "--require-closed"):
        md.unlink(missing_ok=True)
        code, out, err = run(capsys, *base, flag)
        assert code == 1 and out == "" and err.count("\n") == 1 and not md.exists()
        assert err.startswith("dpledger report: verification failed: ")


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--delta", "2"], "--delta=2.0"),
        (["--delta", "0"], "--delta=0.0"),
        (["--delta", "1e-5", "--accountant", "nope"], "--accountant='nope'"),
        (["--delta", "1e-5", "--curve", "0"], "--curve=0"),
        (["--delta", "1e-5", "--expect-head", "abc"], "--expect-head='abc'"),
        (["--delta", "1e-5", "--out", "OUT", "--html", "x.html"], "--out="),
        (["--delta", "1e-5", "--html", "/no/such/dir/r.html"], "--html='/no/such/dir/r.html'"),
        (["--delta", "1e-5", "--audit", "AUDIT"], "--audit="),
    ],
)
def test_bad_options_exit_2_with_one_line(
    shared_ledger: Path, tmp_path: Path, capsys, argv: list[str], flag: str
) -> None:
    (tmp_path / "AUDIT").write_text('{"lower_bound": "high"}')
    argv = [str(tmp_path / a) if a in ("OUT", "AUDIT") else a for a in argv]  # paths under tmp_path
    code, out, err = run(capsys, "report", str(shared_ledger), *argv)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("dpledger report: error: ") and flag in err


def test_a_missing_ledger_or_option_exits_2(tmp_path: Path, capsys) -> None:
    code, out, err = run(capsys, "report", str(tmp_path / "none.dpl"), "--delta", "1e-5")
    assert code == 2 and out == "" and err.count("\n") == 1
    with pytest.raises(SystemExit) as info:
        main(["report", str(tmp_path / "none.dpl")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--delta" in err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_and_lines_elsewhere(
    monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from dpledger.report.commands import _progress

    items = ["rdp", "pld"]
    assert list(_progress(items, 2, "report")) == items  # stderr is not a terminal under pytest
    assert capsys.readouterr().err == (f"{PROGRESS_PREFIX}[1/2] rdp\n{PROGRESS_PREFIX}[2/2] pld\n")
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert list(_progress(items, 2, "report")) == items
    shown = terminal.getvalue()
    assert "report" in shown and "2/2" in shown and PROGRESS_PREFIX not in shown


@pytest.mark.slow
def test_progress_lines_name_each_stage_when_stderr_is_not_a_terminal(
    shared_ledger: Path, capsys
) -> None:
    """One line per stage, each before its work, numbered, then nothing but the report."""
    code = main(["report", str(shared_ledger), "--delta", "1e-5", *FAST])
    captured = capsys.readouterr()
    assert code == 0 and captured.out.startswith("# Privacy report: ")
    stages = [
        "[1/1] reading and verifying the ledger",
        "[1/6] the sum queries",
        "[2/6] rdp: ε at δ = 1e-05",
        "[3/6] rdp: ε against steps (2 points)",
        "[4/6] gdp: ε at δ = 1e-05",
        "[5/6] gdp: ε against steps (2 points)",
        "[6/6] the trade-off view",
    ]
    assert captured.err == "".join(f"{PROGRESS_PREFIX}{stage}\n" for stage in stages)


@pytest.mark.parametrize(
    "content",
    [b"[" * 100_000, b'{"lower_bound": 1, "method": "\xff\xfe"}', b'{"lower_bound": Infinity}',
     b'{"lower_bound": 1e400}'],
)  # fmt: skip
def test_a_hostile_audit_file_exits_2_with_a_typed_error(
    shared_ledger: Path, tmp_path: Path, capsys, content: bytes
) -> None:
    audit = tmp_path / "audit.json"
    audit.write_bytes(content)
    code, out, err = run(capsys, "report", str(shared_ledger), "--delta", "1e-5",
                         "--audit", str(audit), *FAST)  # fmt: skip
    assert code == 2 and out == "" and err.count("\n") == 1
    # the value is the file's path, which the message abbreviates when it is long
    assert err.startswith("dpledger report: error: --audit=") and " is invalid: expected" in err
    assert '{"lower_bound": finite number >= 0' in err
    assert "internal error" not in err
