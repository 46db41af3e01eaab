"""The checks a Gaussian sum query runs before it releases anything or records an event.

:class:`~dpledger.mechanisms.sum_query.GaussianSumQuery` validates its fields with the attrs
converters and validators here, checks the record count and the ledger (:func:`check_ledger`)
and parses a group of arrays (:func:`as_members`); a release then runs the sensitivity check
(:func:`check_sensitivity`) before any noise is drawn, so a rejected call leaves the ledger
unchanged.

Sensitivity sanity check (Tramèr et al., "Debugging differential privacy", section 4): before
any noise is drawn, a release checks ‖clipped sum‖ ≤ |R|·S_g (triangle inequality; for joint
clipping in the scaled space), which exposes sums that were clipped to a smaller bound than the
one being recorded. It allows for rounding: the comparison is against
|R|·S_g·(1 + ρ) with ρ = (|R| + 4)·eps + (d + 4)·eps₆₄, the worst-case relative error of summing
|R| clipped records in the arrays' dtype (machine epsilon eps) and of float64 norms over d
coordinates (Higham, Accuracy and Stability of Numerical Algorithms, ch. 3–4).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from dpledger.errors import InvalidParameterError, LedgerStateError
from dpledger.ledger import PrivacyLedger
from dpledger.mechanisms.backend import Array, ArrayBackend
from dpledger.mechanisms.clipping import ClippingStrategy
from dpledger.validation import FLOAT_INT_MAX, check_non_negative_finite, check_positive_finite

__all__ = [
    "SensitivityCheckError",
    "as_members",
    "check_ledger",
    "check_sensitivity",
    "num_records_of",
]

_EPS64 = float(np.finfo(np.float64).eps)


class SensitivityCheckError(InvalidParameterError):
    """Clipped sums are longer than |R|·S allows: they were not clipped to the recorded bound.

    Attributes:
        norm: the L2 norm of the clipped sum (in the scaled space for joint clipping).
        limit: |R|·S, the largest norm records clipped to S can sum to.
    """

    def __init__(self, *, norm: float, limit: float, num_records: int, bound: float) -> None:
        self.norm = norm
        self.limit = limit
        super().__init__(
            "clipped_sums",
            f"a sum of L2 norm {norm!r}",
            f"L2 norm <= |R|·S = {num_records}·{bound!r} = {limit!r} (triangle inequality); "
            "the records were not clipped to the bound being recorded — a sensitivity bug",
        )


def _bound(value: float) -> float:
    return check_positive_finite("l2_norm_bound", value)


def _stddev(value: float) -> float:
    return check_non_negative_finite("noise_stddev", value)


def _clipping(value: Any) -> ClippingStrategy:
    return ClippingStrategy.parse(value)


def _label(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise InvalidParameterError(attribute.name, value, "a string or None")


def _flag(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidParameterError(attribute.name, value, "True or False")


def _scales(value: Sequence[float]) -> tuple[float, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        try:
            value = tuple(np.asarray(value, dtype=np.float64).ravel())
        except (TypeError, ValueError):
            raise InvalidParameterError("scales", value, "a sequence of numbers > 0") from None
    if len(value) == 0:
        raise InvalidParameterError("scales", value, "at least one scale α_j > 0")
    return tuple(check_positive_finite(f"scales[{j}]", a) for j, a in enumerate(value))


def _num_records(value: Any) -> int:
    # |R| meets float arithmetic in the sensitivity check (|R|·S): within the float64 range
    expected = "an integer >= 0 within the float64 range (|R|, the sample size)"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidParameterError("num_records", value, expected)
    count = int(value)
    if not 0 <= count <= FLOAT_INT_MAX:
        raise InvalidParameterError("num_records", value, expected)
    return count


def check_ledger(ledger: Any) -> PrivacyLedger:
    """``ledger`` if it is a writable :class:`PrivacyLedger` with a step open, else an error.

    The ledger's own check at recording time is authoritative; this one fails early, before any
    work is done, for the common mistakes (no sampling event yet, a closed ledger).
    """
    if not isinstance(ledger, PrivacyLedger):
        raise InvalidParameterError("ledger", ledger, "a dpledger.PrivacyLedger")
    if ledger.closed:
        raise LedgerStateError("this ledger is closed; no further events can be recorded")
    if ledger.num_steps == 0:
        raise LedgerStateError(
            "no open step: record a sampling event first (ledger.record_sample or "
            "dpledger.mechanisms.sampled_step) — every sum query must belong to a sample"
        )
    return ledger


def as_members(records: Any, *, parameter: str = "records") -> list[Array]:
    """A group of arrays as a list: a list/tuple of arrays, or one array (a group of one)."""
    if isinstance(records, (list, tuple)):
        if len(records) == 0:
            raise InvalidParameterError(parameter, records, "at least one array in the group")
        return list(records)
    if records is None or isinstance(records, (str, bytes, dict)):
        raise InvalidParameterError(parameter, records, "an array or a sequence of arrays")
    return [records]


def check_sensitivity(
    total: float, *, num_records: int, bound: float, eps: float, size: int
) -> None:
    """The sensitivity sanity check: records clipped to ``bound`` sum to a norm ≤ |R|·S.

    The comparison allows for rounding: ``total`` must be at most |R|·S·(1 + ρ) with
    ρ = (|R| + 4)·eps + (d + 4)·eps₆₄ (module docstring).

    Args:
        total: the L2 norm of the clipped sums (in the scaled space for joint clipping).
        num_records: |R|, the number of records summed.
        bound: S, the bound being recorded.
        eps: machine epsilon of the sums' dtype (the largest over the group's arrays).
        size: d, the number of coordinates of the group.

    Raises:
        SensitivityCheckError: ``total`` is longer than the records could sum to.
    """
    limit = num_records * bound
    slack = (num_records + 4) * eps + (size + 4) * _EPS64
    if not total <= limit * (1.0 + slack):
        raise SensitivityCheckError(norm=total, limit=limit, num_records=num_records, bound=bound)


def num_records_of(members: list[Array], backend: ArrayBackend) -> int:
    """|R|, the leading dimension every array of a group of records arrays shares.

    Raises:
        InvalidParameterError: a 0-d array, or arrays with different leading dimensions.
    """
    shapes = [backend.shape(x) for x in members]
    for j, s in enumerate(shapes):
        if len(s) == 0:
            raise InvalidParameterError(
                f"records[{j}]", "a 0-d array", "an array with the records on its leading axis"
            )
    counts = [s[0] for s in shapes]
    if len(set(counts)) != 1:
        raise InvalidParameterError(
            "records",
            f"arrays with leading dimensions {counts}",
            "the same number of records (leading dimension) in every array of the group",
        )
    return counts[0]
