"""Checks for parameters with a privacy meaning, shared by every part of dpledger.

Each function returns the value converted to its canonical Python type, or raises
:class:`dpledger.errors.InvalidParameterError` naming the parameter, the value and the valid range.
``bool`` is refused wherever a number is expected: ``True`` as a probability is a bug, not a 1.
A zero that may be signed is returned as +0.0, so that -0.0 never reaches a ledger file.
"""

from __future__ import annotations

import enum
import math
import numbers
import operator
import sys
import warnings
from typing import Any, TypeVar

from dpledger.errors import ComputationBudgetError, DeltaTooLargeWarning
from dpledger.errors import InvalidParameterError as InvalidParameterError

__all__ = [
    "FLOAT_INT_MAX",
    "MAX_MATRIX_BYTES",
    "check_allocation",
    "check_bool",
    "check_delta",
    "check_enum",
    "check_finite",
    "check_non_negative_finite",
    "check_non_negative_int",
    "check_optional_str",
    "check_positive_finite",
    "check_positive_int",
    "check_probability",
    "delta_too_large_message",
    "warn_if_batch_size_differs",
    "warn_if_delta_too_large",
]

_E = TypeVar("_E", bound=enum.Enum)

FLOAT_INT_MAX = int(sys.float_info.max)
"""The largest integer float64 holds (about 1.8e308). A count that meets float arithmetic (a
population in a denominator q·n, a number of records in a bound |R|·S, a size in bytes) must
not exceed it: Python raises ``OverflowError`` converting a larger int. Pass it as ``maximum``
of :func:`check_positive_int` or :func:`check_non_negative_int`."""

MAX_MATRIX_BYTES = 2**30
"""The most memory a materialised correlated-noise factorization (C, B, the checks' products) or a
computation over T steps (filter coefficients, prefix errors, participation patterns) may take:
1 GiB. C and B are dense, so T is limited to a few thousand steps (docs/correlated-noise.md,
"Limits"); beyond it the functions refuse up front with ComputationBudgetError."""


def check_allocation(parameter: str, value: Any, needed: int, suggestion: str) -> None:
    """Refuse, before allocating, a computation whose estimate ``needed`` (bytes, an int, so that
    sizes beyond the float64 range are refused too, never overflow) exceeds
    :data:`MAX_MATRIX_BYTES`.

    Raises:
        ComputationBudgetError: ``needed`` exceeds the budget; names ``parameter`` and ``value``.
    """
    if needed > MAX_MATRIX_BYTES:
        raise ComputationBudgetError(
            parameter=parameter,
            value=value,
            estimated_bytes=float(needed) if needed <= FLOAT_INT_MAX else math.inf,
            budget_bytes=MAX_MATRIX_BYTES,
            suggestion=suggestion,
        )


def check_enum(name: str, value: Any, enum_type: type[_E]) -> _E:
    """The member of ``enum_type`` that ``value`` is or names (by its value), else an error
    listing the valid values."""
    if isinstance(value, enum_type):
        return value
    try:
        return enum_type(value)
    except ValueError:
        valid = ", ".join(repr(m.value) for m in enum_type)
        raise InvalidParameterError(name, value, f"one of {valid}") from None


def _as_float(name: str, value: Any, expected: str) -> float:
    """``value`` as a float, for real numbers only (bools, strings, complex numbers refused).

    numpy scalars are ``numbers.Real``; 0-d numpy arrays of an integer or float dtype are accepted
    too. An integer too large for a float is refused rather than raising ``OverflowError``.
    """
    if type(value) is float:  # the common case, without the slower abstract-class checks
        return value
    if isinstance(value, bool):
        raise InvalidParameterError(name, value, expected)
    if not isinstance(value, numbers.Real):
        dtype = getattr(value, "dtype", None)
        if getattr(value, "ndim", None) != 0 or getattr(dtype, "kind", None) not in ("i", "u", "f"):
            raise InvalidParameterError(name, value, expected)
    try:
        return float(value)
    except (OverflowError, TypeError, ValueError):
        raise InvalidParameterError(name, value, expected) from None


def check_bool(name: str, value: Any) -> bool:
    """Return ``value``; it must be ``True`` or ``False`` (numpy bools and 0/1 refused)."""
    if not isinstance(value, bool):
        raise InvalidParameterError(name, value, "True or False")
    return value


def check_optional_str(name: str, value: Any) -> str | None:
    """Return ``value`` as a plain ``str`` (a subclass's text) or None; else refuse it."""
    if value is None or type(value) is str:
        return value
    if not isinstance(value, str):
        raise InvalidParameterError(name, value, "a string or None")
    return str(value)


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
    return x + 0.0  # -0.0 becomes 0.0


def check_probability(name: str, value: Any) -> float:
    """Return ``value`` as a float; it must lie in the closed interval [0, 1]."""
    expected = "a probability in [0, 1]"
    x = _as_float(name, value, expected)
    if not 0.0 <= x <= 1.0:  # also rejects NaN
        raise InvalidParameterError(name, value, expected)
    return x + 0.0  # -0.0 becomes 0.0


