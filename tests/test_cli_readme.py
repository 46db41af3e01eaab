"""The README's two commands and CI stay in step, and the demo they run works."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    return re.findall(r"```bash\n(python3\.11 -m venv [^\n]*)\n```", text)


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_second() -> None:
    demo, tests = readme_commands()
    assert demo.index("pip install torch==2.13.0") < demo.index('pip install ".[torch')
    assert demo.endswith("python examples/torch_digits.py")
    assert tests.index("pip install torch==2.13.0") < tests.index('pip install -e ".[test]"')
    assert tests.endswith("python -m pytest -n 2")
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert ci.startswith("#!/usr/bin/env bash\n")
    assert ci.rstrip("\n").splitlines()[-1] == tests
    assert os.access(REPO / ".ci" / "run", os.X_OK)


@pytest.mark.slow
def test_the_demo_records_a_ledger_that_info_shows(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    path = tmp_path / "demo.dpl"
    demo = subprocess.run(
        [sys.executable, str(REPO / "examples" / "ledger_demo.py"), str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert demo.returncode == 0, demo.stderr
    assert "200 steps, 600 events" in demo.stdout
    info = subprocess.run(
        [sys.executable, "-m", "dpledger", "info", str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert info.returncode == 0, info.stderr
    assert "steps         200" in info.stdout and "closed        yes" in info.stdout
