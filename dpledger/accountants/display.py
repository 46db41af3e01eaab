"""Showing privacy parameters: printing them without moving a bound the wrong way, and the one
drawing style of each accountant's curve that every plot (``dpledger epsilon --plot`` and the
report) uses."""

from __future__ import annotations

import decimal
import math
from typing import Any

__all__ = ["ACCOUNTANT_STYLES", "curve_style", "format_rounded"]

ACCOUNTANT_STYLES: dict[str, dict[str, Any]] = {
    "rdp": {"color": "#1f77b4", "linestyle": "-", "marker": "o", "markersize": 5},
    "prv": {"color": "#d62728", "linestyle": "-.", "marker": "s", "markersize": 7,
            "markerfacecolor": "none"},
    "pld": {"color": "#2ca02c", "linestyle": ":", "marker": "^", "markersize": 5},
    "gdp": {"color": "#7f7f7f", "linestyle": "--", "marker": "x", "markersize": 5},
    "balls_in_bins": {"color": "#9467bd", "linestyle": "-", "marker": "D", "markersize": 4},
    "random_allocation": {"color": "#ff7f0e", "linestyle": "-", "marker": "v", "markersize": 5},
}  # fmt: skip
"""Colour, line style and marker of each accountant's curve (matplotlib keyword arguments), so
that curves that coincide (PRV and PLD usually do) both stay visible."""


def curve_style(accountant: str, kind: str | None) -> tuple[dict[str, Any], str]:
    """The matplotlib style and the legend label of an accountant's ε curve: its own colour,
    line style and marker; an approximation (GDP by the central limit theorem) is dashed and
    labelled "no guarantee"."""
    style = dict(ACCOUNTANT_STYLES.get(accountant, {"linestyle": "-", "marker": "."}))
    if kind == "approximation":
        style["linestyle"] = "--"
        return style, f"{accountant}: approximation, no guarantee"
    return style, f"{accountant}: {kind.replace('_', ' ') if kind else ''}"


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
