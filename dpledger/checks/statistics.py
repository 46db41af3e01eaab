"""The statistics of the checks: least-squares slope tests and the classification of a curve.

The checks run the step on designed batches and test how the measured update or loss change
depends on the design variable (C, 1/B, k): a least-squares line with the t-test of slope = 0
(``scipy.stats.linregress``), and a classification of the curve as flat, growing as expected,
changing the wrong way, noisy or below the numerical resolution.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import attrs
import numpy as np
import scipy.stats

from dpledger.checks.step_harness import StepOutcome
from dpledger.errors import InvalidParameterError

__all__ = [
    "SlopeTest",
    "TrendState",
    "classify_trend",
    "loss_resolution",
    "parameter_distance",
    "slope_test",
]

TrendState = Literal["unresolved", "flat", "ok", "unexpected", "noisy"]
"""``"unresolved"``, ``"flat"``, ``"ok"``, ``"unexpected"`` or ``"noisy"`` (see
:func:`classify_trend`)."""


@attrs.frozen
class SlopeTest:
    """A least-squares line y = intercept + slope·x and the t-test of slope = 0.

    Attributes:
        slope: the least-squares slope.
        intercept: the intercept.
        stderr: standard error of the slope.
        t_statistic: slope / stderr (±inf for a perfect non-flat fit, 0 for a flat one).
        p_value: two-sided p-value of the t-test with n − 2 degrees of freedom.
        n: number of points.
    """

    slope: float
    intercept: float
    stderr: float
    t_statistic: float
    p_value: float
    n: int

    def result_fields(self, statistic_name: str, *, alpha: float) -> dict[str, Any]:
        """The fields of a :class:`~dpledger.checks.report.CheckResult` that report this test:
        the slope as the statistic ``statistic_name``, its p-value and the level ``alpha``."""
        return {
            "statistic_name": statistic_name,
            "statistic": self.slope,
            "p_value": self.p_value,
            "alpha": alpha,
        }


def slope_test(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> SlopeTest:
    """Fit y = a + b·x by least squares and test b = 0 (``scipy.stats.linregress``).

    A flat y (all values equal) gives b = 0 and p = 1; a perfect fit with b ≠ 0 gives p = 0.

    Raises:
        InvalidParameterError: fewer than 3 points, non-finite values, or all x equal.
    """
    xa = np.asarray(x, dtype=np.float64).reshape(-1)
    ya = np.asarray(y, dtype=np.float64).reshape(-1)
    if xa.shape != ya.shape or xa.size < 3:
        raise InvalidParameterError("x", f"{xa.size} points", "at least 3 (x, y) pairs")
    if not (np.all(np.isfinite(xa)) and np.all(np.isfinite(ya))):
        raise InvalidParameterError("y", "values with NaN or inf", "finite values")
    if np.ptp(xa) == 0:
        raise InvalidParameterError("x", "all equal", "at least two different x values")
    n = int(xa.size)
    if np.ptp(ya) == 0:
        return SlopeTest(0.0, float(ya[0]), 0.0, 0.0, 1.0, n)
    res = scipy.stats.linregress(xa, ya)
    slope, stderr = float(res.slope), float(res.stderr)
    if stderr == 0.0 or not math.isfinite(stderr):
        t = math.copysign(math.inf, slope) if slope != 0 else 0.0
        p = 0.0 if slope != 0 else 1.0
    else:
        t = slope / stderr
        p = float(2.0 * scipy.stats.t.sf(abs(t), n - 2))
    return SlopeTest(slope, float(res.intercept), stderr, t, p, n)


def classify_trend(
    x: np.ndarray,
    y: np.ndarray,
    *,
    resolution: float,
    flat_rtol: float,
    alpha: float,
    grows: bool,
) -> tuple[TrendState, SlopeTest | None, float]:
    """Classify the dependence of y on x (sorted by the design variable).

    Returns (state, slope test, relative change) where state is ``"unresolved"`` (|y| at the
    first point is below the numerical resolution), ``"flat"`` (all |y − y₀| ≤ flat_rtol·|y₀|),
    ``"ok"`` (significant slope and |y| changes in the expected direction), ``"unexpected"``
    (significant, wrong direction) or ``"noisy"`` (varies, no significant slope).
    The expected direction is |y| growing along the design variable when ``grows`` is true.
    """
    ref = float(y[0])
    if abs(ref) <= resolution or not np.all(np.isfinite(y)):
        return "unresolved", None, math.nan
    rel = np.abs(y - ref) / abs(ref)
    change = float(rel.max())
    if change <= flat_rtol or float(np.max(np.abs(y - ref))) <= resolution:
        test = slope_test(x, y)
        return "flat", test, change
    test = slope_test(x, y)
    if test.p_value >= alpha:
        return "noisy", test, change
    last_bigger = abs(float(y[-1])) > abs(ref)
    return ("ok" if last_bigger == grows else "unexpected"), test, change


def loss_resolution(outcomes: Sequence[StepOutcome]) -> float:
    """Smallest loss change that is not round-off: 100 ulps of the largest loss involved."""
    eps = max(o.loss_epsilon for o in outcomes)
    scale = max(1.0, *(float(np.max(np.abs(np.asarray(o.losses_before, float)))) for o in outcomes))
    return 100.0 * eps * scale


def parameter_distance(a: np.ndarray, b: np.ndarray) -> float:
    """The Euclidean distance of two parameter vectors, computed in float64."""
    return float(np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64)))
