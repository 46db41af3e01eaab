"""Deprecated path of :mod:`dpledger.checks.torch_step`; kept for one release."""

import warnings

from dpledger.checks.torch_step import (
    TorchStepHarness,
    assert_dp_sgd_correct,
    check_dp_optimizer,
    check_dp_sgd,
    default_mlp,
    run_for_command,
)

__all__ = [
    "TorchStepHarness",
    "assert_dp_sgd_correct",
    "check_dp_optimizer",
    "check_dp_sgd",
    "default_mlp",
    "run_for_command",
]

warnings.warn(
    "dpledger.audit.checks_torch moved to dpledger.checks.torch_step",
    DeprecationWarning,
    stacklevel=2,
)
