"""Plots of a privacy audit: the two score distributions, and the bound against the audit's size.

matplotlib is an optional extra (``pip install dpledger[plot]``); it is imported when a plot is
drawn, not when this module is imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from dpledger.audit.privacy_bounds import EpsilonLowerBound, _as_scores
from dpledger.errors import InvalidParameterError

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["plot_bound_versus_runs", "plot_score_distributions"]


def _axes(ax: Axes | None) -> Axes:
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    _, ax = plt.subplots(figsize=(6.0, 4.0))
    return ax


def plot_score_distributions(
    scores_with_canary: Any,
    scores_without_canary: Any,
    *,
    threshold: float | None = None,
    bins: int = 50,
    ax: Axes | None = None,
) -> Axes:
    """Histograms of the scores of runs with and without the canary, and the threshold.

    Args:
        scores_with_canary: one score per run with the canary.
        scores_without_canary: one score per run without it.
        threshold: draw a vertical line at the attack's threshold (e.g. ``bound.threshold``).
        bins: number of histogram bins shared by both sides.
        ax: axes to draw on (a new figure when None).

    Returns:
        The axes.
    """
    s_in = _as_scores("scores_with_canary", scores_with_canary)
    s_out = _as_scores("scores_without_canary", scores_without_canary)
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise InvalidParameterError("bins", bins, "an integer >= 1")
    ax = _axes(ax)
    both = np.concatenate([s_in, s_out])
    edges = np.histogram_bin_edges(both, bins=bins) if both.size else bins
    ax.hist(s_out, bins=edges, alpha=0.6, label=f"without canary ({s_out.size} runs)")
    ax.hist(s_in, bins=edges, alpha=0.6, label=f"with canary ({s_in.size} runs)")
    if threshold is not None:
        ax.axvline(
            float(threshold), color="black", linestyle="--", label=f"threshold {threshold:.4g}"
        )
    ax.set_xlabel("score (higher = canary more likely included)")
    ax.set_ylabel("runs")
    ax.legend()
    return ax


def plot_bound_versus_runs(
    curve: Sequence[tuple[int, EpsilonLowerBound]],
    *,
    claimed_epsilon: float | None = None,
    ax: Axes | None = None,
) -> Axes:
    """The ε lower bound against the number of runs per side.

    Args:
        curve: (runs per side, bound) pairs, e.g. from
            :meth:`~dpledger.audit.audit_game.GameScores.bound_versus_runs`.
        claimed_epsilon: draw the claimed ε as a horizontal line.
        ax: axes to draw on (a new figure when None).

    Returns:
        The axes.
    """
    pairs = list(curve)
    if not pairs or not all(len(p) == 2 and isinstance(p[1], EpsilonLowerBound) for p in pairs):
        raise InvalidParameterError(
            "curve", curve, "a non-empty sequence of (runs_per_side, EpsilonLowerBound) pairs"
        )
    ax = _axes(ax)
    n = [int(p[0]) for p in pairs]
    eps = [p[1].epsilon for p in pairs]
    first = pairs[0][1]
    ax.plot(n, eps, marker="o", label=f"lower bound ({first.method.value}, {first.confidence:g})")
    if claimed_epsilon is not None:
        ax.axhline(float(claimed_epsilon), color="red", linestyle="--", label="claimed ε")
    ax.set_xlabel("runs per side")
    ax.set_ylabel(f"ε lower bound at δ = {first.delta:g}")
    ax.set_ylim(bottom=0.0)
    ax.legend()
    return ax
