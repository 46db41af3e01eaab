"""audit."""

from dpledger.audit.check_report import CheckReport, CheckResult, Curve, Verdict
from dpledger.audit.checks import (
    CHECK_NAMES,
    CheckConfig,
    DPSGDChecker,
    StepHarness,
    StepOutcome,
    run_checks,
)

__all__: list[str] = [
    "CHECK_NAMES",
    "CheckConfig",
    "CheckReport",
    "CheckResult",
    "Curve",
    "DPSGDChecker",
    "StepHarness",
    "StepOutcome",
    "Verdict",
    "run_checks",
]
