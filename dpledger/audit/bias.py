"""Deprecated path of :mod:`dpledger.diagnostics.bias`; kept for one release."""

import warnings

from dpledger.diagnostics.bias import (
    ClippingBias,
    ClippingBiasCallback,
    ClippingBiasRecorder,
    clipping_bias,
    clipping_bias_from_sums,
)

__all__ = [
    "ClippingBias",
    "ClippingBiasCallback",
    "ClippingBiasRecorder",
    "clipping_bias",
    "clipping_bias_from_sums",
]

warnings.warn(
    "dpledger.audit.bias moved to dpledger.diagnostics.bias", DeprecationWarning, stacklevel=2
)
