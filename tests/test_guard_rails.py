"""The linters and the type check run as part of the test suite.

``ruff check`` and ``ruff format --check`` cover the whole repository with the configuration in
``pyproject.toml``; ``mypy`` checks the core (the ledger, the mechanisms, the accountants, the
sampling schemes and the top-level modules they import), which must have no type errors. Each
test fails with the tool's own output, so the fix is in the failure message.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CORE_TYPE_CHECKED = (
    "dpledger/__init__.py",
    "dpledger/_version.py",
    "dpledger/errors.py",
    "dpledger/validation.py",
    "dpledger/ledger",
    "dpledger/mechanisms",
    "dpledger/accountants",
    "dpledger/sampling",
)
"""What mypy checks, relative to the repository root (a package not yet in the tree is left
out). ``[tool.mypy] files`` in ``pyproject.toml`` names the same paths for a plain ``mypy``."""


def _run(args: list[str], *, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def _report(proc: subprocess.CompletedProcess) -> str:
    return f"exit status {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


def test_ruff_check_is_clean() -> None:
    proc = _run(["ruff", "check", "--no-cache", "."])
    assert proc.returncode == 0, "ruff check . found problems:\n" + _report(proc)


def test_ruff_format_is_clean() -> None:
    proc = _run(["ruff", "format", "--check", "--no-cache", "."])
    assert proc.returncode == 0, "ruff format --check . would reformat files:\n" + _report(proc)


def _mypy(targets: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory(prefix="dpledger-mypy-") as cache:
        return _run(["mypy", "--cache-dir", cache, *targets], env=env)


def test_mypy_finds_no_errors_in_the_core() -> None:
    targets = [path for path in CORE_TYPE_CHECKED if (ROOT / path).exists()]
    assert "dpledger/ledger" in targets and "dpledger/accountants" in targets
    proc = _mypy(targets)
    assert proc.returncode == 0, "mypy found type errors in the core:\n" + _report(proc)


def test_the_checks_report_a_planted_fault(tmp_path: Path) -> None:
    """The same commands, with the project's configuration, fail on a file with known faults."""
    bad = tmp_path / "planted.py"
    bad.write_text("import os\n\n\ndef half(x: int) -> int:\n    return x / 2\n")
    config = str(ROOT / "pyproject.toml")
    lint = _run(["ruff", "check", "--no-cache", "--config", config, str(bad)])
    assert lint.returncode != 0 and "F401" in lint.stdout, _report(lint)
    bad.write_text("pair = ( 1,2 )\n")
    fmt = _run(["ruff", "format", "--check", "--no-cache", "--config", config, str(bad)])
    assert fmt.returncode != 0, _report(fmt)
    bad.write_text("def half(x: int) -> int:\n    return x / 2\n")
    types = _mypy(["--config-file", config, str(bad)])
    assert types.returncode != 0 and "planted.py:2: error" in types.stdout, _report(types)


def test_the_package_ships_type_information() -> None:
    assert (ROOT / "dpledger" / "py.typed").is_file()
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert 'dpledger = ["py.typed"]' in pyproject
