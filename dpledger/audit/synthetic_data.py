"""Deprecated path of :mod:`dpledger.checks.synthetic_data`; kept for one release."""

import warnings

from dpledger.checks.synthetic_data import (
    ClippingPool,
    LabelKind,
    LossKind,
    cross_entropy_residual,
    large_gradient_targets,
    make_clipping_pool,
    ordinary_batch,
    softmax,
    zero_gradient_targets,
)

__all__ = [
    "ClippingPool",
    "LabelKind",
    "LossKind",
    "cross_entropy_residual",
    "large_gradient_targets",
    "make_clipping_pool",
    "ordinary_batch",
    "softmax",
    "zero_gradient_targets",
]

warnings.warn(
    "dpledger.audit.synthetic_data moved to dpledger.checks.synthetic_data",
    DeprecationWarning,
    stacklevel=2,
)
