"""Printing privacy parameters without moving a bound the wrong way."""

from __future__ import annotations

import decimal
import math

__all__ = ["format_rounded"]


def format_rounded(x: float | None, rounding: str | None = None, *, digits: int = 6) -> str:
    """``x`` to ``digits`` significant digits; ``rounding="up"`` never shows less than x (an
    upper bound stays one when printed), ``"down"`` never more (a lower bound); None rounds to
    nearest. None prints as ``-``, infinity as ``inf``."""
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    text = f"{x:.{digits}g}"
    if rounding is None or (float(text) >= x if rounding == "up" else float(text) <= x):
        return text
    with decimal.localcontext() as context:
        context.rounding = decimal.ROUND_CEILING if rounding == "up" else decimal.ROUND_FLOOR
        return format(decimal.Decimal(repr(float(x))), f".{digits}g")
