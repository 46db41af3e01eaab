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
        f"format        dpledger-ledger v2 (written by {__version__})",
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


def test_info_shows_c_and_sigma_per_label(ledger_file: Path, capsys) -> None:
    code, out, _ = run(capsys, "info", "--json", str(ledger_file))
    assert code == 0
    assert json.loads(out)["queries"] == [
        {
            "label": "dense/kernel",
            "l2_norm_bound": 1.0,
            "noise_stddev": 1.1,
            "noise_multiplier": 1.1,
            "count": 3,
        },
        {
            "label": "dense/bias",
            "l2_norm_bound": 0.1,
            "noise_stddev": 0.11,
            "noise_multiplier": 0.11 / 0.1,
            "count": 3,
        },
        {
            "label": "dense/kernel",
            "l2_norm_bound": 1.0,
            "noise_stddev": 0.0,
            "noise_multiplier": 0.0,
            "count": 1,
        },
    ]
    assert json.loads(out)["intent"] is None  # a ledger written without one
    code, out, _ = run(capsys, "info", str(ledger_file))
    assert "queries       3 distinct (label, C, σ̃)" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("  dense/")]
    assert rows == [
        ["dense/kernel", "1", "1.1", "1.1", "3"],
        ["dense/bias", "0.1", "0.11", "1.1", "3"],
        ["dense/kernel", "1", "0", "0", "1"],
    ]
    assert "intent" not in out


def test_info_shows_the_runs_intent(tmp_path: Path, capsys) -> None:
    from dpledger.ledger.intent import INTENT_KEY, run_intent

    intent = run_intent(
        framework="torch",
        framework_version="2.0",
        population_size=1000,
        noise_multiplier=1.19,
        target_epsilon=3.0,
        delta=1e-5,
        accountant="prv",
    )
    path = tmp_path / "intent.dpl"
    with PrivacyLedger(path, metadata={INTENT_KEY: intent}) as ledger:
        ledger.record_sample(sampling_probability=0.01, population_size=1000)
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.19)
    code, out, _ = run(capsys, "info", "--json", str(path))
    assert code == 0 and json.loads(out)["intent"] == intent
    code, out, _ = run(capsys, "info", str(path))
    assert (
        "intent        target ε = 3 at δ = 1e-05; noise calibrated by prv; z = 1.19; "
        f"n = 1000 (records); dpledger {__version__}, torch 2.0"
    ) in out


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


@pytest.mark.slow
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


@pytest.mark.parametrize("content", [b"", b'{"format":"dpledger-ledger","format_v'])
@pytest.mark.parametrize(
    "argv", [["info"], ["info", "--json"], ["verify"], ["epsilon", "--delta", "1e-5"]]
)
def test_a_file_without_a_header_is_an_error_not_epsilon_zero(
    tmp_path: Path, capsys, content: bytes, argv: list[str]
) -> None:
    path = tmp_path / "empty.dpl"
    path.write_bytes(content)
    code, out, err = run(capsys, argv[0], str(path), *argv[1:])
    assert code == 2 and out == ""
    assert err.startswith(f"dpledger {argv[0]}: error: ") and "no complete ledger header" in err
    assert err.count("\n") == 1


def test_epsilon_of_a_torn_file_warns_first_and_strict_refuses_it(
    ledger_file: Path, capsys
) -> None:
    with open(ledger_file, "ab") as fp:
        fp.write(b'{"seq":14,"pr')
    base = ["epsilon", str(ledger_file), "--delta", "1e-5", "--accountant", "rdp"]
    code, out, err = run(capsys, *base)
    assert code == 0 and out.startswith("5 steps (the valid prefix: line 15 is cut short)")
    assert err.startswith("dpledger epsilon: warning: ") and "line 15 is incomplete" in err
    code, out, _ = run(capsys, *base, "--json")
    assert code == 0 and "line 15 is incomplete" in json.loads(out)["ledger_warnings"][0]
    for flag in ("--strict", "--require-closed"):
        code, out, err = run(capsys, *base, flag)
        assert code == 1 and out == "" and err.count("\n") == 1
        assert err.startswith("dpledger epsilon: verification failed: ") and "line 15" in err


def test_epsilon_of_an_unclosed_ledger_warns_and_require_closed_refuses_it(
    tmp_path: Path, capsys
) -> None:
    path = tmp_path / "open.dpl"
    ledger = PrivacyLedger(path)
    ledger.record_sample(sampling_probability=0.5)
    ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=2.0)
    ledger.flush()
    base = ["epsilon", str(path), "--delta", "1e-5", "--accountant", "rdp"]
    code, out, err = run(capsys, *base)
    assert code == 0 and "does not end with a close marker" in err and out.startswith("1 steps")
    code, out, err = run(capsys, *base, "--require-closed")
    assert code == 1 and out == "" and "does not end with a close marker" in err
    code, _, err = run(capsys, *base, "--strict")
    assert code == 0  # --strict asks for an intact file, which this is
    ledger.close()


@pytest.mark.parametrize(
    ("plot", "message"),
    [
        ("no/such/dir/x.png", "an existing directory"),
        ("x.notaformat", "a file name ending in one of"),
        (".", "not a directory"),
    ],
)
def test_a_bad_plot_path_is_refused_before_any_accountant_runs(
    ledger_file: Path, tmp_path: Path, monkeypatch, capsys, plot: str, message: str
) -> None:
    import dpledger.accountants.commands as commands

    def explode(*_args, **_kwargs):
        raise AssertionError("an accountant ran")

    monkeypatch.setattr(commands, "make_accountant", explode)
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "epsilon", str(ledger_file), "--delta", "1e-5", "--plot", plot)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"dpledger epsilon: error: --plot='{plot}' is invalid") and message in err


def test_an_unexpected_exception_is_one_line_with_its_type(
    ledger_file: Path, monkeypatch, capsys
) -> None:
    import dpledger.ledger.commands as commands

    def broken(*_args, **_kwargs):
        raise ZeroDivisionError("float division by zero\nsecond line")

    monkeypatch.setattr(commands, "load_for_command", broken)
    code, out, err = run(capsys, "info", str(ledger_file))
    assert code == 2 and out == ""
    assert err == (
        "dpledger info: error: internal error (ZeroDivisionError: float division by zero\\n"
        "second line); please report it\n"
    )


def test_usage_errors_are_one_line(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["epsilon", "x.dpl", "--delta"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1
    assert err.startswith("dpledger epsilon: error: argument --delta: expected one argument")


def test_a_path_with_a_nul_character_is_refused(capsys) -> None:
    code, _, err = run(capsys, "info", "a\x00b")
    assert code == 2 and err.startswith("dpledger info: error: LEDGER='a\\x00b' is invalid")
