"""The report of the DP-SGD implementation-bug checks: verdicts, statistics, curves, plots.

Each check of :mod:`dpledger.checks.checker` returns a :class:`CheckResult`: a :class:`Verdict`
(pass, fail, inconclusive with the reason, or skipped with the reason), the statistic that decided
it with its p-value and significance level, the raw curves it was computed from, and the numbers
behind it. A :class:`CheckReport` collects the results, prints a plain-text summary and draws the
curves like figures 2–4 of "Finding Private Bugs: Debugging Implementations of DP-SGD"
(matplotlib is imported only when a plot is asked for).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from dpledger.errors import InvalidParameterError

__all__ = [
    "CheckReport",
    "CheckResult",
    "Curve",
    "Verdict",
    "format_value",
    "result_maker",
]


def format_value(x: float) -> str:
    """A number as the reasons of the checks print it: three significant digits."""
    return f"{x:.3g}"


class Verdict(str, enum.Enum):
    """The outcome of one check.

    PASS: the behaviour the check looks for was observed at the stated significance level.
    FAIL: the behaviour of a correct DP-SGD step was not observed: an implementation bug.
    INCONCLUSIVE: the experiment could not decide (its preconditions did not hold); the reason
        says what to change.
    SKIPPED: the check does not apply to this step (e.g. the magnitude test for Adam).
    """

    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"
    SKIPPED = "skipped"


def _as_float_array(value: Any) -> np.ndarray:
    return np.asarray(value, dtype=np.float64).reshape(-1)


@attrs.frozen
class Curve:
    """One series of a check's raw data, e.g. the loss change against the clip norm C.

    Attributes:
        label: the legend entry, e.g. ``"σ = 1"``.
        x: the abscissae.
        y: the ordinates (same length as ``x``).
        x_label: the axis label of ``x``.
        y_label: the axis label of ``y``.
        log_x: draw ``x`` on a log scale.
        style: ``"line"`` (a curve through the points) or ``"points"`` (a scatter).
        panel: plots with the same panel name share one set of axes.
    """

    label: str
    x: np.ndarray = attrs.field(converter=_as_float_array, eq=attrs.cmp_using(eq=np.array_equal))
    y: np.ndarray = attrs.field(converter=_as_float_array, eq=attrs.cmp_using(eq=np.array_equal))
    x_label: str
    y_label: str
    log_x: bool = False
    style: str = "line"
    panel: str = "main"

    def __attrs_post_init__(self) -> None:
        if self.x.shape != self.y.shape:
            raise InvalidParameterError(
                "y",
                f"{self.y.size} values",
                f"as many values as x ({self.x.size}) in {self.label!r}",
            )

    def to_dict(self) -> dict[str, Any]:
        """The curve as JSON-ready values."""
        return {
            "label": self.label,
            "x": [_json_number(v) for v in self.x],
            "y": [_json_number(v) for v in self.y],
            "x_label": self.x_label,
            "y_label": self.y_label,
            "log_x": self.log_x,
            "style": self.style,
            "panel": self.panel,
        }


def _json_number(x: Any) -> Any:
    if isinstance(x, (bool, str)) or x is None:
        return x
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        f = float(x)
        if math.isfinite(f):
            return f
        return "nan" if math.isnan(f) else ("inf" if f > 0 else "-inf")
    if isinstance(x, (list, tuple, np.ndarray)):
        return [_json_number(v) for v in x]
    if isinstance(x, Mapping):
        return {str(k): _json_number(v) for k, v in x.items()}
    return str(x)


@attrs.frozen
class CheckResult:
    """The outcome of one implementation-bug check.

    Attributes:
        name: the check's name (``clipping_applied``, ``per_example_clipping``,
            ``noise_calibrated``, ``noise_magnitude``).
        title: a one-line description of what the check tests.
        verdict: pass, fail, inconclusive or skipped.
        reason: plain-text explanation of the verdict (what was seen, what it means, what to do).
        statistic_name: what :attr:`statistic` is (e.g. "slope of Δloss against C").
        statistic: the value of the deciding statistic (NaN when none was computed).
        p_value: its p-value (NaN when none was computed).
        alpha: the significance level the p-value was compared with.
        curves: the raw curves the check was computed from.
        details: further numbers (estimated gradient norm, effect sizes, the other sub-test, …).
    """

    name: str
    title: str
    verdict: Verdict
    reason: str
    statistic_name: str = ""
    statistic: float = math.nan
    p_value: float = math.nan
    alpha: float = math.nan
    curves: tuple[Curve, ...] = attrs.field(default=(), converter=tuple)
    details: Mapping[str, Any] = attrs.field(factory=dict)

    @property
    def passed(self) -> bool:
        """True when the verdict is PASS."""
        return self.verdict is Verdict.PASS

    @property
    def failed(self) -> bool:
        """True when the verdict is FAIL."""
        return self.verdict is Verdict.FAIL

    def summary(self) -> str:
        """A few lines of plain text: verdict, statistic, p-value and reason."""
        head = f"[{self.verdict.value.upper():>12}] {self.name}: {self.title}"
        lines = [head]
        if self.statistic_name and not math.isnan(self.statistic):
            stat = f"{self.statistic_name} = {self.statistic:.4g}"
            if not math.isnan(self.p_value):
                stat += f", p = {self.p_value:.3g} (α = {self.alpha:g})"
            lines.append(f"{'':15}{stat}")
        for paragraph in self.reason.splitlines():
            lines.append(f"{'':15}{paragraph}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The result as JSON-ready values."""
        return {
            "name": self.name,
            "title": self.title,
            "verdict": self.verdict.value,
            "reason": self.reason,
            "statistic_name": self.statistic_name,
            "statistic": _json_number(self.statistic),
            "p_value": _json_number(self.p_value),
            "alpha": _json_number(self.alpha),
            "curves": [c.to_dict() for c in self.curves],
            "details": _json_number(dict(self.details)),
        }


