"""Conservative bucketing: fewer distinct steps, still a valid upper bound.

A ledger whose noise schedule changes every step has as many distinct (q, z_eff) as steps, and
an accountant's cost grows with the number of distinct steps. The privacy loss of a
Poisson-subsampled Gaussian step is non-decreasing in q and non-increasing in z, so replacing
each step by one with q rounded *up* and z rounded *down* onto a geometric grid gives a ledger that
is at least as costly: any upper bound computed on the bucketed ledger is an upper bound for the
original one. The number of distinct steps then collapses to the number of grid cells visited.
"""

from __future__ import annotations

import math

from dpledger.errors import InvalidParameterError
from dpledger.ledger.steps import CompressedLedger, StepRun

__all__ = ["bucket_noise_multiplier", "bucket_sampling_probability", "conservative_buckets"]


def _check_precision(relative_precision: float) -> float:
    if (
        isinstance(relative_precision, bool)
        or not isinstance(relative_precision, (int, float))
        or not 0.0 < relative_precision < 1.0
    ):
        raise InvalidParameterError(
            "relative_precision", relative_precision, "a number in the open interval (0, 1)"
        )
    return float(relative_precision)


def bucket_noise_multiplier(z: float, relative_precision: float) -> float:
    """The largest grid point (1 + r)^k that is ≤ z (0 and ∞ are kept as they are)."""
    r = _check_precision(relative_precision)
    if z == 0.0 or math.isinf(z):
        return z
    base = math.log1p(r)
    k = math.floor(math.log(z) / base)
    value = math.exp(k * base)
    if value > z:  # exp/log rounding put us one cell too high: the next cell down is below z
        value = math.exp((k - 1) * base)
    return value


def bucket_sampling_probability(q: float, relative_precision: float) -> float:
    """The smallest grid point (1 + r)^(-k) that is ≥ q, capped at 1 (0 is kept as it is)."""
    r = _check_precision(relative_precision)
    if q == 0.0 or q == 1.0:
        return q
    base = math.log1p(r)
    k = math.ceil(math.log(q) / base)
    value = math.exp(k * base)
    if value < q:  # exp/log rounding put us one cell too low: the next cell up is above q
        value = math.exp((k + 1) * base)
    return min(value, 1.0)


def conservative_buckets(
    ledger: CompressedLedger, *, relative_precision: float = 1e-3
) -> CompressedLedger:
    """Round every step's q up and z_eff down onto a geometric grid of ratio 1 + r.

    Args:
        ledger: the compressed ledger.
        relative_precision: r; each q grows and each z shrinks by a factor of at most 1 + r.

    Returns:
        A compressed ledger with the same steps in the same order whose privacy loss dominates
        the original's; adjacent steps that land in the same cell are merged into one run.
    """
    r = _check_precision(relative_precision)
    rounded = [
        StepRun(
            bucket_sampling_probability(run.sampling_probability, r),
            bucket_noise_multiplier(run.noise_multiplier, r),
            run.count,
        )
        for run in ledger.runs
    ]
    return CompressedLedger(neighboring=ledger.neighboring, runs=tuple(rounded))
