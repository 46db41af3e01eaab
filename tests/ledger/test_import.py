"""``import dpledger`` stays light: no dp-accounting, torch or tensorflow until they are needed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_import_dpledger_loads_no_heavy_module() -> None:
    code = (
        "import sys, dpledger, dpledger.ledger, dpledger.cli\n"
        "heavy = [m for m in ('dp_accounting', 'torch', 'tensorflow', 'jax', 'matplotlib')"
        " if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


@pytest.mark.slow
def test_dp_accounting_is_imported_only_for_to_dp_event() -> None:
    code = (
        "import sys\n"
        "from dpledger import PrivacyLedger\n"
        "ledger = PrivacyLedger()\n"
        "ledger.record_sample(sampling_probability=0.1)\n"
        "ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0)\n"
        "ledger.compressed()\n"
        "assert 'dp_accounting' not in sys.modules\n"
        "ledger.to_dp_event()\n"
        "assert 'dp_accounting' in sys.modules\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
