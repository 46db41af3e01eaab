"""Deprecated path of :mod:`dpledger.checks.keras_step`; kept for one release."""

import warnings

from dpledger.checks.keras_step import (
    KerasStepHarness,
    assert_dp_sgd_correct,
    check_dp_optimizer,
    check_dp_sgd,
)

__all__ = [
    "KerasStepHarness",
    "assert_dp_sgd_correct",
    "check_dp_optimizer",
    "check_dp_sgd",
]

warnings.warn(
    "dpledger.audit.checks_keras moved to dpledger.checks.keras_step",
    DeprecationWarning,
    stacklevel=2,
)
