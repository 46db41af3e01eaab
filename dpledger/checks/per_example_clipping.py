"""``per_example_clipping``: clipping happens per example, before aggregation ("Finding Private
Bugs", section 3.1 and appendix A, fig. 3).

σ = 0, C ≪ ‖g‖/B_max, synthetic batches of zero-gradient fillers plus large-gradient points. The
measured quantity is the large points' share of the update, u = ‖θ' − θ'_fill‖, the distance from
the model a batch of fillers alone produces (θ for SGD; the state-driven step for momentum or
Adam, whose warm-up state adds a C-independent offset to the loss change that would mask the
effect). The paper's loss change of the large point is plotted alongside.

(a) The paper's design: B − 1 fillers and one large point, a grid of B. Per-example clipping
gives the update (η/B)·C·g/‖g‖, so u ∝ 1/B; clipping the batch mean gives η·C·g/‖g‖,
independent of B. Test: slope of u against 1/B, t-test. This design needs D = B; with a fixed
normaliser the correct update is also independent of B, so (a) is reported but not judged.

(b) A count design that works for any D: B fixed, k copies of the large point, a grid of k.
Per-example clipping gives (η/D)·k·C·g/‖g‖, so u ∝ k; clipping the mean (or the sum) gives the
same update for every k. Test: slope of u against k, t-test. (b) also catches clipping of the
*sum* followed by division by B, which (a) cannot tell from per-example clipping.

Control: batches of B and B/2 fillers only must lead to the same model (zero-gradient fillers add
nothing; hard cross-entropy labels leave a residual gradient and fail this). Flatness is judged by
the effect size (``flat_rtol``), since the slope p-value of a curve that is constant up to
round-off is meaningless.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from dpledger.checks.report import CheckResult, Curve, Verdict, format_value, result_maker
from dpledger.checks.statistics import SlopeTest, classify_trend, parameter_distance
from dpledger.checks.step_driver import StepDriver
from dpledger.checks.synthetic_data import LabelKind, LossKind, cross_entropy_residual

__all__ = ["NAME", "TITLE", "check_per_example_clipping"]

NAME = "per_example_clipping"
TITLE = "clipping happens per example, before aggregation"


_result = result_maker(NAME, TITLE)


@attrs.frozen
class _Trend:
    """How the large points' update depends on one design variable."""

    state: str
    test: SlopeTest | None
    change: float

    def statistic(self, label: str) -> dict[str, Any]:
        if self.test is None:
            return {}
        return {"statistic_name": label, "statistic": self.test.slope, "p_value": self.test.p_value}


@attrs.frozen
class _Designs:
    """What the two designs and the fillers-only control measured."""

    clip: float
    sizes: np.ndarray
    counts: np.ndarray
    disp_a: np.ndarray
    disp_b: np.ndarray
    delta_a: np.ndarray
    filler_ratio: float
    resolution: float


def check_per_example_clipping(
    driver: StepDriver, gradient_norm: Callable[[], float | None]
) -> CheckResult:
    """σ = 0, tiny C, fillers plus large-gradient points: the update must scale with 1/B (a)
    and with the number k of large points (b).

    Args:
        driver: the driver of the step under test.
        gradient_norm: returns the gradient norm of the large-gradient point estimated by
            ``clipping_applied`` (None when unknown); called only when
            ``CheckConfig.per_example_clip_norm`` is not set.
    """
    cfg = driver.config
    notes: list[str] = []
    g = None
    if cfg.per_example_clip_norm is not None:
        clip = cfg.per_example_clip_norm
    else:
        g = gradient_norm()
        bmax = max(max(cfg.batch_sizes), cfg.counts_batch)
        if g is None:
            clip = cfg.clip_norms[0] / (cfg.per_example_margin * bmax)
            notes.append(
                "The large point's gradient norm is unknown (clipping_applied did not pass), "
                f"so C = {format_value(clip)} may not clip it."
            )
        else:
            clip = g / (cfg.per_example_margin * bmax)
    details: dict[str, Any] = {"clip_norm": clip, "denominator": driver.denominator}
    designs = _measure(driver, clip)
    details["filler_update_ratio"] = designs.filler_ratio
    trend_a, trend_b = _trends(driver, designs)
    judge_a = driver.denominator == "batch"
    details.update(
        batch_design={
            "state": trend_a.state,
            "judged": judge_a,
            "relative_change": trend_a.change,
            "slope_vs_inverse_batch_size": None if trend_a.test is None else trend_a.test.slope,
            "p_value": None if trend_a.test is None else trend_a.test.p_value,
        },
        count_design={
            "state": trend_b.state,
            "batch_size": cfg.counts_batch,
            "relative_change": trend_b.change,
            "slope_vs_count": None if trend_b.test is None else trend_b.test.slope,
            "p_value": None if trend_b.test is None else trend_b.test.p_value,
        },
    )
    if driver.loss is LossKind.CROSS_ENTROPY and driver.labels is LabelKind.HARD:
        pool = driver.pool
        resid = cross_entropy_residual(driver.predict(pool.filler_x), pool.filler_y)
        details["filler_residual_logit_gradient_mean"] = float(resid.mean())
    common: dict[str, Any] = {
        "curves": _curves(designs, cfg.counts_batch),
        "details": details,
        "alpha": cfg.alpha_slope,
    }
    unknown_norm = notes[0] if g is None and cfg.per_example_clip_norm is None else None
    return _judge(driver, designs, trend_a, trend_b, unknown_norm, common)


