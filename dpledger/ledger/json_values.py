"""The JSON values a ledger line may hold, read exactly: numbers Python cannot hold exactly are
kept as :class:`_Unreadable` markers (so that the field checks name the field that holds one),
duplicate keys are refused, and metadata objects are checked for what a writer could have
written. Used by the line decoder (:mod:`dpledger.ledger.decoding`) and the reader.
"""

from __future__ import annotations

import math
import re
from typing import Any

from dpledger.ledger.encoding import _SHOWN_CHARS, MAX_METADATA_DEPTH, _nesting_depth

__all__ = ["is_number", "unique_keys"]


class _Unreadable:
    """A JSON value Python cannot hold exactly: an integer beyond the int-string conversion
    limit, or a ``NaN``/``Infinity`` literal. Decoding yields this instead of raising, so that
    the field checks name the field that holds it."""

    def __init__(self, description: str) -> None:
        self.description = description

    def __repr__(self) -> str:
        return self.description


def _parse_int(text: str) -> int | _Unreadable:
    try:
        return int(text)
    except ValueError:  # more digits than sys.get_int_max_str_digits() allows
        return _Unreadable(f"<an integer of {len(text)} digits>")


def _parse_constant(name: str) -> _Unreadable:
    return _Unreadable(f"{name} (not a JSON number)")


def _nested_field(text: str) -> str:
    """`` in "<key>"`` for the first field of a line whose value is an object or an array."""
    match = _NESTED_FIELD.search(text)
    return f' in "{match.group(1)[:_SHOWN_CHARS]}"' if match else ""


_NESTED_FIELD = re.compile(r'"((?:[^"\\]|\\.)*)":[\[{]')


def _metadata_problem(value: Any) -> str | None:
    """Why a decoded metadata object cannot be what a writer wrote, or None if it can be."""
    if not isinstance(value, dict):
        return "is not a JSON object"
    if _nesting_depth(value) > MAX_METADATA_DEPTH:
        return f"is nested more than {MAX_METADATA_DEPTH} levels deep"
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, _Unreadable):
            return f"holds {item!r}, which is not a finite JSON number"
        elif isinstance(item, float) and not math.isfinite(item):
            return f"holds the number {item!r} (out of the float range)"
    return None


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s ``object_pairs_hook`` that refuses a duplicate key."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def is_number(x: Any) -> bool:
    """True for a finite int or float that is not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
