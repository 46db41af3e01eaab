"""Deprecated path of :mod:`dpledger.diagnostics.model_calibration_torch`; kept for one release."""

import warnings

from dpledger.diagnostics.model_calibration_torch import model_calibration, predict_probabilities

__all__ = ["model_calibration", "predict_probabilities"]

warnings.warn(
    "dpledger.audit.calibration_torch moved to dpledger.diagnostics.model_calibration_torch",
    DeprecationWarning,
    stacklevel=2,
)
