"""The dpledger command: info and verify, text and JSON, exit codes, bad inputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpledger import PrivacyLedger
from dpledger._version import __version__
from dpledger.cli import main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def ledger_file(tmp_path: Path) -> Path:
    path = tmp_path / "run.dpl"
    with PrivacyLedger(path, metadata={"model": "cnn"}, neighboring="add_remove") as ledger:
        for _ in range(3):
            ledger.record_sample(sampling_probability=0.01, population_size=60_000)
            ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.1, label="dense/kernel")
            ledger.record_sum_query(l2_norm_bound=0.1, noise_stddev=0.11, label="dense/bias")
        ledger.record_sample(sampling_probability=0.02, population_size=60_000)
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=0.0, label="dense/kernel")
        ledger.record_sample(sampling_probability=0.02)
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_info_text(ledger_file: Path, capsys) -> None:
    code, out, err = run(capsys, "info", str(ledger_file))
    assert code == 0 and err == ""
    head = PrivacyLedger.load(ledger_file).head_hash
    for expected in (
        f"ledger        {ledger_file}",
        f"format        dpledger-ledger v1 (written by {__version__})",
        "neighboring   add_remove",
        'metadata      {"model": "cnn"}',
        "steps         5",
        "events        12",
        "closed        yes",
        f"head hash     {head}",
        "population    60000, unknown",
        "labels        dense/kernel, dense/bias",
        "runs          3 runs of identical steps, 3 distinct (q, z_eff)",
        "0 (NOT PRIVATE)",
        "inf (no query)",
    ):
        assert expected in out


def test_info_json(ledger_file: Path, capsys) -> None:
    code, out, _ = run(capsys, "info", "--json", str(ledger_file))
    assert code == 0
    info = json.loads(out)
    assert info["num_steps"] == 5 and info["num_events"] == 12
    assert info["neighboring"] == "add_remove" and info["metadata"] == {"model": "cnn"}
    assert info["labels"] == ["dense/kernel", "dense/bias"]
    assert info["population_sizes"] == [60000, None]
    assert info["closed"] is True and info["warnings"] == []
    runs = info["runs"]
    assert [r["count"] for r in runs] == [3, 1, 1]
    assert runs[0]["noise_multiplier"] == pytest.approx(1.1 / 2**0.5, rel=1e-12)
    assert runs[1]["noise_multiplier"] == 0.0 and runs[2]["noise_multiplier"] == "inf"
    assert info["num_distinct"] == 3


def test_info_reports_a_torn_tail_as_a_warning(ledger_file: Path, capsys) -> None:
    with open(ledger_file, "ab") as fp:
        fp.write(b'{"seq":14,"pr')
    code, out, _ = run(capsys, "info", "--json", str(ledger_file))
    assert code == 0
    assert "line 15 is incomplete" in json.loads(out)["warnings"][0]
    code, out, err = run(capsys, "info", str(ledger_file))
    assert code == 0 and "torn tail     line 15 is incomplete" in out
    assert err.startswith("dpledger info: warning: ") and "line 15 is incomplete" in err
    assert err.count("\n") == 1
    for flag in ("--strict", "--require-closed"):
        code, out, err = run(capsys, "info", flag, str(ledger_file))
        assert code == 1 and out == ""
        assert err.startswith("dpledger info: verification failed: ") and "line 15" in err
        assert err.count("\n") == 1


def test_verify_ok(ledger_file: Path, capsys) -> None:
    code, out, _ = run(capsys, "verify", str(ledger_file))
    assert code == 0 and out.startswith(f"OK: {ledger_file}: 12 events in 5 steps, closed")
    code, out, _ = run(capsys, "verify", "--json", "--require-closed", str(ledger_file))
    report = json.loads(out)
    assert code == 0 and report["ok"] and report["intact"] and report["closed"]
    assert report["problems"] == [] and report["first_bad_line"] is None
    head = report["head_hash"]
    assert run(capsys, "verify", "--expect-head", head, str(ledger_file))[0] == 0


def test_verify_altered_file(ledger_file: Path, capsys) -> None:
    lines = ledger_file.read_bytes().splitlines(keepends=True)
    assert b'"noise_stddev":1.1,' in lines[5]
    lines[5] = lines[5].replace(b'"noise_stddev":1.1,', b'"noise_stddev":2.2,')
    ledger_file.write_bytes(b"".join(lines))
    code, out, _ = run(capsys, "verify", str(ledger_file))
    assert code == 1
    assert out.startswith(f"FAILED: {ledger_file}") and "line 6: its hash does not match" in out
    code, out, _ = run(capsys, "verify", "--json", str(ledger_file))
    report = json.loads(out)
    assert code == 1 and not report["ok"] and report["first_bad_line"] == 6
    # info cannot show an altered ledger: it fails the same way, with exit code 1
    code, out, err = run(capsys, "info", str(ledger_file))
    assert code == 1 and out == "" and "line 6" in err


def test_verify_requirements(ledger_file: Path, tmp_path: Path, capsys) -> None:
    open_ledger = PrivacyLedger(tmp_path / "open.dpl")
    open_ledger.record_sample(sampling_probability=0.5)
    open_ledger.flush()
    path = str(tmp_path / "open.dpl")
    code, out, _ = run(capsys, "verify", path)
    assert code == 0 and "not closed" in out
    code, out, _ = run(capsys, "verify", "--require-closed", path)
    assert code == 1 and "does not end with a close marker" in out
    code, out, _ = run(capsys, "verify", "--expect-head", "a" * 64, str(ledger_file))
    assert code == 1 and "differs from the expected" in out
    open_ledger.close()


@pytest.mark.parametrize("command", ["info", "verify"])
def test_bad_inputs_exit_2_with_a_message(tmp_path: Path, capsys, command: str) -> None:
    code, out, err = run(capsys, command, str(tmp_path / "missing.dpl"))
    assert code == 2 and out == "" and "No such file" in err and "missing.dpl" in err
    code, out, err = run(capsys, command, str(tmp_path))
    assert code == 2 and "is a directory" in err
    text = tmp_path / "notes.txt"
    text.write_text("not a ledger\n")
    code, out, err = run(capsys, command, str(text))
    assert code == 2 and "not a dpledger ledger" in err and out == ""


def test_verify_refuses_a_malformed_expected_head(ledger_file: Path, capsys) -> None:
    code, _, err = run(capsys, "verify", "--expect-head", "XYZ", str(ledger_file))
    assert code == 2 and err.startswith("dpledger verify: error: --expect-head='XYZ' is invalid")


def test_usage_errors_exit_2(capsys) -> None:
    for argv in ([], ["info"], ["frobnicate"], ["verify", "--bogus", "x"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    capsys.readouterr()


def test_the_installed_entry_points_run(ledger_file: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, "-m", "dpledger", "verify", "--json", str(ledger_file)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["ok"] is True
    result = subprocess.run(
        [sys.executable, "-m", "dpledger", "--version"], capture_output=True, text=True, env=env
    )
    assert result.stdout.strip() == f"dpledger {__version__}"
