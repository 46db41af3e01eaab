"""``clipping_applied``: per-example gradients are clipped to C ("Finding Private Bugs", section
3.1, fig. 2).

σ = 0, B = 1, one large-gradient point, a log-spaced grid of C. Below the gradient norm ‖g‖ the
update is η·C·g/‖g‖, so the one-step loss change Δ(C) = L(θ') − L(θ) depends on C (linearly, to
first order); above ‖g‖ it is constant. A step that does not clip gives the same Δ for every C.
The knee is the smallest grid C from which Δ stays within ``flat_rtol`` of its value at the
largest C. Test: the least-squares slope of Δ against C over the grid points in the lower half of
the transition below the knee (where Δ is linear in C even for Adam, whose update saturates before
‖g‖), t-test of slope = 0 (scipy.stats.linregress); fail when Δ varies by less than ``flat_rtol``
(relative) over the whole grid. The fitted line gives the gradient-norm estimate
‖g‖ ≈ (Δ(C_max) − intercept)/slope used by ``per_example_clipping``.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np

from dpledger.checks.config import CheckConfig
from dpledger.checks.report import CheckResult, Curve, Verdict, format_value, result_maker
from dpledger.checks.statistics import loss_resolution, parameter_distance, slope_test
from dpledger.checks.step_driver import StepDriver

__all__ = ["NAME", "TITLE", "check_clipping_applied"]

NAME = "clipping_applied"
TITLE = "per-example gradients are clipped to C"
_STATISTIC = "slope of loss change vs C below the gradient norm"


_result = result_maker(NAME, TITLE)


def check_clipping_applied(driver: StepDriver) -> tuple[CheckResult, float | None]:
    """σ = 0, B = 1, a grid of C: the one-step loss change must depend on C below ‖g‖.

    Args:
        driver: the driver of the step under test.

    Returns:
        The result, and the estimated gradient norm ‖g‖ of the large-gradient point when the
        check passed (else None).
    """
    x, y = driver.pool.batch(1, num_large=1)
    clips = np.asarray(driver.config.clip_norms)
    seed = driver.next_seed()
    outs = [driver.run(x, y, clip=c, sigma=0.0, seed=seed) for c in clips]
    delta = np.array([float(o.losses_after[0]) - float(o.losses_before[0]) for o in outs])
    disp = np.array([parameter_distance(o.params_after, o.params_before) for o in outs])
    resolution = loss_resolution(outs)
    curves = (
        Curve("σ = 0, B = 1", clips, delta, "clip norm C", "loss change", log_x=True),
        Curve(
            "σ = 0, B = 1",
            clips,
            disp,
            "clip norm C",
            "‖θ' − θ‖",
            log_x=True,
            panel="displacement",
        ),
    )
    details: dict[str, Any] = {
        "loss_change_unclipped": float(delta[-1]),
        "resolution": resolution,
    }
    measured = _LossChanges(clips=clips, delta=delta, curves=curves, details=details)
    early = _judge_knee(driver.config, measured, resolution)
    if isinstance(early, CheckResult):
        return early, None
    return _judge_slope(driver.config, measured, early)


@attrs.frozen
class _LossChanges:
    """The one-step loss change Δ at each C of the grid, with what the result reports.

    Attributes:
        clips: the grid of C.
        delta: Δ(C) at each grid point.
        curves: the curves the result shows.
        details: the result's details, filled in as the judgement goes.
    """

    clips: np.ndarray
    delta: np.ndarray
    curves: tuple[Curve, ...]
    details: dict[str, Any]

    @property
    def unclipped(self) -> float:
        """Δ at the largest C."""
        return float(self.delta[-1])

    def result(self, verdict: Verdict, reason: str, **fields: Any) -> CheckResult:
        """The check's result, with the curves and the details."""
        return _result(verdict, reason, curves=self.curves, details=self.details, **fields)


def _judge_knee(cfg: CheckConfig, measured: _LossChanges, resolution: float) -> CheckResult | int:
    """The knee of the loss-change curve, or the result when the curve cannot be tested."""
    clips, delta, ref = measured.clips, measured.delta, measured.unclipped
    details = measured.details
    if not np.all(np.isfinite(delta)):
        return measured.result(
            Verdict.INCONCLUSIVE,
            "The step produced a non-finite loss for some C; lower the learning rate.",
        )
    if abs(ref) <= resolution:
        return measured.result(
            Verdict.INCONCLUSIVE,
            f"At the largest C the step changes the loss by {format_value(ref)}, below the "
            f"numerical resolution {format_value(resolution)}: raise the learning rate.",
        )
    tol = max(cfg.flat_rtol * abs(ref), resolution)
    saturated = np.abs(delta - ref) <= tol
    knee = len(clips)
    while knee > 0 and saturated[knee - 1]:
        knee -= 1
    details["relative_variation"] = float(np.max(np.abs(delta - ref)) / abs(ref))
    if knee == 0:
        return measured.result(
            Verdict.FAIL,
            f"The one-step loss change is the same (within {cfg.flat_rtol:.0%}) for every C "
            f"in [{format_value(clips[0])}, {format_value(clips[-1])}]: the step ignores C, "
            "i.e. gradients are not clipped (unless the example's gradient norm is below "
            f"{format_value(clips[0])}; then extend clip_norms downwards).",
            statistic_name="relative variation of the loss change over C",
            statistic=details["relative_variation"],
        )
    details["clip_norm_knee"] = float(clips[knee])
    if knee < 3:
        return measured.result(
            Verdict.INCONCLUSIVE,
            f"The loss change depends on C, but only {knee} grid value(s) lie below the "
            f"knee at C ≈ {format_value(clips[knee])}; extend clip_norms downwards to test the "
            "slope.",
        )
    return knee


def _judge_slope(
    cfg: CheckConfig, measured: _LossChanges, knee: int
) -> tuple[CheckResult, float | None]:
    """The slope test below the knee, and the gradient-norm estimate it gives."""
    clips, delta, ref = measured.clips, measured.delta, measured.unclipped
    # fit the lower half of the transition, where the update is linear in C even for
    # optimisers that saturate before ‖g‖ (Adam's m/√v)
    progress = np.abs(delta[:knee] - delta[0]) / abs(ref - delta[0])
    lower = max(3, int(np.sum(progress <= 0.5)))
    test = slope_test(clips[:lower], delta[:lower])
    measured.details.update(
        slope=test.slope,
        t_statistic=test.t_statistic,
        points_below_knee=knee,
        points_fitted=lower,
    )
    common = test.result_fields(_STATISTIC, alpha=cfg.alpha_slope)
    if test.p_value < cfg.alpha_slope and test.slope != 0:
        g = (ref - test.intercept) / test.slope
        lo, hi = float(clips[knee - 1]), float(clips[knee])
        g = float(min(max(g, lo), hi)) if math.isfinite(g) and g > 0 else hi
        measured.details["gradient_norm_estimate"] = g
        reason = (
            f"The loss change depends on C below C ≈ {format_value(g)} (the estimated gradient "
            "norm of the large-gradient point) and is constant above it, as clipping to C "
            "predicts."
        )
        return measured.result(Verdict.PASS, reason, **common), g
    reason = (
        "The loss change varies with C but has no significant linear trend below the knee "
        f"(p = {test.p_value:.3g}); the step may be nonlinear in the update (lower the "
        "learning rate) or random at σ = 0."
    )
    return measured.result(Verdict.INCONCLUSIVE, reason, **common), None
