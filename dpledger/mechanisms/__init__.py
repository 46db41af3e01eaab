"""Framework-neutral mechanisms: clipping, Gaussian sum queries, noise allocation, averaging.

Samplers and sampling schemes are in :mod:`dpledger.sampling`.

McMahan & Andrew, sections 1–4. A step draws a sample (a sampling event in the ledger) and runs
one or more Gaussian sum queries on it; every query call appends one sum-query event
(S_g, σ̃_g, label) with the bound it clipped to and the noise it drew. Arrays are handled through
an :class:`ArrayBackend` (NumPy here; the PyTorch and TensorFlow adapters implement the same
protocol), so the same mechanism code runs on every framework.

Example:
    >>> import numpy as np
    >>> from dpledger import PrivacyLedger
    >>> from dpledger.mechanisms import GaussianSumQuery, sampled_step
    >>> ledger, rng = PrivacyLedger(), np.random.default_rng(0)
    >>> query = GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=1.1, label="weights")
    >>> with sampled_step(ledger, sampling_probability=0.01, population_size=10_000,
    ...                   generator=rng) as step:
    ...     (noised,) = step.run(query, np.ones((97, 4)))
    ...     (average,) = step.average([noised])
    >>> ledger.runs()[0].noise_multiplier
    1.1
"""

from dpledger.mechanisms.adaptive import AdaptiveClipping, adaptive_noise_multiplier
from dpledger.mechanisms.allocation import (
    NoiseAllocation,
    allocate,
    dimension_adjusted_noise,
    effective_noise_multiplier,
    proportional_noise,
    split_clip_by_dimension,
    split_clip_equally,
)
from dpledger.mechanisms.averaging import (
    UnaccountedReleaseWarning,
    fixed_denominator_average,
    realised_batch_average,
)
from dpledger.mechanisms.backend import Array, ArrayBackend, NumpyBackend, resolve_backend
from dpledger.mechanisms.clipping import (
    AutomaticClipping,
    ClippingStrategy,
    FlatClipping,
    GlobalClipping,
    check_clip_margin,
    check_record_norms,
    rounding_clip_margin,
)
from dpledger.mechanisms.config import DPConfig
from dpledger.mechanisms.gradient_queries import GradientQueries
from dpledger.mechanisms.grouped import GroupedSumQuery, PreparedRelease
from dpledger.mechanisms.step import SampledStep, open_step, sampled_step
from dpledger.mechanisms.sum_query import (
    GaussianSumQuery,
    ScaledGaussianSumQuery,
    SensitivityCheckError,
    clip_records,
)

__all__ = [
    "AdaptiveClipping",
    "Array",
    "ArrayBackend",
    "AutomaticClipping",
    "ClippingStrategy",
    "DPConfig",
    "FlatClipping",
    "GaussianSumQuery",
    "GlobalClipping",
    "GradientQueries",
    "GroupedSumQuery",
    "NoiseAllocation",
    "NumpyBackend",
    "PreparedRelease",
    "SampledStep",
    "ScaledGaussianSumQuery",
    "SensitivityCheckError",
    "UnaccountedReleaseWarning",
    "adaptive_noise_multiplier",
    "allocate",
    "check_clip_margin",
    "check_record_norms",
    "clip_records",
    "dimension_adjusted_noise",
    "effective_noise_multiplier",
    "fixed_denominator_average",
    "open_step",
    "proportional_noise",
    "realised_batch_average",
    "resolve_backend",
    "rounding_clip_margin",
    "sampled_step",
    "split_clip_by_dimension",
    "split_clip_equally",
]
