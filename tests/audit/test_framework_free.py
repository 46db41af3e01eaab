"""The audit statistics, the checks' core and the diagnostics never import PyTorch or TensorFlow
(docs/architecture.md, "Soundness rules", rule 2), and the diagnostics import only the core."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

MODULES = [
    "dpledger.audit",
    "dpledger.audit.privacy_bounds",
    "dpledger.audit.threshold_selection",
    "dpledger.audit.audit_game",
    "dpledger.audit.game_results",
    "dpledger.audit.game_progress",
    "dpledger.audit.fdp_one_run",
    "dpledger.audit.verdict",
    "dpledger.audit.audit_plots",
    "dpledger.audit.canaries",
    "dpledger.checks",
    "dpledger.checks.checker",
    "dpledger.checks.config",
    "dpledger.checks.statistics",
    "dpledger.checks.step_driver",
    "dpledger.checks.step_harness",
    "dpledger.checks.noise_stages",
    "dpledger.checks.clipping_applied",
    "dpledger.checks.per_example_clipping",
    "dpledger.checks.noise_calibrated",
    "dpledger.checks.noise_magnitude",
    "dpledger.checks.report",
    "dpledger.checks.synthetic_data",
    "dpledger.checks.commands",
    "dpledger.diagnostics",
    "dpledger.diagnostics.bias",
    "dpledger.diagnostics.model_calibration",
    "dpledger.diagnostics.model_calibration_torch",
]


def _loaded_after_importing(modules: list[str], prefixes: tuple[str, ...]) -> list[str]:
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + f"prefixes = {prefixes!r}\n"
        + "bad = sorted({m.split('.')[0] if not m.startswith('dpledger') else m\n"
        + "              for m in sys.modules if m.startswith(prefixes)})\n"
        + "print(','.join(bad))\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    return [m for m in out.stdout.strip().split(",") if m]


def test_modules_import_no_framework_and_no_plotting_library():
    assert _loaded_after_importing(MODULES, ("torch", "tensorflow", "matplotlib", "tqdm")) == []


def test_diagnostics_import_no_adapter_audit_or_checks():
    loaded = _loaded_after_importing(
        ["dpledger.diagnostics"],
        ("dpledger.adapters", "dpledger.audit", "dpledger.checks", "torch", "tensorflow"),
    )
    assert loaded == []
