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

from dpledger.mechanisms.adaptive import AdaptiveClipping
from dpledger.mechanisms.allocation import (
    dimension_adjusted_noise,
    effective_noise_multiplier,
    proportional_noise,
    split_clip_by_dimension,
    split_clip_equally,
)
from dpledger.mechanisms.backend import ArrayBackend
from dpledger.mechanisms.clipping import AutomaticClipping, FlatClipping, GlobalClipping
from dpledger.mechanisms.config import DPConfig
from dpledger.mechanisms.grouped import GroupedSumQuery
from dpledger.mechanisms.step import sampled_step
from dpledger.mechanisms.sum_query import GaussianSumQuery, ScaledGaussianSumQuery

__all__ = [
    "AdaptiveClipping",
    "ArrayBackend",
    "AutomaticClipping",
    "DPConfig",
    "FlatClipping",
    "GaussianSumQuery",
    "GlobalClipping",
    "GroupedSumQuery",
    "ScaledGaussianSumQuery",
    "dimension_adjusted_noise",
    "effective_noise_multiplier",
    "proportional_noise",
    "sampled_step",
    "split_clip_by_dimension",
    "split_clip_equally",
]
