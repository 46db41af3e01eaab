"""Training diagnostics: the bias clipping adds to a gradient and the model calibration of a
classifier.

Both import only numpy and the core; :mod:`dpledger.diagnostics.model_calibration_torch` turns a
PyTorch classifier's predictions into the model-calibration metrics and imports torch only when
called. "Calibration" here is the calibration of a model's predicted probabilities; the noise
calibration of a privacy guarantee is in :mod:`dpledger.accountants`.

The metrics are computed from whatever data they are given: evaluated on private data, they are
not differentially private.
"""

from dpledger.diagnostics.bias import (
    ClippingBias,
    ClippingBiasCallback,
    ClippingBiasRecorder,
    clipping_bias,
    clipping_bias_from_sums,
)
from dpledger.diagnostics.model_calibration import (
    Binning,
    ModelCalibrationMetrics,
    ReliabilityDiagram,
    model_calibration_metrics,
    plot_reliability_diagram,
)
from dpledger.diagnostics.model_calibration_torch import model_calibration, predict_probabilities

__all__ = [
    "Binning",
    "ClippingBias",
    "ClippingBiasCallback",
    "ClippingBiasRecorder",
    "ModelCalibrationMetrics",
    "ReliabilityDiagram",
    "clipping_bias",
    "clipping_bias_from_sums",
    "model_calibration",
    "model_calibration_metrics",
    "plot_reliability_diagram",
    "predict_probabilities",
]
