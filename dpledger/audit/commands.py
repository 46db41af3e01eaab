"""Deprecated path of :mod:`dpledger.checks.commands`; kept for one release."""

import warnings

from dpledger.checks.commands import load_object, register

__all__ = ["load_object", "register"]

warnings.warn(
    "dpledger.audit.commands moved to dpledger.checks.commands", DeprecationWarning, stacklevel=2
)
