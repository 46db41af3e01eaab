"""Conservative bucketing: fewer distinct steps, still a valid upper bound.

A ledger whose noise schedule changes every step has as many distinct (q, z_eff) as steps, and
an accountant's cost grows with the number of distinct steps. The privacy loss of a
Poisson-subsampled Gaussian step is non-decreasing in q and non-increasing in z, so replacing
each step by one with q rounded *up* and z rounded *down* onto a geometric grid gives a ledger that
is at least as costly: any upper bound computed on the bucketed ledger is an upper bound for the
original one. The number of distinct steps then collapses to the number of grid cells visited.

The mirror image, :func:`optimistic_buckets` (q rounded down, z rounded up), gives a ledger that is
at most as costly as the original: any *lower* bound computed on it is a lower bound for the
original (used for certified lower bounds, never for a reported ε).
"""

from __future__ import annotations

import math

import attrs

from dpledger.errors import InvalidParameterError
from dpledger.ledger.steps import CompressedLedger, StepRun

__all__ = [
    "bucket_noise_multiplier",
    "bucket_sampling_probability",
    "check_bucketing",
    "conservative_buckets",
    "maybe_bucket",
    "optimistic_buckets",
]


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

    A step of another scheme than record-level Poisson keeps its sampling event (and its q,
    which the event fixes); only its z_eff is rounded down.

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
        if run.sampling is None
        else attrs.evolve(run, noise_multiplier=bucket_noise_multiplier(run.noise_multiplier, r))
        for run in ledger.runs
    ]
    return CompressedLedger(neighboring=ledger.neighboring, runs=tuple(rounded))


def check_bucketing(value: float | None, *, parameter: str = "bucketing") -> float | None:
    """Validate an accountant's ``bucketing`` setting: None (off) or a precision in (0, 1)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
        raise InvalidParameterError(
            parameter, value, "None (no bucketing) or a relative precision in (0, 1), e.g. 1e-3"
        )
    return float(value)


def maybe_bucket(ledger: CompressedLedger, relative_precision: float | None) -> CompressedLedger:
    """``conservative_buckets(ledger)`` when ``relative_precision`` is set, else the ledger itself.

    Bucketing keeps every step in place (it only rounds q and z), so the bucketed view of a
    prefix is the prefix of the bucketed view and step counts keep their meaning.
    """
    if relative_precision is None:
        return ledger
    return conservative_buckets(ledger, relative_precision=relative_precision)


def _round_up_to_grid(x: float, r: float) -> float:
    """The smallest grid point (1 + r)^k that is ≥ x (0, 1 and ∞ are kept as they are)."""
    if x == 0.0 or x == 1.0 or math.isinf(x):
        return x
    base = math.log1p(r)
    k = math.ceil(math.log(x) / base)
    value = math.exp(k * base)
    if value < x:
        value = math.exp((k + 1) * base)
    return value


def _round_down_to_grid(x: float, r: float) -> float:
    """The largest grid point (1 + r)^k that is ≤ x (0, 1 and ∞ are kept as they are)."""
    if x == 0.0 or x == 1.0 or math.isinf(x):
        return x
    base = math.log1p(r)
    k = math.floor(math.log(x) / base)
    value = math.exp(k * base)
    if value > x:
        value = math.exp((k - 1) * base)
    return value


def optimistic_buckets(
    ledger: CompressedLedger, *, relative_precision: float = 1e-2
) -> CompressedLedger:
    """Round every step's q down and z_eff up onto a geometric grid of ratio 1 + r.

    The result is at most as costly as the original (the mirror image of
    :func:`conservative_buckets`): use it only for lower bounds. q = 1 stays 1 (a grid point),
    so full-batch steps stay full batch.
    """
    r = _check_precision(relative_precision)
    rounded = [
        StepRun(
            _round_down_to_grid(run.sampling_probability, r),
            _round_up_to_grid(run.noise_multiplier, r),
            run.count,
        )
        if run.sampling is None
        else attrs.evolve(run, noise_multiplier=_round_up_to_grid(run.noise_multiplier, r))
        for run in ledger.runs
    ]
    return CompressedLedger(neighboring=ledger.neighboring, runs=tuple(rounded))
