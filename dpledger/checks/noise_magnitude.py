"""``noise_magnitude``: the noise has standard deviation σ·C (times η/D) per coordinate ("Finding
Private Bugs", appendix C; Tramèr et al., "Debugging Differential Privacy", section 4).

Plain SGD only. Two runs from the same start on the same batch differ by
θ₁ − θ₂ = (η/D)·(n₁ − n₂) ~ N(0, 2(ησC/D)² I) in the unclipped regime, so the coordinates
z = (θ₁ − θ₂)/(√2·σC·η/D) are i.i.d. N(0, 1). Test: Kolmogorov–Smirnov test of z against N(0, 1)
and a two-sided χ² test of Σz² ~ χ²_N, each at α/2 (Bonferroni); also reported: the ratio of the
observed to the expected noise scale with its confidence interval, and the expected-distance ratio
of theorem 1. This catches noise that scales with C but is too small by a factor (the noise
standard deviation σC/B of the backpropagation-clipping case study), which the slope test of
``noise_calibrated`` cannot see. η/D comes from the caller (``learning_rate`` and
``denominator``) or, if no learning rate is given, is estimated from a σ = 0 run on a batch with
one clipped large-gradient point, ‖Δθ‖ = (η/D)·C: the ratio then measures the noise against one
example's clipped contribution (the privacy-relevant ratio), so a clipping bug can also show here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import scipy.stats

from dpledger.checks.noise_stages import NoiseStages
from dpledger.checks.report import CheckResult, Curve, Verdict, format_value, result_maker
from dpledger.checks.statistics import parameter_distance
from dpledger.checks.step_driver import StepDriver

__all__ = ["NAME", "TITLE", "check_noise_magnitude", "update_scale"]

NAME = "noise_magnitude"
TITLE = "the noise has standard deviation σ·C (times η/D) per coordinate"


_result = result_maker(NAME, TITLE)


def update_scale(
    driver: StepDriver, batch_size: int, gradient_norm: Callable[[], float | None]
) -> dict[str, Any]:
    """η/D for a batch of ``batch_size``: from the caller, or estimated at σ = 0.

    The estimate runs one large-gradient point among fillers with C = ‖g‖/(margin·B): a
    correct step moves the parameters by exactly (η/D)·C.

    Args:
        driver: the driver of the step under test.
        batch_size: B.
        gradient_norm: returns the gradient norm of the large-gradient point estimated by
            ``clipping_applied`` (None when unknown); called only without a learning rate.

    Returns:
        ``{"scale": η/D or None, "source": how it was found}``.
    """
    if driver.learning_rate is not None:
        denom = batch_size if driver.denominator == "batch" else driver.denominator
        return {
            "scale": driver.learning_rate / float(denom),
            "source": "learning_rate / denominator",
        }
    g = gradient_norm()
    if g is None:
        return {"scale": None, "source": "estimate needs the gradient norm (clipping check)"}
    clip = g / (driver.config.per_example_margin * batch_size)
    x, y = driver.pool.batch(batch_size, num_large=1)
    o = driver.run(x, y, clip=clip, sigma=0.0)
    return {
        "scale": parameter_distance(o.params_after, o.params_before) / clip,
        "source": "estimated from a σ = 0 run with one clipped point (‖Δθ‖ / C)",
    }


@attrs.frozen
class _Standardised:
    """The standardised differences z of pairs of noisy runs and their tests."""

    z: np.ndarray
    pairs: int
    dist_ratio: list[float]
    chi_mean: float
    dims: int


def check_noise_magnitude(
    driver: StepDriver, noise: NoiseStages, scale_of: Callable[[int], dict[str, Any]]
) -> CheckResult:
    """Plain SGD: (θ₁ − θ₂)/(√2·σC·η/D) must be i.i.d. N(0, 1) (KS and χ² tests).

    Args:
        driver: the driver of the step under test.
        noise: the noise experiments shared with ``noise_calibrated``.
        scale_of: ``scale_of(batch_size)`` is :func:`update_scale` for that batch size.
    """
    cfg = driver.config
    if not driver.plain_sgd:
        return _result(
            Verdict.SKIPPED,
            "The optimiser transforms the noisy gradient (momentum, Adam's m/√v), so the "
            "difference of two runs is not (η/D)·N(0, 2(σC)² I); the scale test of appendix C "
            "applies to plain SGD only. The noise_calibrated check still applies.",
        )
    missing = noise.missing_unclipped_clip_norm()
    if missing is not None:
        return _result(Verdict.INCONCLUSIVE, missing)
    star = noise.unclipped_clip_norm()["clip_norm"]
    sigma = noise.noise_multiplier()["sigma"]
    scale_info = scale_of(cfg.noise_batch_size)
    scale = scale_info["scale"]
    if scale is None or not scale > 0:
        return _result(
            Verdict.INCONCLUSIVE,
            f"η/D could not be determined ({scale_info['source']}); pass learning_rate.",
        )
    grid = noise.noise_grid(star)
    std = _standardise(driver, noise, grid, sigma, scale)
    return _test(driver, noise, std, grid, sigma, scale_info)


def _standardise(
    driver: StepDriver, noise: NoiseStages, grid: np.ndarray, sigma: float, scale: float
) -> _Standardised:
    """Differences of pairs of one-step noisy runs, divided by their expected scale."""
    cfg = driver.config
    n = cfg.seeds_per_clip_norm
    k = int(noise.noisy_params(grid[0], sigma, 2, 1)[0].size)
    pairs_needed = max(1, math.ceil(cfg.magnitude_min_samples / k))
    per_c = max(n // 2 if cfg.noise_steps == 1 else 1, math.ceil(pairs_needed / len(grid)))
    z_parts, dist_ratio = [], []
    chi_mean = float(scipy.stats.chi(k).mean())
    for c in grid:
        params = noise.noisy_params(c, sigma, 2 * per_c, 1)
        s = math.sqrt(2.0) * sigma * c * scale
        for i in range(per_c):
            diff = params[2 * i] - params[2 * i + 1]
            z_parts.append(diff / s)
            dist_ratio.append(float(np.linalg.norm(diff)) / (s * chi_mean))
    return _Standardised(
        z=np.concatenate(z_parts),
        pairs=len(z_parts),
        dist_ratio=dist_ratio,
        chi_mean=chi_mean,
        dims=k,
    )


def _test(
    driver: StepDriver,
    noise: NoiseStages,
    std: _Standardised,
    grid: np.ndarray,
    sigma: float,
    scale_info: dict[str, Any],
) -> CheckResult:
    """KS and χ² tests of z against N(0, 1), and the verdict."""
    z, k, chi_mean = std.z, std.dims, std.chi_mean
    nz = int(z.size)
    a = driver.config.alpha_magnitude
    ks = scipy.stats.kstest(z, "norm")
    ss = float(np.sum(z * z))
    chi2 = scipy.stats.chi2(nz)
    p_var = float(min(1.0, 2.0 * min(chi2.cdf(ss), chi2.sf(ss))))
    ratio = math.sqrt(ss / nz)
    ci = (
        math.sqrt(ss / chi2.ppf(1 - a / 2)),
        math.sqrt(ss / chi2.ppf(a / 2)),
    )
    p = float(min(1.0, 2.0 * min(float(ks.pvalue), p_var)))
    # theorem 1: ‖θ₁ − θ₂‖ / (√2·σC·η/D) ~ r·χ_K, so each distance ratio is r·χ_K / E[χ_K]
    # with relative standard deviation √(K − E[χ_K]²) / E[χ_K]
    mean_dr = float(np.mean(std.dist_ratio))
    rel_sd = math.sqrt(max(k - chi_mean**2, 0.0)) / chi_mean
    half = scipy.stats.norm.ppf(1 - a / 2) * mean_dr * rel_sd / math.sqrt(len(std.dist_ratio))
    details = {
        "clip_norms": grid.tolist(),
        "noise_multiplier": sigma,
        "batch_size": driver.config.noise_batch_size,
        "update_scale": scale_info["scale"],
        "update_scale_source": scale_info["source"],
        "samples": nz,
        "pairs": std.pairs,
        "ks_statistic": float(ks.statistic),
        "ks_p_value": float(ks.pvalue),
        "chi2_p_value": p_var,
        "scale_ratio": ratio,
        "scale_ratio_ci": list(ci),
        "expected_distance_ratio": mean_dr,
        "expected_distance_ratio_ci": [mean_dr - half, mean_dr + half],
        "expected_noise_std": sigma * float(grid[0]) * scale_info["scale"],
    }
    common = {
        "statistic_name": "observed / expected noise scale",
        "statistic": ratio,
        "p_value": p,
        "alpha": a,
        "curves": _curves(z),
        "details": details,
    }
    floor = 100.0 * noise.machine_epsilon * float(np.max(np.abs(noise.start_params))) if nz else 0.0
    return _judge(details, floor, driver.config.noise_batch_size, common)


def _curves(z: np.ndarray) -> tuple[Curve, ...]:
    nz = int(z.size)
    order = np.sort(z)
    shown = order[np.linspace(0, nz - 1, min(nz, 400)).astype(int)]
    ecdf = (np.searchsorted(order, shown, side="right")) / nz
    grid_z = np.linspace(min(-4.0, float(order[0])), max(4.0, float(order[-1])), 200)
    return (
        Curve("standardised coordinates", shown, ecdf, "z = Δθ / (√2·σC·η/D)", "CDF"),
        Curve("N(0, 1)", grid_z, scipy.stats.norm.cdf(grid_z), "z", "CDF"),
    )


def _judge(details: dict[str, Any], floor: float, bsz: int, common: dict[str, Any]) -> CheckResult:
    """Pass when z is N(0, 1); else say whether the noise is too small, too large or misshapen."""
    expected_std = details["expected_noise_std"]
    ratio, ci = details["scale_ratio"], details["scale_ratio_ci"]
    ks_p, p_var, nz = details["ks_p_value"], details["chi2_p_value"], details["samples"]
    p, a = common["p_value"], common["alpha"]
    if expected_std <= floor:
        return _result(
            Verdict.INCONCLUSIVE,
            f"The expected noise per coordinate ({format_value(expected_std)}) is below the "
            f"float round-off of the parameters ({format_value(floor)}); raise the learning "
            "rate or σ.",
            **common,
        )
    ci_text = f"[{ci[0]:.3f}, {ci[1]:.3f}]"
    if ratio == 0:
        return _result(
            Verdict.FAIL,
            "Two runs with different seeds end at the same parameters: no noise is added.",
            **common,
        )
    if p >= a:
        return _result(
            Verdict.PASS,
            f"The difference of two runs is N(0, 2(σC·η/D)²) per coordinate: observed/"
            f"expected scale {ratio:.4f}, {1 - a:.1%} CI {ci_text}; KS p = "
            f"{ks_p:.3g}, χ² p = {p_var:.3g} over {nz} coordinates.",
            **common,
        )
    if ci[1] < 1.0:
        hint = (
            f"The noise is {1 / ratio:.3g}× smaller than σ·C (CI {ci_text} of the ratio). "
            f"A ratio near 1/B = {1 / bsz:.3g} means the noise standard deviation was divided "
            "by the batch size (sensitivity C/B instead of C): the privacy guarantee is "
            "overstated."
        )
    elif ci[0] > 1.0:
        hint = (
            f"The noise is {ratio:.3g}× larger than σ·C (CI {ci_text}): the step does not "
            "implement the stated σ (privacy is not at risk, accuracy is)."
        )
    else:
        hint = (
            f"The scale matches (CI {ci_text}) but the coordinates are not Gaussian with equal "
            f"scale (KS p = {ks_p:.3g}): noise of another shape, or per-layer scales."
        )
    return _result(
        Verdict.FAIL,
        hint + f" (KS p = {ks_p:.3g}, χ² p = {p_var:.3g} over {nz} coordinates)",
        **common,
    )
