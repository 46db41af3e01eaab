"""Deprecated path of :mod:`dpledger.checks`; kept for one release."""

import warnings

from dpledger.checks import (
    CHECK_NAMES,
    CheckConfig,
    DPSGDChecker,
    SlopeTest,
    StepHarness,
    StepOutcome,
    run_checks,
    slope_test,
)

__all__ = [
    "CHECK_NAMES",
    "CheckConfig",
    "DPSGDChecker",
    "SlopeTest",
    "StepHarness",
    "StepOutcome",
    "run_checks",
    "slope_test",
]

warnings.warn("dpledger.audit.checks moved to dpledger.checks", DeprecationWarning, stacklevel=2)