def result_maker(name: str, title: str) -> Callable[..., CheckResult]:
    """``result(verdict, reason, **fields)``: a :class:`CheckResult` of the check ``name``.

    Each check module makes its results with one, so that its name and title are stated once.
    """

    def result(verdict: Verdict, reason: str, **fields: Any) -> CheckResult:
        return CheckResult(name=name, title=title, verdict=verdict, reason=reason, **fields)

    return result


@attrs.frozen
class CheckReport:
    """The results of a run of the implementation-bug checks.

    Attributes:
        results: one :class:`CheckResult` per check, in the order they ran.
        settings: the settings the checks ran with (seed, learning rate, grids, …).
    """

    results: tuple[CheckResult, ...] = attrs.field(converter=tuple)
    settings: Mapping[str, Any] = attrs.field(factory=dict)

    def __getitem__(self, name: str) -> CheckResult:
        for result in self.results:
            if result.name == name:
                return result
        raise KeyError(name)

    @property
    def verdicts(self) -> dict[str, Verdict]:
        """Check name → verdict."""
        return {r.name: r.verdict for r in self.results}

    @property
    def failed(self) -> tuple[str, ...]:
        """Names of the checks that failed."""
        return tuple(r.name for r in self.results if r.verdict is Verdict.FAIL)

    @property
    def inconclusive(self) -> tuple[str, ...]:
        """Names of the checks that could not decide."""
        return tuple(r.name for r in self.results if r.verdict is Verdict.INCONCLUSIVE)

    @property
    def passed(self) -> bool:
        """True when no check failed (inconclusive and skipped checks do not count as failures)."""
        return not self.failed

    def summary(self) -> str:
        """The plain-text report: one block per check, then the overall outcome."""
        lines = ["DP-SGD implementation checks"]
        for key in ("seed", "loss", "learning_rate", "denominator", "plain_sgd"):
            if key in self.settings:
                lines.append(f"  {key:<14}{self.settings[key]}")
        lines.append("")
        for result in self.results:
            lines.append(result.summary())
        lines.append("")
        counts = {v: sum(r.verdict is v for r in self.results) for v in Verdict}
        tally = ", ".join(f"{counts[v]} {v.value}" for v in Verdict if counts[v])
        outcome = "FAILED" if self.failed else "OK"
        lines.append(f"{outcome}: {tally}")
        if self.failed:
            lines.append(f"failed checks: {', '.join(self.failed)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def assert_passed(self, *, allow_inconclusive: bool = False) -> None:
        """Raise ``AssertionError`` with :meth:`summary` unless every check passed.

        Args:
            allow_inconclusive: also accept inconclusive checks (skipped checks are always
                accepted).
        """
        bad = [
            r
            for r in self.results
            if r.verdict is Verdict.FAIL
            or (r.verdict is Verdict.INCONCLUSIVE and not allow_inconclusive)
        ]
        if bad:
            raise AssertionError(self.summary())

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready values."""
        return {
            "passed": self.passed,
            "failed": list(self.failed),
            "inconclusive": list(self.inconclusive),
            "settings": _json_number(dict(self.settings)),
            "results": [r.to_dict() for r in self.results],
        }

    def plot(self, path: str | None = None, *, checks: Sequence[str] | None = None) -> Any:
        """Draw every check's curves, one row of panels per check; return the figure.

        Needs matplotlib (the ``plot`` extra), imported here and nowhere else.

        Args:
            path: if given, also save the figure there (format from the file extension).
            checks: names of the checks to draw (default: all with curves).
        """
        import matplotlib.pyplot as plt

        chosen = [r for r in self.results if r.curves and (checks is None or r.name in set(checks))]
        rows = []
        for result in chosen:
            panels: dict[str, list[Curve]] = {}
            for curve in result.curves:
                panels.setdefault(curve.panel, []).append(curve)
            rows.append((result, panels))
        ncols = max((len(p) for _, p in rows), default=1)
        nrows = max(len(rows), 1)
        fig, axes = plt.subplots(nrows, ncols, figsize=(5.0 * ncols, 3.6 * nrows), squeeze=False)
        for i, (result, panels) in enumerate(rows):
            for j, (_panel, curves) in enumerate(panels.items()):
                ax = axes[i][j]
                for curve in curves:
                    if curve.style == "points":
                        ax.scatter(curve.x, curve.y, s=9, alpha=0.6, label=curve.label)
                    else:
                        ax.plot(curve.x, curve.y, marker="o", ms=3, label=curve.label)
                    if curve.log_x:
                        ax.set_xscale("log")
                ax.set_xlabel(curves[0].x_label)
                ax.set_ylabel(curves[0].y_label)
                ax.legend(fontsize=7)
                p = "" if math.isnan(result.p_value) else f", p={result.p_value:.2g}"
                ax.set_title(f"{result.name}: {result.verdict.value}{p}", fontsize=9)
            for j in range(len(panels), ncols):
                axes[i][j].set_visible(False)
        fig.tight_layout()
        if path is not None:
            fig.savefig(path)
        return fig
