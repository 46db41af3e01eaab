"""The report's plots, drawn with matplotlib's Agg backend and returned as PNG bytes.

Every accountant has its own colour, line style and marker, so that curves that coincide (PRV
and PLD usually do) both stay visible; approximations (GDP) are dashed and labelled "no
guarantee" (:func:`dpledger.accountants.display.curve_style`, which ``dpledger epsilon --plot``
uses too).
"""

from __future__ import annotations

import io
from typing import Any

from dpledger.accountants.display import curve_style, format_rounded
from dpledger.report.contents import PrivacyReport

__all__ = [
    "NO_MATPLOTLIB",
    "epsilon_curve_png",
    "plots_available",
    "tradeoff_png",
]

NO_MATPLOTLIB = (
    "No plot: matplotlib is not installed; plots need the report extra: "
    'pip install "dpledger[report]". The tables hold every number.'
)
"""What the HTML report says in place of a plot when matplotlib cannot be imported."""


def plots_available() -> bool:
    """Whether matplotlib can be imported (the ``report`` extra); without it the report is
    written without its plots, saying so (:data:`NO_MATPLOTLIB`)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig: Any) -> bytes:
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=100)
    _pyplot().close(fig)
    return buffer.getvalue()


def epsilon_curve_png(report: PrivacyReport) -> bytes | None:
    """ε at the report's δ against the number of steps, one curve per accountant that answered
    (None when no accountant has a curve)."""
    rows = [r for r in report.answered if r.curve]
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for row in rows:
        style, label = curve_style(row.accountant, row.kind)
        xs = [t for t, _ in row.curve]
        ys = [e for _, e in row.curve]
        ax.plot(xs, ys, label=label, linewidth=1.8, **style)
    ax.set_xlabel("training steps (count)")
    ax.set_ylabel(f"ε at δ = {report.delta:g} (privacy loss, natural log)")
    ax.set_title("Privacy spent along the run: ε after each number of steps")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    return _png(fig)


def tradeoff_png(report: PrivacyReport) -> bytes | None:
    """The best attacker's TPR against FPR (log axes), with the line TPR = FPR of a blind guess
    (None when the trade-off was not computed)."""
    view = report.tradeoff
    if view is None or not view.curve:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    fpr = [a for a, _ in view.curve]
    tpr = [max(t, 1e-12) for _, t in view.curve]
    ax.plot(fpr, tpr, color="#2ca02c", linewidth=2.0,
            label=f"best attacker, upper bound ({view.accountant})")  # fmt: skip
    ax.plot(fpr, fpr, color="black", linestyle=":", linewidth=1.2, label="blind guess (TPR = FPR)")
    for alpha, t in view.tpr_at_fpr:
        ax.plot([alpha], [t], marker="o", color="#d62728", markersize=6)
        text = f"TPR ≤ {format_rounded(t, 'up', digits=3)} at FPR {alpha:g}"
        ax.annotate(text, (alpha, t), textcoords="offset points", xytext=(8, -12), fontsize=9)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(min(fpr), 1.0)
    ax.set_ylim(min(fpr), 1.05)
    ax.set_xlabel("false-positive rate (fraction, log scale)")
    ax.set_ylabel("true-positive rate (fraction, log scale)")
    ax.set_title("Membership inference: the best attacker's trade-off")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(loc="lower right")
    return _png(fig)
