"""Empirical privacy audits: lower bounds on ε from a distinguishing game, threshold selection,
the verdict against an accountant's claim, canaries, plots, and the training functions that audit
the PyTorch adapter on the digits.

The ε lower bounds, the distinguishing-game harness, the verdict and the canaries import neither
PyTorch nor TensorFlow; plots import matplotlib when drawn; :mod:`dpledger.audit.torch_audit`
imports torch.
"""

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
