"""Splitting a clip bound and a noise budget over the groups of one sample (McMahan & Andrew, §3–4).

A sample feeding G Gaussian sum queries with privacy tuples (S_g, σ̃_g) is, for accounting, one
Gaussian sum query with noise multiplier (paper Eq. 1)

    z_eff = (Σ_g (S_g / σ̃_g)²)^(-1/2).

Clip splits (for m groups out of a total L2 bound S*; both keep Σ_g S_g² = S*²):

- equal ("per-layer clipping", McMahan et al. 2018): S_g = S*/√m;
- by dimension: S_g = S*·√(d_g/D), with d_g the number of coordinates of group g and D = Σ d_g.
  (The paper's text writes S*/√(d_g/D); the ratio must be d_g/D for Σ_g S_g² = S*² to hold.)

Noise allocations for a target z (both give z_eff = z exactly, up to float rounding):

- proportional: σ̃_g = z·√G·S_g, so every term of Eq. 1 is 1/(G z²);
- dimension-adjusted: σ̃_g = z·√(D/d_g)·S_g, so the terms are d_g/(D z²) (noise proportional to
  the largest root-mean-square coordinate a group's bound allows).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import attrs

from dpledger.errors import InvalidParameterError
from dpledger.ledger.events import inverse_square_term
from dpledger.ledger.steps import noise_multiplier_from_inverse_square_sum as _z_from_sum
from dpledger.mechanisms.clipping import ClippingStrategy
from dpledger.mechanisms.sum_query import GaussianSumQuery
from dpledger.validation import check_non_negative_finite, check_positive_finite, check_positive_int

__all__ = [
    "CLIP_SPLITS",
    "NOISE_ALLOCATIONS",
    "NoiseAllocation",
    "allocate",
    "check_allocation_methods",
    "dimension_adjusted_noise",
    "effective_noise_multiplier",
    "proportional_noise",
    "split_clip_by_dimension",
    "split_clip_equally",
]

MAX_GROUPS = 1 << 24
"""The most groups one sample may feed (a larger count is a bug, not a model)."""
MAX_DIMENSION = 1 << 62
"""The largest number of coordinates of one group (keeps D/d_g exact enough in float64)."""

CLIP_SPLITS = ("equal", "dimension")
NOISE_ALLOCATIONS = ("proportional", "dimension")


def _floats(name: str, values: Any, check: Any) -> tuple[float, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise InvalidParameterError(name, values, "a non-empty sequence of numbers")
    if len(values) == 0:
        raise InvalidParameterError(name, values, "at least one group")
    return tuple(check(f"{name}[{g}]", v) for g, v in enumerate(values))


def _dimensions(values: Any) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise InvalidParameterError("dimensions", values, "a non-empty sequence of integers >= 1")
    if len(values) == 0:
        raise InvalidParameterError("dimensions", values, "at least one group")
    out = []
    for g, d in enumerate(values):
        if isinstance(d, numbers.Integral) and not isinstance(d, bool):
            d = int(d)
        d = check_positive_int(f"dimensions[{g}]", d)
        if d > MAX_DIMENSION:
            raise InvalidParameterError(
                f"dimensions[{g}]", d, f"an integer in [1, 2**62 = {MAX_DIMENSION}]"
            )
        out.append(d)
    return tuple(out)


def _checked_tuple(name: str, values: Any, *, positive: bool) -> tuple[float, ...]:
    """``values`` as a tuple of finite floats (> 0 if ``positive``, else ≥ 0): an allocation
    whose arithmetic overflowed (σ̃_g = ∞) or underflowed (S_g = 0) is refused, naming the
    group, instead of reaching a query or the ledger."""
    out = tuple(float(v) for v in values)
    for g, v in enumerate(out):
        if not (math.isfinite(v) and (v > 0.0 if positive else v >= 0.0)):
            raise InvalidParameterError(
                f"{name}[{g}]",
                v,
                "a finite value "
                + ("> 0" if positive else ">= 0")
                + ": the inputs (bound, noise multiplier, dimensions) are so extreme that "
                "the allocation overflows or underflows float64; use less extreme values",
            )
    return out


def effective_noise_multiplier(
    *, l2_norm_bounds: Sequence[float], noise_stddevs: Sequence[float]
) -> float:
    """z_eff = (Σ_g (S_g/σ̃_g)²)^(-1/2) of one sample's queries (paper Eq. 1).

    Computed with the same arithmetic as the ledger (the exact σ̃/S for a single query; a
    σ̃_g = 0 gives 0), so it equals the z_eff the ledger reports for a step with these queries.

    Raises:
        InvalidParameterError: empty or mismatched sequences, S_g ≤ 0, σ̃_g < 0, or non-finite.
    """
    bounds = _floats("l2_norm_bounds", l2_norm_bounds, check_positive_finite)
    stddevs = _floats("noise_stddevs", noise_stddevs, check_non_negative_finite)
    if len(bounds) != len(stddevs):
        raise InvalidParameterError(
            "noise_stddevs",
            f"{len(stddevs)} values",
            f"one per group: {len(bounds)} values like l2_norm_bounds",
        )
    if len(bounds) == 1:
        return stddevs[0] / bounds[0]
    total = 0.0
    for s, sigma in zip(bounds, stddevs, strict=True):
        total += inverse_square_term(s, sigma)  # (S/σ̃)² as the ledger computes it (∞ if σ̃ = 0)
    return _z_from_sum(total, len(bounds))


def split_clip_equally(*, total_l2_norm_bound: float, num_groups: int) -> tuple[float, ...]:
    """S_g = S*/√m for each of m groups ("per-layer clipping"); Σ_g S_g² = S*².

    Raises:
        InvalidParameterError: S* ≤ 0 or not finite, or m not an integer ≥ 1.
    """
    total = check_positive_finite("total_l2_norm_bound", total_l2_norm_bound)
    m = check_positive_int("num_groups", num_groups)
    if m > MAX_GROUPS:
        raise InvalidParameterError("num_groups", num_groups, f"an integer in [1, {MAX_GROUPS}]")
    # every group gets the same bound: check it once, not m times (m may be millions)
    (bound,) = _checked_tuple("l2_norm_bounds", (total / math.sqrt(m),), positive=True)
    return (bound,) * m


def split_clip_by_dimension(
    *, total_l2_norm_bound: float, dimensions: Sequence[int]
) -> tuple[float, ...]:
    """S_g = S*·√(d_g/D) with D = Σ_g d_g; Σ_g S_g² = S*².

    Raises:
        InvalidParameterError: S* ≤ 0 or not finite, or a dimension that is not an integer ≥ 1.
    """
    total = check_positive_finite("total_l2_norm_bound", total_l2_norm_bound)
    dims = _dimensions(dimensions)
    full = sum(dims)
    return _checked_tuple(
        "l2_norm_bounds", tuple(total * math.sqrt(d / full) for d in dims), positive=True
    )


@attrs.frozen
class NoiseAllocation:
    """Per-group privacy tuples (S_g, σ̃_g) chosen for a target noise multiplier.

    Attributes:
        l2_norm_bounds: S_g per group.
        noise_stddevs: σ̃_g per group.
        target_noise_multiplier: the z the allocation was asked for.
    """

    l2_norm_bounds: tuple[float, ...] = attrs.field(
        converter=lambda v: _checked_tuple("l2_norm_bounds", v, positive=True)
    )
    noise_stddevs: tuple[float, ...] = attrs.field(
        converter=lambda v: _checked_tuple("noise_stddevs", v, positive=False)
    )
    target_noise_multiplier: float

    @property
    def effective_noise_multiplier(self) -> float:
        """z_eff of paper Eq. 1 for these tuples (equals the target up to float rounding)."""
        return effective_noise_multiplier(
            l2_norm_bounds=self.l2_norm_bounds, noise_stddevs=self.noise_stddevs
        )

    def queries(
        self,
        *,
        labels: Sequence[str | None] | None = None,
        clipping: ClippingStrategy | str | Sequence[ClippingStrategy | str] = "flat",
        check_sensitivity: bool = True,
    ) -> tuple[GaussianSumQuery, ...]:
        """One :class:`GaussianSumQuery` (separate clipping) per group with these tuples.

        Args:
            labels: one label per group (default: no labels).
            clipping: one strategy for all groups, or one per group.
            check_sensitivity: passed to every query.
        """
        count = len(self.l2_norm_bounds)
        names = [None] * count if labels is None else list(labels)
        if len(names) != count:
            raise InvalidParameterError("labels", labels, f"one label per group ({count})")
        if isinstance(clipping, (str, ClippingStrategy)):
            strategies = [clipping] * count
        else:
            strategies = list(clipping)
            if len(strategies) != count:
                raise InvalidParameterError(
                    "clipping", clipping, f"one strategy, or one per group ({count})"
                )
        return tuple(
            GaussianSumQuery(
                l2_norm_bound=s,
                noise_stddev=sigma,
                clipping=c,
                label=name,
                check_sensitivity=check_sensitivity,
            )
            for s, sigma, c, name in zip(
                self.l2_norm_bounds, self.noise_stddevs, strategies, names, strict=True
            )
        )


def proportional_noise(
    *, noise_multiplier: float, l2_norm_bounds: Sequence[float]
) -> NoiseAllocation:
    """σ̃_g = z·√G·S_g for G groups: noise proportional to each group's bound; z_eff = z.

    Raises:
        InvalidParameterError: z ≤ 0 or not finite, or a bound ≤ 0 or not finite.
    """
    z = check_positive_finite("noise_multiplier", noise_multiplier)
    bounds = _floats("l2_norm_bounds", l2_norm_bounds, check_positive_finite)
    factor = z * math.sqrt(len(bounds))
    return NoiseAllocation(bounds, tuple(factor * s for s in bounds), z)


def dimension_adjusted_noise(
    *, noise_multiplier: float, l2_norm_bounds: Sequence[float], dimensions: Sequence[int]
) -> NoiseAllocation:
    """σ̃_g = z·√(D/d_g)·S_g with D = Σ_g d_g; z_eff = z.

    Raises:
        InvalidParameterError: z ≤ 0 or not finite, a bad bound or dimension, or a different
            number of bounds and dimensions.
    """
    z = check_positive_finite("noise_multiplier", noise_multiplier)
    bounds = _floats("l2_norm_bounds", l2_norm_bounds, check_positive_finite)
    dims = _dimensions(dimensions)
    if len(dims) != len(bounds):
        raise InvalidParameterError(
            "dimensions", dimensions, f"one dimension per group ({len(bounds)})"
        )
    full = sum(dims)
    return NoiseAllocation(
        bounds, tuple(z * math.sqrt(full / d) * s for s, d in zip(bounds, dims, strict=True)), z
    )


def check_allocation_methods(*, clip_split: Any, noise_allocation: Any) -> None:
    """Raise unless ``clip_split`` is one of :data:`CLIP_SPLITS` and ``noise_allocation`` one of
    :data:`NOISE_ALLOCATIONS`.

    Raises:
        InvalidParameterError: naming the bad argument.
    """
    if clip_split not in CLIP_SPLITS:
        raise InvalidParameterError("clip_split", clip_split, "'equal' or 'dimension'")
    if noise_allocation not in NOISE_ALLOCATIONS:
        raise InvalidParameterError(
            "noise_allocation", noise_allocation, "'proportional' or 'dimension'"
        )


def allocate(
    *,
    l2_norm_bound: float,
    noise_multiplier: float,
    dimensions: Sequence[int],
    clip_split: str = "equal",
    noise_allocation: str = "proportional",
) -> NoiseAllocation:
    """(S_g, σ̃_g) for the groups of one sample from a total bound S* and a target z.

    One group gets (S*, z·S*). Several groups split S* by ``clip_split`` (``"equal"``:
    :func:`split_clip_equally`; ``"dimension"``: :func:`split_clip_by_dimension`) and allocate
    the noise by ``noise_allocation`` (``"proportional"``: :func:`proportional_noise`;
    ``"dimension"``: :func:`dimension_adjusted_noise`), so z_eff = z. z = 0 gives σ̃_g = 0 for
    every group (recorded as such: ε = ∞).

    Args:
        l2_norm_bound: S* > 0, the bound on a record's whole contribution.
        noise_multiplier: z ≥ 0.
        dimensions: d_g ≥ 1, the number of coordinates of each group (one entry per group).
        clip_split: ``"equal"`` or ``"dimension"``.
        noise_allocation: ``"proportional"`` or ``"dimension"``.

    Raises:
        InvalidParameterError: naming the bad argument.
    """
    check_allocation_methods(clip_split=clip_split, noise_allocation=noise_allocation)
    total = check_positive_finite("l2_norm_bound", l2_norm_bound)
    z = check_non_negative_finite("noise_multiplier", noise_multiplier)
    if isinstance(dimensions, (str, bytes)) or not isinstance(dimensions, Sequence):
        raise InvalidParameterError("dimensions", dimensions, "one entry per group")
    count = len(dimensions)
    if count == 0:
        raise InvalidParameterError("dimensions", dimensions, "at least one group")
    if count == 1:
        return NoiseAllocation((total,), (z * total,), z)
    # The dimensions are checked where they are used (the "dimension" split and allocation).
    if clip_split == "equal":
        bounds = split_clip_equally(total_l2_norm_bound=total, num_groups=count)
    else:
        bounds = split_clip_by_dimension(total_l2_norm_bound=total, dimensions=dimensions)
    if z == 0.0:
        return NoiseAllocation(bounds, (0.0,) * count, z)
    if noise_allocation == "proportional":
        return proportional_noise(noise_multiplier=z, l2_norm_bounds=bounds)
    return dimension_adjusted_noise(
        noise_multiplier=z, l2_norm_bounds=bounds, dimensions=dimensions
    )
