"""Implementation-bug checks for DP-SGD: drive a training step as a black box on synthetic data
and test that it clips per example and adds noise of the stated scale.

The driver (:mod:`dpledger.checks.step_driver`), the statistics
(:mod:`dpledger.checks.statistics`) and the four checks, one module each, import neither PyTorch
nor TensorFlow. The conveniences for a PyTorch or Keras step function are
:mod:`dpledger.checks.torch_step` and :mod:`dpledger.checks.keras_step`, which share
:mod:`dpledger.checks.step_function`; ``dpledger check`` (:mod:`dpledger.checks.commands`) runs
the checks on a PyTorch step function from the command line.
"""

from dpledger.checks.checker import DPSGDChecker, run_checks
from dpledger.checks.config import CheckConfig
from dpledger.checks.report import CheckReport, CheckResult, Verdict

__all__ = ["CheckConfig", "CheckReport", "CheckResult", "DPSGDChecker", "Verdict", "run_checks"]
