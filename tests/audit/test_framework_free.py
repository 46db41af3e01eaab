"""The audit statistics and metrics never import PyTorch or TensorFlow (design rule 2)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

MODULES = [
    "dpledger.audit.privacy_bounds",
    "dpledger.audit.threshold_selection",
    "dpledger.audit.audit_game",
    "dpledger.audit.verdict",
    "dpledger.audit.audit_plots",
    "dpledger.audit.bias",
    "dpledger.audit.calibration_metrics",
]


def test_modules_import_no_framework_and_no_plotting_library():
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in MODULES)
        + "bad = [m for m in ('torch', 'tensorflow', 'matplotlib', 'tqdm') if m in sys.modules]\n"
        + "print(','.join(bad))\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip() == ""
