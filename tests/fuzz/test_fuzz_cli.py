"""Fuzzing ``dpledger.cli.main`` with random and extreme arguments and damaged ledger files.

Whatever the arguments, the command exits 0, 1 or 2, never with a traceback; every line it
writes on stderr is one ``dpledger …: error|warning|verification failed: …`` line (or argparse's
one-line usage error), and a file without a complete header is exit 2 for every command that
reads it. Internal errors (an exception that is not a dpledger error, reported as one line) are
collected in INTERNAL and printed by test_tally, for the report; they are bugs to fix where they
occur.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpledger import PrivacyLedger
from dpledger.cli import main

NUMBERS = [
    "0",
    "-0",
    "1",
    "0.5",
    "1e-5",
    "1e-300",
    "5e-324",
    "1e300",
    "1e400",
    "-1",
    "nan",
    "inf",
    "-inf",
    "abc",
    "",
    "1" * 5000,
    "0x10",
    "1_000",
    "\x00",
]
INTEGERS = ["0", "1", "2", "3", "-1", "1000", "1001", "10000000", "1" * 5000, "2.5", "x", ""]
TALLY: dict[str, int] = {}
INTERNAL: list[str] = []
_LINE = re.compile(
    r"dpledger( [a-z]+)?: (error|warning|verification failed): .*"
    r"|dpledger( [a-z]+)?: error: .* \(see dpledger( [a-z]+)? --help\)"
)
_SNAKE_FLAGS = re.compile(
    r"\b(target_epsilon|noise_multiplier|sampling_probability|allow_approximation|expect_head"
    r"|require_closed)\b"
)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cli")
    good = root / "good.dpl"
    with PrivacyLedger(good, metadata={"m": 1}) as ledger:
        for _ in range(4):
            ledger.record_sample(sampling_probability=0.01, population_size=1000)
            ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0, label="g\nx")
    data = good.read_bytes()
    out = {"good": str(good), "missing": str(root / "missing.dpl"), "dir": str(root)}
    variants = {
        "empty": b"",
        "torn_header": data[:30],
        "torn_tail": data + b'{"seq":',
        "cut_mid_line": data[: len(data) - 40],
        "edited": data.replace(b'"noise_stddev":1.0', b'"noise_stddev":2.0', 1),
        "binary": bytes(range(256)) * 4,
        "not_ledger": b"hello\n",
        "non_utf8": data[:100] + b"\xff\xfe" + data[102:],
        "open": data[: data.rindex(b'{"seq":9')],
    }
    for name, content in variants.items():
        (root / f"{name}.dpl").write_bytes(content)
        out[name] = str(root / f"{name}.dpl")
    return out


HEADERLESS = ("empty", "torn_header")


@st.composite
def command_lines(draw: st.DrawFn, files: dict[str, str]) -> tuple[list[str], str]:
    command = draw(st.sampled_from(["info", "verify", "epsilon", "calibrate", "check", "junk"]))
    file_key = draw(st.sampled_from(sorted(files)))
    path = files[file_key]
    argv: list[str] = [command]
    if command in ("info", "verify", "epsilon"):
        argv.append(path)
        if draw(st.booleans()):
            argv.append("--json")
    if command in ("info", "epsilon"):
        for flag in ("--strict", "--require-closed"):
            if draw(st.integers(0, 3)) == 0:
                argv.append(flag)
    if command == "verify":
        if draw(st.booleans()):
            argv.append("--require-closed")
        if draw(st.integers(0, 3)) == 0:
            argv.append("--expect-head=" + draw(st.sampled_from(["a" * 64, "XYZ", "", "A" * 64])))
    if command == "epsilon":
        if draw(st.integers(0, 9)):
            argv.append("--delta=" + draw(st.sampled_from(NUMBERS)))
        argv.append("--accountant=" + draw(st.sampled_from(["rdp", "gdp", "rdp,gdp", "x", ","])))
        if draw(st.integers(0, 2)) == 0:
            argv.append("--curve=" + draw(st.sampled_from(INTEGERS)))
        if draw(st.integers(0, 3)) == 0:
            argv.append("--bucketing=" + draw(st.sampled_from(NUMBERS)))
        if draw(st.integers(0, 3)) == 0:
            target = draw(st.sampled_from(["out.png", "out.xyz", "", "no/such/dir/x.png", "."]))
            argv.append(
                "--plot=" + (target if target in ("", ".") else str(Path(path).parent / target))
            )
    if command == "calibrate":
        argv.append("--target-epsilon=" + draw(st.sampled_from(NUMBERS)))
        argv.append("--delta=" + draw(st.sampled_from(NUMBERS)))
        given_ = draw(st.sets(st.sampled_from(["nm", "q", "steps"]), max_size=3))
        if "nm" in given_:
            argv.append("--noise-multiplier=" + draw(st.sampled_from(NUMBERS)))
        if "q" in given_:
            argv.append("--sampling-probability=" + draw(st.sampled_from(NUMBERS)))
        if "steps" in given_:
            argv.append("--steps=" + draw(st.sampled_from(INTEGERS[:8])))
        argv.append("--accountant=" + draw(st.sampled_from(["rdp", "gdp", "all", "x"])))
        if draw(st.booleans()):
            argv.append("--allow-approximation")
    if command == "check":
        argv.append(
            draw(st.sampled_from(["nosuchmodule:f", "json:nothing", "json", ":", "os:sep"]))
        )
        if draw(st.booleans()):
            argv.append("--outputs=" + draw(st.sampled_from(INTEGERS)))
    if draw(st.integers(0, 5)) == 0:  # an unknown option or a stray argument
        argv.insert(draw(st.integers(1, len(argv))), draw(st.sampled_from(["--bogus", "x", "-"])))
    return argv, file_key


@settings(
    max_examples=250,
    deadline=None,  # the first examples import the accountants
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_any_command_line_exits_0_1_or_2_with_one_line_per_error(
    files: dict[str, str], capsys: pytest.CaptureFixture[str], data: st.DataObject
) -> None:
    argv, file_key = data.draw(command_lines(files))
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse: a usage error
        code = exc.code
        assert code == 2, argv
    captured = capsys.readouterr()
    TALLY[f"exit {code}"] = TALLY.get(f"exit {code}", 0) + 1
    assert code in (0, 1, 2), argv
    assert "Traceback" not in captured.err and "Traceback" not in captured.out
    lines = captured.err.splitlines()
    for line in lines:
        assert _LINE.fullmatch(line), (argv, line)
        assert not _SNAKE_FLAGS.search(line), (argv, line)  # flags, not Python keywords
        if "internal error" in line:
            INTERNAL.append(f"{argv!r}: {line}")
    if code == 2:
        assert sum("error:" in line for line in lines) == 1, (argv, lines)
    if code == 1 and argv[0] != "verify":
        assert sum("verification failed:" in line for line in lines) == 1, (argv, lines)
    reads_file = argv[0] in ("info", "verify", "epsilon") and "--bogus" not in argv
    if reads_file and file_key in HEADERLESS:
        assert code == 2, argv
    if code == 0 and argv[0] in ("info", "epsilon") and "--json" not in argv:
        assert captured.out  # a result was printed
    if "--json" in argv and (
        (code == 0 and argv[0] == "info") or (code < 2 and argv[0] == "verify")
    ):
        json.loads(captured.out)
    if code == 0 and "--json" in argv and argv[0] == "epsilon":
        assert all(json.loads(line) for line in captured.out.splitlines())


def test_tally() -> None:
    """Not a check: prints the exit codes seen and any internal errors (pytest -s)."""
    print(json.dumps({"tally": TALLY, "internal_errors": INTERNAL}, indent=1))
