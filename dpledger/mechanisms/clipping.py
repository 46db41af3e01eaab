"""Clipping strategies: per-record factors f_i from per-record norms, with ‖f_i·v_i‖ ≤ S.

A strategy maps the L2 norm ‖v_i‖ of each record to a factor f_i ≥ 0; the record contributes
f_i·v_i to the sum. Every strategy here bounds each contribution by S, so the sum has L2
sensitivity S under add/remove-one and the Gaussian sum query's privacy tuple is (S, σ̃):

- :class:`FlatClipping` (local clipping, Abadi et al. 2016; McMahan & Andrew, section 1, step 2):
  f_i = min(1, S/‖v_i‖), i.e. π_S(v) = v·min(1, S/‖v‖).
- :class:`GlobalClipping` (Bu et al., "On the convergence and calibration of deep learning with
  differential privacy", Algorithm 1, option 2): f_i = 1{‖v_i‖ ≤ S}; a record with a larger norm
  is dropped from the sum instead of being scaled down.
- :class:`AutomaticClipping` (normalised clipping, Bu et al. 2022): f_i = S/(‖v_i‖ + γ), so
  ‖f_i·v_i‖ = S·‖v_i‖/(‖v_i‖ + γ) < S for a stability constant γ > 0.

Records whose norm is NaN or infinite are rejected with an error (never summed): a NaN norm
means the record holds NaN, and an infinite norm cannot be scaled to a finite bound.

The bounds hold in exact arithmetic. In floating point a clipped record's computed norm can
exceed S by a relative rounding error of order (d + 4)·eps of the array's dtype (d the number
of coordinates), which is immaterial for privacy accounting.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import attrs
import numpy as np

from dpledger.errors import InvalidParameterError
from dpledger.validation import check_positive_finite

__all__ = [
    "AutomaticClipping",
    "ClippingStrategy",
    "FlatClipping",
    "GlobalClipping",
    "check_clip_margin",
    "check_record_norms",
    "rounding_clip_margin",
]


def rounding_clip_margin(eps: float) -> float:
    """ρ = min(0.05, 2¹³·eps): the relative margin that absorbs rounding in low precision.

    Adapters compute per-record norms and Σ_i f_i·v_i in the arrays' dtype (float32 for most
    models; ghost norms from Gram matrices can lose more to cancellation than a plain sum of
    squares). A record whose norm is just above S can then get a factor that rounds to 1 and pass
    with a contribution slightly above S, which the ledger's S would not cover. Clipping to
    S·(1 − ρ) while recording S keeps every contribution within S: 2¹³·eps covers the worst-case
    rounding of a sum of up to about 8,000 squares (about 9.8e-4 for float32, 1.8e-12 for
    float64), at a negligible cost in utility.

    Args:
        eps: the machine epsilon of the dtype the norms and sums are computed in.
    """
    return min(0.05, 2.0**13 * float(eps))


def check_clip_margin(name: str, value: Any) -> float | None:
    """None (choose by dtype), or a margin ρ in [0, 0.5)."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0.0 <= float(value) < 0.5
    ):
        raise InvalidParameterError(name, value, "None or a number in [0, 0.5)")
    return float(value)


def check_record_norms(name: str, norms: Any) -> np.ndarray:
    """Return per-record norms as a 1-D float64 vector; each must be finite and ≥ 0.

    Raises:
        InvalidParameterError: naming ``name`` and the first offending record, for a vector that
            is not 1-D, or a norm that is NaN, infinite or negative.
    """
    try:
        v = np.asarray(norms, dtype=np.float64)
    except (TypeError, ValueError):
        raise InvalidParameterError(name, norms, "a 1-D vector of per-record norms") from None
    if v.ndim != 1:
        raise InvalidParameterError(
            name, f"an array of shape {v.shape}", "a 1-D vector with one norm per record"
        )
    bad = ~(np.isfinite(v) & (v >= 0.0))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise InvalidParameterError(
            f"{name}[{i}]",
            float(v[i]),
            "a finite norm >= 0 (a record with a NaN or infinite norm is never clipped or "
            f"summed; {int(bad.sum())} of {v.size} records are affected)",
        )
    return v


class ClippingStrategy(abc.ABC):
    """How records are bounded: per-record factors f_i with ‖f_i·v_i‖ ≤ S."""

    name: ClassVar[str]

    @abc.abstractmethod
    def _factors(self, norms: np.ndarray, bound: float) -> np.ndarray:
        """Factors for validated norms (float64, finite, ≥ 0) and a validated bound."""

    def factors(self, norms: Any, *, l2_norm_bound: float) -> np.ndarray:
        """Per-record factors f_i ≥ 0 with f_i·‖v_i‖ ≤ S.

        Args:
            norms: per-record L2 norms ‖v_i‖ (1-D, finite, ≥ 0).
            l2_norm_bound: S > 0.

        Returns:
            A float64 vector of factors, one per record.

        Raises:
            InvalidParameterError: for S ≤ 0 or not finite, or a NaN/infinite/negative norm.
        """
        bound = check_positive_finite("l2_norm_bound", l2_norm_bound)
        return self._factors(check_record_norms("norms", norms), bound)

    @staticmethod
    def parse(value: Any, *, parameter: str = "clipping") -> ClippingStrategy:
        """A strategy from an instance or a name: ``"flat"``, ``"global"``, ``"automatic"``."""
        if isinstance(value, ClippingStrategy):
            return value
        strategy = _BY_NAME.get(value) if isinstance(value, str) else None
        if strategy is None:
            raise InvalidParameterError(
                parameter,
                value,
                "a ClippingStrategy or one of 'flat', 'global', 'automatic'",
            )
        return strategy()


@attrs.frozen
class FlatClipping(ClippingStrategy):
    """f_i = min(1, S/‖v_i‖): records longer than S are scaled onto the sphere of radius S."""

    name: ClassVar[str] = "flat"

    def _factors(self, norms: np.ndarray, bound: float) -> np.ndarray:
        out = np.ones_like(norms)
        over = norms > bound
        out[over] = bound / norms[over]
        return out


@attrs.frozen
class GlobalClipping(ClippingStrategy):
    """f_i = 1{‖v_i‖ ≤ S}: records within the bound are kept unchanged, the others dropped."""

    name: ClassVar[str] = "global"

    def _factors(self, norms: np.ndarray, bound: float) -> np.ndarray:
        return (norms <= bound).astype(np.float64)


def _stability(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    check_positive_finite(attribute.name, value)


@attrs.frozen
class AutomaticClipping(ClippingStrategy):
    """f_i = S/(‖v_i‖ + γ): every record is normalised to norm S·‖v_i‖/(‖v_i‖ + γ) < S.

    Attributes:
        stability: γ > 0 (default 0.01, as in Bu et al. 2022); it keeps the factor finite for a
            zero record and makes small records contribute proportionally to their norm.
    """

    name: ClassVar[str] = "automatic"
    stability: float = attrs.field(
        default=0.01, converter=float, validator=_stability, kw_only=True
    )

    def _factors(self, norms: np.ndarray, bound: float) -> np.ndarray:
        return bound / (norms + self.stability)


_BY_NAME: dict[str, type[ClippingStrategy]] = {
    "flat": FlatClipping,
    "global": GlobalClipping,
    "automatic": AutomaticClipping,
}
