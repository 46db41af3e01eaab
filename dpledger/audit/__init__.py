"""Audit tools: empirical privacy audits, clipping-bias and calibration metrics.

The ε lower bounds, the distinguishing-game harness, the verdict and the bias and calibration
metrics import neither PyTorch nor TensorFlow; plots import matplotlib when drawn.
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
    "Binning",
    "BonferroniThresholds",
    "BoundMethod",
    "CalibrationMetrics",
    "ClippingBias",
    "ClippingBiasCallback",
    "ConfusionCounts",
    "EpsilonLowerBound",
    "FixedThreshold",
    "GameRun",
    "GameScores",
    "HeldOutSplit",
    "ReliabilityDiagram",
    "audit_verdict",
    "calibration_metrics",
    "clipping_bias",
    "clipping_bias_from_sums",
    "clopper_pearson_epsilon_bound",
    "derive_run_seed",
    "epsilon_bound_from_scores",
    "gaussian_dp_epsilon_bound",
    "one_run_epsilon_bound",
    "one_run_epsilon_bound_from_scores",
    "one_run_p_value",
    "plot_bound_versus_runs",
    "plot_reliability_diagram",
    "plot_score_distributions",
    "run_distinguishing_game",
]