def check_delta(name: str, value: Any) -> float:
    """Return ``value`` as a float; it must lie in the open interval (0, 1)."""
    expected = "a number in the open interval (0, 1)"
    x = _as_float(name, value, expected)
    if not 0.0 < x < 1.0:
        raise InvalidParameterError(name, value, expected)
    return x


def _as_int(name: str, value: Any, expected: str) -> int:
    """``value`` as an int: Python and numpy integers, 0-d integer arrays; never bools or floats."""
    if isinstance(value, bool):  # numpy bools have no __index__ and fail below
        raise InvalidParameterError(name, value, expected)
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidParameterError(name, value, expected) from None


def _bounded(name: str, value: Any, minimum: int, maximum: int | None) -> int:
    if maximum is None:
        expected = f"an integer >= {minimum}"
    elif maximum == FLOAT_INT_MAX:
        expected = f"an integer >= {minimum} within the float64 range (at most about 1.8e308)"
    else:
        expected = f"an integer in [{minimum}, {maximum}]"
    x = _as_int(name, value, expected)
    if x < minimum or (maximum is not None and x > maximum):
        raise InvalidParameterError(name, value, expected)
    return x


def check_positive_int(name: str, value: Any, *, maximum: int | None = None) -> int:
    """Return ``value`` as an int; it must be an integer ≥ 1 (floats with integer value refused),
    at most ``maximum`` when given (:data:`FLOAT_INT_MAX` for a count used in float
    arithmetic)."""
    return _bounded(name, value, 1, maximum)


def check_non_negative_int(name: str, value: Any, *, maximum: int | None = None) -> int:
    """Return ``value`` as an int; it must be an integer ≥ 0 (floats with integer value refused),
    at most ``maximum`` when given (:data:`FLOAT_INT_MAX` for a count used in float
    arithmetic)."""
    return _bounded(name, value, 0, maximum)


def delta_too_large_message(delta: float, population_size: int) -> str | None:
    """The warning for δ ≥ 1/n, or None when δ < 1/n.

    Args:
        delta: δ of the guarantee.
        population_size: n, the number of records (or users) the guarantee protects.
    """
    n = int(population_size)
    if n < 1 or delta * n < 1.0:
        return None
    return (
        f"delta={delta!r} is at least 1/n = 1/{n} (population_size={n}): publishing one "
        f"random record in the clear is (0, 1/n)-DP, so this δ does not rule out leaking a "
        f"record; the usual advice is δ ≪ 1/n, e.g. δ ≤ 1/(10n) = {1.0 / (10 * n):.3g}"
    )


def warn_if_delta_too_large(
    *, delta: float, population_size: int | None, stacklevel: int = 2
) -> bool:
    """Warn with :class:`~dpledger.errors.DeltaTooLargeWarning` when δ ≥ 1/n.

    Args:
        delta: δ of the guarantee.
        population_size: n (None: unknown, nothing is checked).
        stacklevel: the frame the warning points at, counted from the caller of this
            function (1: that caller; 2, the default: its caller).

    Returns:
        Whether a warning was issued.
    """
    if population_size is None:
        return False
    message = delta_too_large_message(delta, population_size)
    if message is None:
        return False
    warnings.warn(
        DeltaTooLargeWarning(message, delta=delta, population_size=int(population_size)),
        stacklevel=stacklevel + 1,
    )
    return True


BATCH_SIZE_FACTOR = 2.0
""":func:`warn_if_batch_size_differs` warns when q·n and a batch size differ by more than this
factor."""


def warn_if_batch_size_differs(
    *, sampling_probability: float, batch_size: int, population_size: int, stacklevel: int = 3
) -> bool:
    """Warn (``UserWarning``) when a loader's batch size b is far from the mean batch q·n.

    A caller given both a sampling probability q and a batch size (a DataLoader's) samples with
    q; when q·n and b differ by more than a factor of :data:`BATCH_SIZE_FACTOR`, the batches
    are not those the batch size suggests, and the warning names the q = b / n that gives them.

    Args:
        sampling_probability: q.
        batch_size: b.
        population_size: n.
        stacklevel: the frame the warning points at, counted from the caller of this function
            (1: that caller; 3, the default: two frames above it).

    Returns:
        Whether a warning was issued.
    """
    q, b, n = sampling_probability, batch_size, population_size
    mean = q * n
    if b <= 0 or mean <= 0 or max(mean / b, b / mean) <= BATCH_SIZE_FACTOR:
        return False
    warnings.warn(
        f"sampling_probability={q!r} draws batches of q·n = {mean:.4g} records on average "
        f"(n = {n}), but the batch size given (batch_size=, or the DataLoader's) is {b}: "
        "each record joins each batch with probability q and the DataLoader's own batching "
        f"is not used. Pass sampling_probability={b}/{n} = {b / n:.4g} for batches of about "
        f"{b}, or leave sampling_probability out to get q = batch_size / n",
        UserWarning,
        stacklevel=stacklevel + 1,
    )
    return True
