"""Deprecated path of :mod:`dpledger.checks.report`; kept for one release."""

import warnings

from dpledger.checks.report import (
    CheckReport,
    CheckResult,
    Curve,
    Verdict,
)

__all__ = [
    "CheckReport",
    "CheckResult",
    "Curve",
    "Verdict",
]

warnings.warn(
    "dpledger.audit.check_report moved to dpledger.checks.report", DeprecationWarning, stacklevel=2
)
