"""Deprecated: the NumPy Poisson sampler is :class:`dpledger.sampling.PoissonSampler`.

This module is its former home, kept for one release; importing it warns.
"""

import warnings

from dpledger.sampling.poisson import MAX_POPULATION, PoissonSampler

__all__ = ["MAX_POPULATION", "PoissonSampler"]

warnings.warn(
    "dpledger.mechanisms.sampling moved to dpledger.sampling "
    "(from dpledger.sampling import PoissonSampler)",
    DeprecationWarning,
    stacklevel=2,
)
