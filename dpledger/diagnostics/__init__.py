"""Training diagnostics: the bias clipping adds to a gradient and the model calibration of a
classifier.

Both import only numpy and the core; :mod:`dpledger.diagnostics.model_calibration_torch` turns a
PyTorch classifier's predictions into the model-calibration metrics and imports torch only when
called. "Calibration" here is the calibration of a model's predicted probabilities; the noise
calibration of a privacy guarantee is in :mod:`dpledger.accountants`.

The metrics are computed from whatever data they are given: evaluated on private data, they are
not differentially private.
"""

from dpledger.diagnostics.bias import ClippingBias, ClippingBiasCallback, clipping_bias
from dpledger.diagnostics.model_calibration import ModelCalibrationMetrics, plot_reliability_diagram
from dpledger.diagnostics.model_calibration_torch import model_calibration

__all__ = [
    "ClippingBias",
    "ClippingBiasCallback",
    "ModelCalibrationMetrics",
    "clipping_bias",
    "model_calibration",
    "plot_reliability_diagram",
]
