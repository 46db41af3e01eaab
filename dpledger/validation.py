"""Checks for parameters with a privacy meaning, shared by every part of dpledger.

Each function returns the value converted to its canonical Python type, or raises
:class:`dpledger.errors.InvalidParameterError` naming the parameter, the value and the valid range.
``bool`` is refused wherever a number is expected: ``True`` as a probability is a bug, not a 1.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from dpledger.errors import InvalidParameterError

__all__ = [
    "check_delta",
    "check_finite",
    "check_non_negative_finite",
    "check_positive_finite",
    "check_positive_int",
    "check_probability",
]


def _as_float(name: str, value: Any, expected: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        # numpy scalars are numbers.Real; 0-d arrays are not, so accept them explicitly.
        if (
            hasattr(value, "ndim")
            and getattr(value, "ndim", None) == 0
            and not isinstance(value, bool)
        ):
            try:
                return float(value)
            except (TypeError, ValueError):
                pass
        raise InvalidParameterError(name, value, expected)
    return float(value)


def check_finite(name: str, value: Any) -> float:
    """Return ``value`` as a float; it must be a finite real number."""
    expected = "a finite real number"
    x = _as_float(name, value, expected)
    if not math.isfinite(x):
        raise InvalidParameterError(name, value, expected)
    return x


def check_positive_finite(name: str, value: Any) -> float:
    """Return ``value`` as a float; it must satisfy 0 < value < ∞."""
    expected = "a finite number > 0"
    x = _as_float(name, value, expected)
    if not (x > 0.0 and math.isfinite(x)):
        raise InvalidParameterError(name, value, expected)
    return x


def check_non_negative_finite(name: str, value: Any) -> float:
    """Return ``value`` as a float; it must satisfy 0 ≤ value < ∞."""
    expected = "a finite number >= 0"
    x = _as_float(name, value, expected)
    if not (x >= 0.0 and math.isfinite(x)):
        raise InvalidParameterError(name, value, expected)
    return x


def check_probability(name: str, value: Any) -> float:
    """Return ``value`` as a float; it must lie in the closed interval [0, 1]."""
    expected = "a probability in [0, 1]"
    x = _as_float(name, value, expected)
    if not 0.0 <= x <= 1.0:  # also rejects NaN
        raise InvalidParameterError(name, value, expected)
    return x


def check_delta(name: str, value: Any) -> float:
    """Return ``value`` as a float; it must lie in the open interval (0, 1)."""
    expected = "a number in the open interval (0, 1)"
    x = _as_float(name, value, expected)
    if not 0.0 < x < 1.0:
        raise InvalidParameterError(name, value, expected)
    return x


def check_positive_int(name: str, value: Any) -> int:
    """Return ``value`` as an int; it must be an integer ≥ 1 (floats with integer value refused)."""
    expected = "an integer >= 1"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidParameterError(name, value, expected)
    x = int(value)
    if x < 1:
        raise InvalidParameterError(name, value, expected)
    return x
