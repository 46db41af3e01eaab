"""Empirical privacy audits: lower bounds on ε from a distinguishing game, threshold selection,
the verdict against an accountant's claim, canaries, plots, and the training functions that audit
the PyTorch adapter on the digits.

The ε lower bounds, the distinguishing-game harness, the verdict and the canaries import neither
PyTorch nor TensorFlow; plots import matplotlib when drawn; :mod:`dpledger.audit.torch_audit`
imports torch.

The implementation-bug checks moved to :mod:`dpledger.checks` and the clipping-bias and
model-calibration metrics to :mod:`dpledger.diagnostics`; their old names here still work for one
release and raise a :class:`DeprecationWarning` naming the new location.
"""

import importlib
import warnings
from typing import Any

from dpledger.audit.audit_game import (
    GameInterruptedError,
    GameRun,
    GameScores,
    bound_progress,
    derive_run_seed,
    run_distinguishing_game,
)
from dpledger.audit.audit_plots import plot_bound_versus_runs, plot_score_distributions
from dpledger.audit.canaries import (
    GradientCanary,
    InputCanary,
    dirac_gradient_canary,
    loss_score,
    mislabeled_canary,
    out_of_distribution_canary,
)
from dpledger.audit.fdp_one_run import fdp_one_run_epsilon_bound, fdp_one_run_mu_bound
from dpledger.audit.privacy_bounds import (
    BoundMethod,
    ConfusionCounts,
    EpsilonLowerBound,
    clopper_pearson_epsilon_bound,
    gaussian_dp_epsilon_bound,
    one_run_epsilon_bound,
    one_run_p_value,
)
from dpledger.audit.threshold_selection import (
    BonferroniThresholds,
    FixedThreshold,
    HeldOutSplit,
    epsilon_bound_from_scores,
    one_run_epsilon_bound_from_scores,
)
from dpledger.audit.verdict import AuditVerdict, audit_verdict

__all__ = [
    "AuditVerdict",
    "BonferroniThresholds",
    "BoundMethod",
    "ConfusionCounts",
    "EpsilonLowerBound",
    "FixedThreshold",
    "GameInterruptedError",
    "GameRun",
    "GameScores",
    "GradientCanary",
    "HeldOutSplit",
    "InputCanary",
    "audit_verdict",
    "bound_progress",
    "clopper_pearson_epsilon_bound",
    "derive_run_seed",
    "dirac_gradient_canary",
    "epsilon_bound_from_scores",
    "fdp_one_run_epsilon_bound",
    "fdp_one_run_mu_bound",
    "gaussian_dp_epsilon_bound",
    "loss_score",
    "mislabeled_canary",
    "one_run_epsilon_bound",
    "one_run_epsilon_bound_from_scores",
    "one_run_p_value",
    "out_of_distribution_canary",
    "plot_bound_versus_runs",
    "plot_score_distributions",
    "run_distinguishing_game",
]

_CHECKS = "dpledger.checks"
_DIAGNOSTICS = "dpledger.diagnostics"

MOVED_NAMES: dict[str, tuple[str, str]] = {
    "CHECK_NAMES": (_CHECKS, "CHECK_NAMES"),
    "CheckConfig": (_CHECKS, "CheckConfig"),
    "CheckReport": (_CHECKS, "CheckReport"),
    "CheckResult": (_CHECKS, "CheckResult"),
    "Curve": (_CHECKS, "Curve"),
    "DPSGDChecker": (_CHECKS, "DPSGDChecker"),
    "StepHarness": (_CHECKS, "StepHarness"),
    "StepOutcome": (_CHECKS, "StepOutcome"),
    "Verdict": (_CHECKS, "Verdict"),
    "run_checks": (_CHECKS, "run_checks"),
    "ClippingBias": (_DIAGNOSTICS, "ClippingBias"),
    "ClippingBiasCallback": (_DIAGNOSTICS, "ClippingBiasCallback"),
    "ClippingBiasRecorder": (_DIAGNOSTICS, "ClippingBiasRecorder"),
    "clipping_bias": (_DIAGNOSTICS, "clipping_bias"),
    "clipping_bias_from_sums": (_DIAGNOSTICS, "clipping_bias_from_sums"),
    "Binning": (_DIAGNOSTICS, "Binning"),
    "CalibrationMetrics": (_DIAGNOSTICS, "ModelCalibrationMetrics"),
    "ReliabilityDiagram": (_DIAGNOSTICS, "ReliabilityDiagram"),
    "calibration_metrics": (_DIAGNOSTICS, "model_calibration_metrics"),
    "plot_reliability_diagram": (_DIAGNOSTICS, "plot_reliability_diagram"),
}
"""Names that moved out of ``dpledger.audit``: old name → (new module, new name)."""


def __getattr__(name: str) -> Any:
    """The moved names, with a :class:`DeprecationWarning` naming their new location."""
    if name not in MOVED_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, new_name = MOVED_NAMES[name]
    warnings.warn(
        f"dpledger.audit.{name} moved to {module}.{new_name}; the old name will be removed in "
        "the next release",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(module), new_name)
