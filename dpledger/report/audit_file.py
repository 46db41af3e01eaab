"""An audit result file, read for ``dpledger report --audit``: its ε lower bound, shown beside
the report's claim.

The file is untrusted input: it is read up to :data:`MAX_AUDIT_BYTES`, must be UTF-8 JSON that
parses (deep nesting is refused, not a crash), and its lower bound must be a finite number ≥ 0
(``Infinity`` or ``1e400`` would "refute" every claim while measuring nothing).
"""

from __future__ import annotations

import json
import math
from typing import Any

from dpledger.errors import InvalidParameterError

__all__ = ["MAX_AUDIT_BYTES", "load_audit"]

MAX_AUDIT_BYTES = 2**20
"""The largest audit file read (1 MiB): an audit result is a small JSON object."""


def load_audit(path: str) -> dict[str, Any]:
    """Read an audit result: a JSON object with ``lower_bound`` (or ``epsilon_lower_bound``), a
    finite number ≥ 0, and optionally ``delta`` and ``confidence`` (numbers in [0, 1]) and
    ``method`` (a string).

    Raises:
        InvalidParameterError: the file is not such a JSON object in UTF-8 of at most
            :data:`MAX_AUDIT_BYTES` bytes (named as ``audit``): not JSON, nested too deeply
            to parse, a lower bound that is not a finite number ≥ 0 (``Infinity``, ``1e400``
            and ``NaN`` are refused: a lower bound of ∞ is no measurement).
        OSError: the file cannot be read.
    """
    with open(path, "rb") as fh:
        raw = fh.read(MAX_AUDIT_BYTES + 1)
    expected = 'a JSON file with an ε lower bound: {"lower_bound": finite number >= 0, ...}'
    if len(raw) > MAX_AUDIT_BYTES:
        raise InvalidParameterError(
            "audit", path, f"{expected}, of at most {MAX_AUDIT_BYTES} bytes"
        )
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise InvalidParameterError("audit", path, f"{expected}, in UTF-8") from None
    except RecursionError:
        raise InvalidParameterError("audit", path, f"{expected}, not nested that deeply") from None
    except ValueError:
        raise InvalidParameterError("audit", path, expected) from None
    if not isinstance(data, dict):
        raise InvalidParameterError("audit", path, expected)
    bound = _finite(data.get("lower_bound", data.get("epsilon_lower_bound")))
    if bound is None or not bound >= 0:
        raise InvalidParameterError("audit", path, expected)
    out: dict[str, Any] = {"lower_bound": bound}
    for key in ("delta", "confidence"):
        value = data.get(key)
        number = _finite(value)
        if value is not None and (number is None or not 0 <= number <= 1):
            raise InvalidParameterError("audit", path, f"{key} in [0, 1] when given")
        out[key] = number
    method = data.get("method")
    if method is not None and not isinstance(method, str):
        raise InvalidParameterError("audit", path, "method a string when given")
    out["method"] = method
    return out


def _finite(value: Any) -> float | None:
    """``value`` as a finite float, or None when it is not a finite number (a bool, a string,
    ±∞, NaN, an integer beyond the float range)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None
