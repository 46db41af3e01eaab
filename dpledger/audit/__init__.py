"""Audit tools: empirical privacy audits, clipping-bias and calibration metrics, and the
implementation-bug checks for DP-SGD.

The ε lower bounds, the distinguishing-game harness, the verdict, the bias and calibration
metrics and the core of the implementation-bug checks import neither PyTorch nor TensorFlow;
plots import matplotlib when drawn. The checks' framework conveniences live in
``dpledger.audit.checks_torch`` and ``dpledger.audit.checks_keras``; the canaries
(``dpledger.audit.canaries``) are framework-free, and the training functions that audit the
PyTorch adapter on the digits live in ``dpledger.audit.torch_audit`` (imports torch); a PyTorch
classifier's predictions go into the calibration metrics through
``dpledger.audit.calibration_torch``.
"""

from dpledger.audit.audit_game import (
    GameRun,
    GameScores,
    derive_run_seed,
    run_distinguishing_game,
)
from dpledger.audit.audit_plots import plot_bound_versus_runs, plot_score_distributions
from dpledger.audit.bias import (
    ClippingBias,
    ClippingBiasCallback,
    ClippingBiasRecorder,
    clipping_bias,
    clipping_bias_from_sums,
)
from dpledger.audit.calibration_metrics import (
    Binning,
    CalibrationMetrics,
    ReliabilityDiagram,
    calibration_metrics,
    plot_reliability_diagram,
)
from dpledger.audit.canaries import (
    GradientCanary,
    InputCanary,
    dirac_gradient_canary,
    loss_score,
    mislabeled_canary,
    out_of_distribution_canary,
)
from dpledger.audit.check_report import CheckReport, CheckResult, Curve, Verdict
from dpledger.audit.checks import (
    CHECK_NAMES,
    CheckConfig,
    DPSGDChecker,
    StepHarness,
    StepOutcome,
    run_checks,
)
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
    "CHECK_NAMES",
    "AuditVerdict",
    "Binning",
    "BonferroniThresholds",
    "BoundMethod",
    "CalibrationMetrics",
    "CheckConfig",
    "CheckReport",
    "CheckResult",
    "ClippingBias",
    "ClippingBiasCallback",
    "ClippingBiasRecorder",
    "ConfusionCounts",
    "Curve",
    "DPSGDChecker",
    "EpsilonLowerBound",
    "FixedThreshold",
    "GameRun",
    "GameScores",
    "GradientCanary",
    "HeldOutSplit",
    "InputCanary",
    "ReliabilityDiagram",
    "StepHarness",
    "StepOutcome",
    "Verdict",
    "audit_verdict",
    "calibration_metrics",
    "clipping_bias",
    "clipping_bias_from_sums",
    "clopper_pearson_epsilon_bound",
    "derive_run_seed",
    "dirac_gradient_canary",
    "epsilon_bound_from_scores",
    "gaussian_dp_epsilon_bound",
    "loss_score",
    "mislabeled_canary",
    "one_run_epsilon_bound",
    "one_run_epsilon_bound_from_scores",
    "one_run_p_value",
    "out_of_distribution_canary",
    "plot_bound_versus_runs",
    "plot_reliability_diagram",
    "plot_score_distributions",
    "run_checks",
    "run_distinguishing_game",
]
