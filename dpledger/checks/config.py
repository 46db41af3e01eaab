"""The grids, sample sizes and thresholds of the implementation-bug checks."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from dpledger.errors import InvalidParameterError
from dpledger.validation import check_delta, check_positive_finite, check_positive_int

__all__ = ["CheckConfig"]


def _checked_by(check: Callable[[str, Any], Any]) -> Callable[[Any, Any, Any], None]:
    """An attrs validator running the shared parameter check on the attribute's value."""

    def validate(_inst: Any, attribute: Any, value: Any) -> None:
        check(attribute.name, value)

    return validate


def _sorted_distinct(name: str, *, integer: bool = False) -> Callable[[Any], tuple[Any, ...]]:
    """An attrs converter to the sorted distinct values of a grid of at least 3 positive values."""
    check = check_positive_int if integer else check_positive_finite

    def convert(value: Any) -> tuple[Any, ...]:
        try:
            items = tuple(value)
        except TypeError:
            raise InvalidParameterError(name, value, "a sequence of positive numbers") from None
        out = tuple(check(name, v) for v in items)
        if len(set(out)) < 3:
            raise InvalidParameterError(name, value, "at least 3 distinct values")
        return tuple(sorted(set(out)))

    return convert


def _elasticity_range(value: Any) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise InvalidParameterError("elasticity_range", value, "a pair (low, high)") from None
    if not (0.0 < lo < 1.0 < hi and math.isfinite(hi)):
        raise InvalidParameterError("elasticity_range", value, "a pair with 0 < low < 1 < high")
    return (lo, hi)


