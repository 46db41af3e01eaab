"""Run a training script in a fresh Python process that kills itself with SIGKILL.

The write-ahead tests train a few steps in a child process, save the weights alone (no
optimizer state, no ledger flush), and kill the child with ``SIGKILL`` right after the save: no
``finally``, no ``atexit`` handler and no garbage collection runs, as in a ``kill -9`` or an
out-of-memory kill. What the ledger file holds then is what was written before the save.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_until_killed(script: Path, *args: str, timeout: float = 300) -> None:
    """Run ``python script *args`` with the repository first on the path; fail unless the
    child ended by ``SIGKILL`` (its stderr is in the failure message)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
    assert done.returncode == -signal.SIGKILL, (done.returncode, done.stderr[-4000:])
