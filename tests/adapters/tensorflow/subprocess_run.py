"""Run one of this folder's scripts in a fresh Python process and read the JSON it prints last.

The MirroredStrategy tests need two logical CPUs, which TensorFlow fixes when it first starts:
their runs happen in a subprocess, whatever the test process has already set up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def json_of_script(name: str, *, timeout: float = 300) -> dict:
    """The last stdout line of ``python <this folder>/<name>``, parsed as JSON; the script's
    stderr is in the failure message if it exits with an error."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name(name))],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
