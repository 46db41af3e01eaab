"""Deprecated path of :mod:`dpledger.diagnostics.model_calibration`; kept for one release.

``CalibrationMetrics`` and ``calibration_metrics`` are now ``ModelCalibrationMetrics`` and
``model_calibration_metrics``.
"""

import warnings

from dpledger.diagnostics.model_calibration import (
    Binning,
    ReliabilityDiagram,
    plot_reliability_diagram,
)
from dpledger.diagnostics.model_calibration import (
    ModelCalibrationMetrics as CalibrationMetrics,
)
from dpledger.diagnostics.model_calibration import (
    model_calibration_metrics as calibration_metrics,
)

__all__ = [
    "Binning",
    "CalibrationMetrics",
    "ReliabilityDiagram",
    "calibration_metrics",
    "plot_reliability_diagram",
]

warnings.warn(
    "dpledger.audit.calibration_metrics moved to dpledger.diagnostics.model_calibration "
    "(CalibrationMetrics and calibration_metrics are now ModelCalibrationMetrics and "
    "model_calibration_metrics)",
    DeprecationWarning,
    stacklevel=2,
)