@attrs.frozen(kw_only=True)
class CheckConfig:
    """Grids, sample sizes and thresholds of the checks. The defaults suit small models.

    Attributes:
        clip_norms: grid of C for ``clipping_applied`` and for the appendix-B search of an
            unclipped C (log-spaced, wide: 10⁻⁴ … 10⁴).
        batch_sizes: grid of B for design (a) of ``per_example_clipping``.
        large_counts: grid of k (copies of the large-gradient point) for design (b).
        count_batch_size: B of design (b); None means max(batch_sizes).
        per_example_margin: C of the per-example check is ‖g‖ / (margin · B_max), so that the
            large point and the batch mean are both clipped (appendix A: C ≪ ‖g‖/B).
        per_example_clip_norm: use this C instead of the one derived from ``clipping_applied``.
        large_target_scale: how far the large point's MSE target is from the prediction.
        noise_batch_size: B of the batch of ordinary points for the noise checks.
        noise_clip_norm_count: number of C values in [C*, span·C*] for ``noise_calibrated``.
        noise_clip_norm_span: the ratio of the largest to the smallest of them (10, appendix B).
        seeds_per_clip_norm: models trained per C (pairwise distances per C: n(n − 1)/2).
        noise_steps: steps per model in ``noise_calibrated`` (the magnitude test uses 1).
        magnitude_min_samples: fewest standardised coordinates the magnitude test pools.
        noise_multiplier_grid: σ values of the appendix-B search (adaptive optimisers).
        alpha_slope: significance level of the slope t-tests.
        alpha_magnitude: family-wise significance level of the magnitude test (KS and χ² at
            α/2 each).
        flat_rtol: a curve whose values all lie within this relative distance of each other
            counts as flat (no dependence).
        saturation_rtol: a C counts as unclipped when its σ = 0 update differs from the update at
            the largest C by at most this fraction.
        elasticity_range: accepted d log(distance) / d log C in ``noise_calibrated``.
        elasticity_max_stderr: largest standard error of the elasticity that still decides
            (0.125 puts both 0 and 1 four standard errors from the default band edge 0.5).
        control_tolerance: largest accepted σ = 0 distance (between C values or seeds) relative
            to the smallest mean noisy distance.
        filler_tolerance: largest accepted update of a fillers-only batch relative to the update
            with one large point.
    """

    clip_norms: tuple[float, ...] = attrs.field(
        default=tuple(float(c) for c in np.geomspace(1e-4, 1e4, 17)),
        converter=_sorted_distinct("clip_norms"),
    )
    batch_sizes: tuple[int, ...] = attrs.field(
        default=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32),
        converter=_sorted_distinct("batch_sizes", integer=True),
    )
    large_counts: tuple[int, ...] = attrs.field(
        default=(1, 2, 3, 4, 6, 8), converter=_sorted_distinct("large_counts", integer=True)
    )
    count_batch_size: int | None = None
    per_example_margin: float = attrs.field(
        default=10.0, validator=_checked_by(check_positive_finite)
    )
    per_example_clip_norm: float | None = None
    large_target_scale: float = attrs.field(
        default=10.0, validator=_checked_by(check_positive_finite)
    )
    noise_batch_size: int = attrs.field(default=8, validator=_checked_by(check_positive_int))
    noise_clip_norm_count: int = attrs.field(default=10, validator=_checked_by(check_positive_int))
    noise_clip_norm_span: float = attrs.field(
        default=10.0, validator=_checked_by(check_positive_finite)
    )
    seeds_per_clip_norm: int = attrs.field(default=5, validator=_checked_by(check_positive_int))
    noise_steps: int = attrs.field(default=1, validator=_checked_by(check_positive_int))
    magnitude_min_samples: int = attrs.field(
        default=2000, validator=_checked_by(check_positive_int)
    )
    noise_multiplier_grid: tuple[float, ...] = attrs.field(
        default=tuple(10.0**e for e in range(-8, 2)),
        converter=_sorted_distinct("noise_multiplier_grid"),
    )
    alpha_slope: float = attrs.field(default=0.01, validator=_checked_by(check_delta))
    alpha_magnitude: float = attrs.field(default=0.001, validator=_checked_by(check_delta))
    flat_rtol: float = attrs.field(default=0.01, validator=_checked_by(check_delta))
    saturation_rtol: float = attrs.field(default=1e-3, validator=_checked_by(check_delta))
    elasticity_range: tuple[float, float] = attrs.field(
        default=(0.5, 1.5), converter=_elasticity_range
    )
    elasticity_max_stderr: float = attrs.field(
        default=0.125, validator=_checked_by(check_positive_finite)
    )
    control_tolerance: float = attrs.field(default=0.1, validator=_checked_by(check_delta))
    filler_tolerance: float = attrs.field(default=0.05, validator=_checked_by(check_delta))

    def __attrs_post_init__(self) -> None:
        if self.count_batch_size is not None:
            b = check_positive_int("count_batch_size", self.count_batch_size)
            if b < max(self.large_counts):
                raise InvalidParameterError(
                    "count_batch_size", self.count_batch_size, "at least max(large_counts)"
                )
        elif max(self.batch_sizes) < max(self.large_counts):
            raise InvalidParameterError(
                "large_counts", self.large_counts, "values up to max(batch_sizes)"
            )
        if self.per_example_clip_norm is not None:
            check_positive_finite("per_example_clip_norm", self.per_example_clip_norm)
        if self.noise_clip_norm_count < 3:
            raise InvalidParameterError(
                "noise_clip_norm_count", self.noise_clip_norm_count, "an integer >= 3"
            )
        if self.noise_clip_norm_span <= 1.0:
            raise InvalidParameterError(
                "noise_clip_norm_span", self.noise_clip_norm_span, "a number > 1"
            )
        if self.seeds_per_clip_norm < 2:
            raise InvalidParameterError(
                "seeds_per_clip_norm", self.seeds_per_clip_norm, "an integer >= 2"
            )

    @property
    def counts_batch(self) -> int:
        """B of the count design (b)."""
        return self.count_batch_size or max(self.batch_sizes)

    def to_dict(self) -> dict[str, Any]:
        """The configuration as JSON-ready values."""
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in attrs.asdict(self).items()}
