"""``noise_calibrated``: the noise scales with the clip norm C ("Finding Private Bugs", section
3.2, theorem 1, appendix B, fig. 4).

C above every per-example gradient norm, found as in appendix B (σ = 0, a grid of C, the smallest
C from which the update stops changing), then 10 values of C in [C*, 10·C*], several seeds per C,
the mean pairwise parameter distance E‖θ₁ − θ₂‖ = (η/D)·√2·σC·E[χ_K] ∝ C. Test: slope of the mean
distance against C, t-test, and the elasticity d log dist / d log C, which must lie in
``elasticity_range`` (1 for a correct step; 0 for noise N(0, σ²) that ignores C). Control: the
same grid at σ = 0 must give (nearly) the same model for every C and seed. The elasticity must be
known to a standard error ≤ ``elasticity_max_stderr`` (0.125, so the band edge 0.5 is four
standard errors from both 0 and 1), else the check is inconclusive.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np
import scipy.stats

from dpledger.checks.noise_stages import NoiseStages
from dpledger.checks.report import CheckResult, Curve, Verdict, format_value, result_maker
from dpledger.checks.statistics import SlopeTest, parameter_distance, slope_test
from dpledger.checks.step_driver import StepDriver

__all__ = ["NAME", "TITLE", "check_noise_calibrated"]

NAME = "noise_calibrated"
TITLE = "the noise scales with the clip norm C"
_STATISTIC = "slope of mean pairwise distance vs C"


_result = result_maker(NAME, TITLE)


@attrs.frozen
class _Distances:
    """Pairwise distances of the noisy models and of the σ = 0 control over the C grid."""

    grid: np.ndarray
    pair_x: list[float]
    pair_d: list[float]
    means: np.ndarray
    control: np.ndarray
    control_between_seeds: float


def check_noise_calibrated(driver: StepDriver, noise: NoiseStages) -> CheckResult:
    """Unclipped C grid, several seeds per C: the pairwise distance must grow like C.

    Args:
        driver: the driver of the step under test.
        noise: the noise experiments shared with ``noise_magnitude``.
    """
    search = noise.unclipped_clip_norm()
    curves: list[Curve] = [search["curve"]]
    missing = noise.missing_unclipped_clip_norm()
    if missing is not None:
        return _result(Verdict.INCONCLUSIVE, missing, curves=curves)
    star = search["clip_norm"]
    sig = noise.noise_multiplier()
    sigma = sig["sigma"]
    if sigma is None:
        return _result(
            Verdict.INCONCLUSIVE,
            f"No noise multiplier could be chosen ({sig['source']}); pass noise_multiplier.",
            curves=curves,
        )
    dist = _measure(driver, noise, noise.noise_grid(star), sigma)
    curves += _curves(dist, sigma)
    details: dict[str, Any] = {
        "unclipped_clip_norm": star,
        "clip_norms": dist.grid.tolist(),
        "noise_multiplier": sigma,
        "noise_multiplier_source": sig["source"],
        "seeds_per_clip_norm": driver.config.seeds_per_clip_norm,
        "mean_distances": dist.means.tolist(),
        "control_max_distance_between_clip_norms": float(dist.control.max()),
        "control_distance_between_seeds": dist.control_between_seeds,
    }
    return _judge(driver, noise, dist, sigma, curves, details)


def _measure(driver: StepDriver, noise: NoiseStages, grid: np.ndarray, sigma: float) -> _Distances:
    """n noisy models per C (pairwise distances) and the σ = 0 control."""
    n = driver.config.seeds_per_clip_norm
    steps = driver.config.noise_steps
    pair_x, pair_d, means = [], [], []
    for c in grid:
        params = noise.noisy_params(c, sigma, n, steps)
        ds = [parameter_distance(params[i], params[j]) for i in range(n) for j in range(i + 1, n)]
        pair_x.extend([c] * len(ds))
        pair_d.extend(ds)
        means.append(float(np.mean(ds)))
    # σ = 0 control: one seed per C, plus a second seed at the smallest C
    x, y = driver.noise_batch()
    ctrl_seed = driver.next_seed()
    ctrl = [
        driver.run(x, y, clip=c, sigma=0.0, seed=ctrl_seed, steps=steps).params_after for c in grid
    ]
    other = driver.run(x, y, clip=grid[0], sigma=0.0, steps=steps).params_after
    return _Distances(
        grid=grid,
        pair_x=pair_x,
        pair_d=pair_d,
        means=np.asarray(means),
        control=np.array([parameter_distance(p, ctrl[0]) for p in ctrl]),
        control_between_seeds=parameter_distance(other, ctrl[0]),
    )


def _curves(dist: _Distances, sigma: float) -> list[Curve]:
    return [
        Curve(
            f"σ = {sigma:g}: model pairs",
            dist.pair_x,
            dist.pair_d,
            "clip norm C",
            "pairwise parameter distance",
            style="points",
            panel="distance",
        ),
        Curve(
            f"σ = {sigma:g}: mean",
            dist.grid,
            dist.means,
            "clip norm C",
            "pairwise parameter distance",
            panel="distance",
        ),
        Curve(
            "σ = 0 control",
            dist.grid,
            dist.control,
            "clip norm C",
            "pairwise parameter distance",
            panel="distance",
        ),
    ]


def _judge(
    driver: StepDriver,
    noise: NoiseStages,
    dist: _Distances,
    sigma: float,
    curves: list[Curve],
    details: dict[str, Any],
) -> CheckResult:
    """The verdict from the σ = 0 control, the slope test and the elasticity."""
    cfg = driver.config
    means_a, grid = dist.means, dist.grid
    if np.all(means_a == 0):
        return _result(
            Verdict.FAIL,
            f"Models trained with different seeds at σ = {sigma:g} are identical: the step "
            "adds no noise, or ignores the seed/generator it is given.",
            curves=curves,
            details=details,
        )
    smallest = float(means_a.min())
    worst = max(float(dist.control.max()), dist.control_between_seeds)
    control = worst / smallest if smallest > 0 else math.inf
    details["control_ratio"] = control
    details["control_slope_p_value"] = slope_test(grid, dist.control).p_value
    if control > cfg.control_tolerance:
        return _result(
            Verdict.INCONCLUSIVE,
            f"At σ = 0 the trained model changes with C or with the seed by {control:.1%} of "
            f"the noisy pairwise distance (tolerance {cfg.control_tolerance:.0%}): clipping "
            "may still be active, or the step has randomness besides the noise.",
            curves=curves,
            details=details,
        )
    test = slope_test(grid, means_a)
    if np.all(means_a > 0):
        el = scipy.stats.linregress(np.log(grid), np.log(means_a))
        elasticity, el_se = float(el.slope), float(el.stderr)
    else:
        elasticity, el_se = math.nan, math.nan
    details.update(elasticity=elasticity, elasticity_stderr=el_se, slope=test.slope)
    common = {
        **test.result_fields(_STATISTIC, alpha=cfg.alpha_slope),
        "curves": curves,
        "details": details,
    }
    if not el_se <= cfg.elasticity_max_stderr:
        return _result(
            Verdict.INCONCLUSIVE,
            f"The elasticity d log dist / d log C = {elasticity:.3f} is too imprecise "
            f"(standard error {el_se:.3g} > {cfg.elasticity_max_stderr:g}) to tell 1 "
            f"from 0: raise seeds_per_clip_norm (few parameters, here "
            f"{noise.start_params.size}, or an adaptive optimiser make the distances noisy).",
            **common,
        )
    return _judge_elasticity(cfg.elasticity_range, grid, test, elasticity, common)


def _judge_elasticity(
    band: tuple[float, float],
    grid: np.ndarray,
    test: SlopeTest,
    elasticity: float,
    common: dict[str, Any],
) -> CheckResult:
    """Pass when the distance grows significantly with C at an elasticity inside ``band``."""
    lo, hi = band
    alpha = common["alpha"]
    span = f"C ∈ [{format_value(grid[0])}, {format_value(grid[-1])}]"
    if test.p_value < alpha and test.slope > 0 and lo <= elasticity <= hi:
        return _result(
            Verdict.PASS,
            f"Over {span} (nothing clipped) the pairwise distance grows with C "
            f"(elasticity d log dist / d log C = {elasticity:.3f}; 1 expected), so the noise "
            "is calibrated to C. The σ = 0 control is flat.",
            **common,
        )
    if test.p_value >= alpha or test.slope <= 0:
        why = (
            f"Over {span} (nothing clipped) the pairwise distance does not grow with C "
            f"(elasticity {elasticity:.3f}): the noise does not scale with the clip norm "
            "(e.g. N(0, σ²) instead of N(0, (σC)²))."
        )
    else:
        why = (
            f"Over {span} the pairwise distance grows like C^{elasticity:.2f}, outside "
            f"[{lo:g}, {hi:g}]: the noise is not proportional to C."
        )
    return _result(Verdict.FAIL, why, **common)
