"""Empirical privacy audits: lower bounds on ε from a distinguishing game, threshold selection,
the verdict against an accountant's claim, canaries, plots, and the training functions that audit
the PyTorch adapter on the digits.

The ε lower bounds, the distinguishing-game harness, the verdict and the canaries import neither
PyTorch nor TensorFlow; plots import matplotlib when drawn; :mod:`dpledger.audit.torch_audit`
imports torch.
"""

from dpledger.audit.audit_game import GameRun, bound_progress, run_distinguishing_game
from dpledger.audit.audit_plots import plot_bound_versus_runs, plot_score_distributions
from dpledger.audit.threshold_selection import HeldOutSplit
from dpledger.audit.verdict import AuditVerdict, audit_verdict

__all__ = [
    "AuditVerdict",
    "GameRun",
    "HeldOutSplit",
    "audit_verdict",
    "bound_progress",
    "plot_bound_versus_runs",
    "plot_score_distributions",
    "run_distinguishing_game",
]