def _measure(driver: StepDriver, clip: float) -> _Designs:
    """Run the fillers-only control and the two designs at σ = 0 with one seed."""
    cfg = driver.config
    pool = driver.pool
    seed = driver.next_seed()
    kb = cfg.counts_batch
    # control: fillers only at two batch sizes; with zero-gradient fillers both updates are
    # the same (no move for SGD, the state-driven move for momentum/Adam)
    fx, fy = pool.batch(kb, num_large=0)
    fill = driver.run(fx, fy, clip=clip, sigma=0.0, seed=seed)
    hx, hy = pool.batch(max(kb // 2, 1), num_large=0)
    half = driver.run(hx, hy, clip=clip, sigma=0.0, seed=seed)
    # (b) the count design
    outs_b = []
    for k in cfg.large_counts:
        bx, by = pool.batch(kb, num_large=k)
        outs_b.append(driver.run(bx, by, clip=clip, sigma=0.0, seed=seed))
    one_large = parameter_distance(outs_b[0].params_after, fill.params_after)
    filler_ratio = (
        parameter_distance(fill.params_after, half.params_after) / one_large
        if one_large > 0
        else math.inf
    )
    # (a) the paper's batch-size design
    outs_a = []
    for b in cfg.batch_sizes:
        ax, ay = pool.batch(b, num_large=1)
        outs_a.append(driver.run(ax, ay, clip=clip, sigma=0.0, seed=seed))
    # the large points' share of the update: the displacement from the fillers-only model
    # (θ₀ for SGD; the state-driven step for momentum/Adam, identical for any batch of
    # zero-gradient fillers, as the control above verifies)
    return _Designs(
        clip=clip,
        sizes=np.asarray(cfg.batch_sizes, dtype=float),
        counts=np.asarray(cfg.large_counts, dtype=float),
        disp_a=np.array([parameter_distance(o.params_after, fill.params_after) for o in outs_a]),
        disp_b=np.array([parameter_distance(o.params_after, fill.params_after) for o in outs_b]),
        delta_a=np.array([float(o.losses_after[-1] - o.losses_before[-1]) for o in outs_a]),
        filler_ratio=filler_ratio,
        resolution=(
            10.0
            * fill.machine_epsilon
            * float(np.linalg.norm(np.asarray(fill.params_after, np.float64)))
        ),
    )


def _trends(driver: StepDriver, designs: _Designs) -> tuple[_Trend, _Trend]:
    """The update against 1/B (design a) and against k (design b)."""
    cfg = driver.config
    trend_a = _Trend(
        *classify_trend(
            1.0 / designs.sizes[::-1],
            designs.disp_a[::-1],
            resolution=designs.resolution,
            flat_rtol=cfg.flat_rtol,
            alpha=cfg.alpha_slope,
            grows=True,
        )
    )
    trend_b = _Trend(
        *classify_trend(
            designs.counts,
            designs.disp_b,
            resolution=designs.resolution,
            flat_rtol=cfg.flat_rtol,
            alpha=cfg.alpha_slope,
            grows=True,
        )
    )
    return trend_a, trend_b


def _curves(designs: _Designs, kb: int) -> tuple[Curve, ...]:
    return (
        Curve(
            "one large point + (B − 1) zero-gradient points",
            designs.sizes,
            designs.disp_a,
            "batch size B",
            "update due to the large point",
            panel="batch size",
        ),
        Curve(
            f"k large points + ({kb} − k) zero-gradient points",
            designs.counts,
            designs.disp_b,
            "number k of large-gradient points",
            "update due to the large points",
            panel="count",
        ),
        Curve(
            "one large point + (B − 1) zero-gradient points",
            designs.sizes,
            designs.delta_a,
            "batch size B",
            "loss change of the large point",
            panel="loss change",
        ),
    )


def _judge(
    driver: StepDriver,
    designs: _Designs,
    trend_a: _Trend,
    trend_b: _Trend,
    unknown_norm: str | None,
    common: dict[str, Any],
) -> CheckResult:
    """The verdict from the two designs and the fillers-only control."""
    cfg = driver.config
    kb = cfg.counts_batch
    judge_a = driver.denominator == "batch"
    stat_a = trend_a.statistic("slope of the update vs 1/B (design a)")
    stat_b = trend_b.statistic("slope of the update vs k (design b)")
    if trend_b.state == "flat":
        return _aggregate_clipped(designs, trend_a, trend_b, judge_a, kb, cfg.flat_rtol, common)
    if designs.filler_ratio > cfg.filler_tolerance:
        return _fillers_not_gradient_free(driver, designs.filler_ratio, {**stat_b, **common})
    if judge_a and trend_a.state == "flat" and trend_b.state == "ok":
        return _result(
            Verdict.INCONCLUSIVE,
            "Clipping looks per-example (the update grows with the number of large points), "
            "but the update does not shrink with the batch size although the step was "
            "declared to divide by the realised batch size (denominator='batch'). If the step "
            "divides by a fixed number, pass it as denominator.",
            statistic_name="largest relative change of the update over B (design a)",
            statistic=trend_a.change,
            **{**common, "alpha": math.nan},
        )
    shown = stat_a if judge_a else stat_b
    if trend_b.state == "ok" and ((not judge_a) or trend_a.state == "ok"):
        if unknown_norm is not None:
            return _result(
                Verdict.INCONCLUSIVE,
                "The update scales as per-example clipping predicts, but "
                + unknown_norm
                + " Set CheckConfig.per_example_clip_norm well below ‖g‖/B_max to decide.",
                **shown,
                **common,
            )
        sizes = designs.sizes
        tail = (
            f"the update shrinks like 1/B over B = {int(sizes[0])}…{int(sizes[-1])} and "
            if judge_a
            else "the update "
        )
        return _result(
            Verdict.PASS,
            f"With C = {format_value(designs.clip)} (≪ ‖g‖/B), {tail}grows with the number of "
            "large-gradient points, as clipping each example before aggregation predicts.",
            **shown,
            **common,
        )
    states = f"batch-size design: {trend_a.state}; count design: {trend_b.state}"
    return _result(
        Verdict.INCONCLUSIVE,
        f"The curves do not show a clear pattern ({states}). 'unresolved' means the update is "
        "below the numerical resolution (raise the learning rate); 'noisy' means no "
        "significant trend; 'unexpected' means the update changes in the wrong direction.",
        **shown,
        **common,
    )


def _aggregate_clipped(
    designs: _Designs,
    trend_a: _Trend,
    trend_b: _Trend,
    judge_a: bool,
    kb: int,
    flat_rtol: float,
    common: dict[str, Any],
) -> CheckResult:
    """k large points move the model as much as one: an aggregate is clipped."""
    counts = designs.counts
    # a flat curve is judged by its effect size; its slope p-value only reflects round-off
    return _result(
        Verdict.FAIL,
        f"k copies of the large-gradient point move the model as much as one (the "
        f"update varies by {trend_b.change:.2%} for k = {int(counts[0])}…{int(counts[-1])} at "
        f"B = {kb}, C = {format_value(designs.clip)}; flat means within {flat_rtol:.0%}): the "
        "step clips an aggregate (the batch mean or sum), not each example."
        + (
            f" The batch-size design agrees: the update does not shrink with B (change "
            f"{trend_a.change:.2%})."
            if judge_a and trend_a.state == "flat"
            else ""
        ),
        statistic_name="largest relative change of the update over k (design b)",
        statistic=trend_b.change,
        **{**common, "alpha": math.nan},
    )


def _fillers_not_gradient_free(
    driver: StepDriver, filler_ratio: float, common: dict[str, Any]
) -> CheckResult:
    """Batches of fillers only move the model: the synthetic batch does not isolate the point."""
    cfg = driver.config
    kb = cfg.counts_batch
    why = (
        " Hard cross-entropy labels cannot zero the gradient (residual softmax − one-hot);"
        " use labels='soft' if the step accepts probability targets."
        if driver.labels is LabelKind.HARD
        else " The step may have randomness at σ = 0 or the model output may not be a "
        "deterministic function of the input."
    )
    return _result(
        Verdict.INCONCLUSIVE,
        f"Batches of {kb} and {max(kb // 2, 1)} zero-gradient fillers lead to models "
        f"{filler_ratio:.1%} as far apart as one large-gradient point moves the model "
        f"(tolerance {cfg.filler_tolerance:.0%}), so the fillers are not gradient-free "
        "and the synthetic batch does not isolate the large point." + why,
        **common,
    )
