"""Implementation-bug checks for DP-SGD, run on a black-box training step (framework-free).

Follows "Finding Private Bugs: Debugging Implementations of DP-SGD" (sections 3–4, appendices A,
B, C, E) and the batch-size sensitivity bug of Tramèr et al., "Debugging Differential Privacy"
(section 4). A correct DP-SGD step on a batch of B examples with per-example gradients g_b is

    θ' = θ − (η/D)·( Σ_b g_b·min(1, C/‖g_b‖) + N(0, (σC)² I) )                          (★)

with learning rate η, clip norm C, noise multiplier σ and normaliser D (the realised batch size B
in Algorithm 1 of the paper; a fixed expected batch size q·n in dpledger's adapters). The checks
drive the step from outside — through a :class:`StepHarness` that runs it from a fixed starting
model on a given batch with given C, σ and seed and returns the parameters and per-example losses
— and test four consequences of (★):

``clipping_applied`` (section 3.1, fig. 2)
    σ = 0, B = 1, one large-gradient point, a log-spaced grid of C. Below the gradient norm ‖g‖
    the update is η·C·g/‖g‖, so the one-step loss change Δ(C) = L(θ') − L(θ) depends on C
    (linearly, to first order); above ‖g‖ it is constant. A step that does not clip gives the same
    Δ for every C. The knee is the smallest grid C from which Δ stays within ``flat_rtol`` of
    its value at the largest C. Test: the least-squares slope of Δ against C over the grid points
    in the lower half of the transition below the knee (where Δ is linear in C even for Adam,
    whose update saturates before ‖g‖), t-test of slope = 0 (scipy.stats.linregress); fail when
    Δ varies by less than ``flat_rtol`` (relative) over the whole grid. The fitted line gives the
    gradient-norm estimate ‖g‖ ≈ (Δ(C_max) − intercept)/slope used by the next check.
``per_example_clipping`` (section 3.1 and appendix A, fig. 3)
    σ = 0, C ≪ ‖g‖/B_max, synthetic batches of zero-gradient fillers plus large-gradient points.
    The measured quantity is the large points' share of the update, u = ‖θ' − θ'_fill‖, the
    distance from the model a batch of fillers alone produces (θ for SGD; the state-driven step
    for momentum or Adam, whose warm-up state adds a C-independent offset to the loss change that
    would mask the effect). The paper's loss change of the large point is plotted alongside.
    (a) The paper's design: B − 1 fillers and one large point, a grid of B. Per-example clipping
    gives the update (η/B)·C·g/‖g‖, so u ∝ 1/B; clipping the batch mean gives η·C·g/‖g‖,
    independent of B. Test: slope of u against 1/B, t-test. This design needs D = B; with a fixed
    normaliser the correct update is also independent of B, so (a) is reported but not judged.
    (b) A count design that works for any D: B fixed, k copies of the large point, a grid of k.
    Per-example clipping gives (η/D)·k·C·g/‖g‖, so u ∝ k; clipping the mean (or the sum) gives
    the same update for every k. Test: slope of u against k, t-test. (b) also catches clipping of
    the *sum* followed by division by B, which (a) cannot tell from per-example clipping.
    Control: batches of B and B/2 fillers only must lead to the same model (zero-gradient
    fillers add nothing; hard cross-entropy labels leave a residual gradient and fail this).
    Flatness is judged by the effect size (``flat_rtol``), since the slope p-value of a curve
    that is constant up to round-off is meaningless.
``noise_calibrated`` (section 3.2, theorem 1, appendix B, fig. 4)
    C above every per-example gradient norm, found as in appendix B (σ = 0, a grid of C, the
    smallest C from which the update stops changing), then 10 values of C in [C*, 10·C*], several
    seeds per C, the mean pairwise parameter distance E‖θ₁ − θ₂‖ = (η/D)·√2·σC·E[χ_K] ∝ C.
    Test: slope of the mean distance against C, t-test, and the elasticity d log dist / d log C,
    which must lie in ``elasticity_range`` (1 for (★); 0 for noise N(0, σ²) that ignores C).
    Control: the same grid at σ = 0 must give (nearly) the same model for every C and seed.
    The elasticity must be known to a standard error ≤ ``elasticity_max_stderr`` (0.125, so the
    band edge 0.5 is four standard errors from both 0 and 1), else the check is inconclusive.
``noise_magnitude`` (appendix C; Tramèr et al. section 4)
    Plain SGD only. Two runs from the same start on the same batch differ by
    θ₁ − θ₂ = (η/D)·(n₁ − n₂) ~ N(0, 2(ησC/D)² I) in the unclipped regime, so the coordinates
    z = (θ₁ − θ₂)/(√2·σC·η/D) are i.i.d. N(0, 1). Test: Kolmogorov–Smirnov test of z against
    N(0, 1) and a two-sided χ² test of Σz² ~ χ²_N, each at α/2 (Bonferroni); also reported: the
    ratio of the observed to the expected noise scale with its confidence interval, and the
    expected-distance ratio of theorem 1. This catches noise that scales with C but is too small
    by a factor (the noise standard deviation σC/B of the backpropagation-clipping case study),
    which the slope test cannot see. η/D comes from the caller (``learning_rate`` and
    ``denominator``) or, if no learning rate is given, is estimated from a σ = 0 run on a batch
    with one clipped large-gradient point, ‖Δθ‖ = (η/D)·C: the ratio then measures the noise
    against one example's clipped contribution (the privacy-relevant ratio), so a clipping bug
    can also show here.

Adaptive optimisers (appendix E): the harness warms the optimiser state up before the measured
step (``torch_step.check_dp_optimizer``), the noise multiplier is chosen by a variant of the
appendix-B search (the largest σ for which the model moves in proportion to σ at the largest C of
the noise grid, so the distances stay out of Adam's saturation regime, appendix E), and the
magnitude test is skipped because Adam's update m/√v is not a scaled Gaussian.

Multiple testing. The clipping checks run at σ = 0, so a deterministic step gives deterministic
curves: their verdict rests on the effect size (``flat_rtol``) and the slope t-test (α =
``alpha_slope``) guards against a curve that varies without a trend. The calibration check fails a
correct step only if a slope whose t-statistic is in the hundreds looks insignificant, so its
false-alarm rate is negligible. The magnitude test rejects a correct step with probability
``alpha_magnitude`` (0.001 by default): that is the family-wise false-alarm rate of a run of all
four checks, measured in ``benchmarks/checks_false_alarms.py``.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import numpy as np
import scipy.stats

from dpledger.checks.report import CheckReport, CheckResult, Curve, Verdict
from dpledger.checks.synthetic_data import (
    ClippingPool,
    LabelKind,
    LossKind,
    cross_entropy_residual,
    make_clipping_pool,
    ordinary_batch,
)
from dpledger.errors import InvalidParameterError
from dpledger.validation import check_positive_finite, check_positive_int

__all__ = [
    "CHECK_NAMES",
    "CheckConfig",
    "DPSGDChecker",
    "SlopeTest",
    "StepHarness",
    "StepOutcome",
    "run_checks",
    "slope_test",
]

logger = logging.getLogger(__name__)

CHECK_NAMES: tuple[str, ...] = (
    "clipping_applied",
    "per_example_clipping",
    "noise_calibrated",
    "noise_magnitude",
)

_TITLES = {
    "clipping_applied": "per-example gradients are clipped to C",
    "per_example_clipping": "clipping happens per example, before aggregation",
    "noise_calibrated": "the noise scales with the clip norm C",
    "noise_magnitude": "the noise has standard deviation σ·C (times η/D) per coordinate",
}


# --------------------------------------------------------------------------- the harness protocol
@attrs.frozen
class StepOutcome:
    """What one run of the training step returns to the checks.

    Attributes:
        params_before: the starting model's trainable parameters, flattened (K,).
        params_after: the parameters after the step(s), flattened (K,).
        losses_before: per-example losses of the batch at the start (B,).
        losses_after: per-example losses of the batch after the step(s) (B,).

    Arrays may keep the dtype the model computes in (float32 tells the checks to expect
    float32 round-off); the checks compute in float64.
    """

    params_before: np.ndarray = attrs.field(converter=np.asarray)
    params_after: np.ndarray = attrs.field(converter=np.asarray)
    losses_before: np.ndarray = attrs.field(converter=np.asarray)
    losses_after: np.ndarray = attrs.field(converter=np.asarray)

    @property
    def machine_epsilon(self) -> float:
        """Machine epsilon of the parameters' dtype (the dtype the model is trained in)."""
        return _eps(self.params_after.dtype)

    @property
    def loss_epsilon(self) -> float:
        """Machine epsilon of the losses' dtype (a harness may evaluate losses in float64)."""
        return _eps(self.losses_after.dtype)


def _eps(dtype: Any) -> float:
    if np.issubdtype(dtype, np.floating):
        return float(np.finfo(dtype).eps)
    return float(np.finfo(np.float64).eps)


@runtime_checkable
class StepHarness(Protocol):
    """A DP training step the checks can drive as a black box.

    Every call of :meth:`run` must start from the same fixed starting model (and, for stateful
    optimisers, the same optimiser state, e.g. after a fixed warm-up) and must not change it.
    """

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Outputs (n, outputs) of the starting model for inputs x (n, *input_shape)."""
        ...

    def run(
        self,
        x: np.ndarray,
        y: np.ndarray,
        *,
        max_grad_norm: float,
        noise_multiplier: float,
        seed: int,
        num_steps: int = 1,
    ) -> StepOutcome:
        """Run ``num_steps`` DP steps on the whole batch (x, y) from the starting model.

        Args:
            x: inputs (B, *input_shape), float64 (cast to the model's dtype).
            y: targets: float (B, outputs) for MSE and soft cross-entropy, int64 (B,) for hard
                cross-entropy.
            max_grad_norm: the clip norm C.
            noise_multiplier: σ; the noise on the clipped sum has standard deviation σ·C.
            seed: seeds the step's noise; equal seeds must give equal noise.
            num_steps: steps to take on the same batch.
        """
        ...


# --------------------------------------------------------------------------------- statistics
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


# ------------------------------------------------------------------------------ configuration
def _positive_tuple(name: str, integer: bool = False):  # type: ignore[no-untyped-def]
    def convert(value: Any) -> tuple[Any, ...]:
        try:
            items = tuple(value)
        except TypeError:
            raise InvalidParameterError(name, value, "a sequence of positive numbers") from None
        if integer:
            out = tuple(check_positive_int(name, v) for v in items)
        else:
            out = tuple(check_positive_finite(name, v) for v in items)
        if len(set(out)) < 3:
            raise InvalidParameterError(name, value, "at least 3 distinct values")
        return tuple(sorted(set(out)))

    return convert


def _in_open_unit(name: str):  # type: ignore[no-untyped-def]
    def validate(_inst: Any, _attr: Any, value: Any) -> None:
        x = check_positive_finite(name, value)
        if x >= 1.0:
            raise InvalidParameterError(name, value, "a number in (0, 1)")

    return validate


def _positive(name: str):  # type: ignore[no-untyped-def]
    def validate(_inst: Any, _attr: Any, value: Any) -> None:
        check_positive_finite(name, value)

    return validate


def _positive_int(name: str):  # type: ignore[no-untyped-def]
    def validate(_inst: Any, _attr: Any, value: Any) -> None:
        check_positive_int(name, value)

    return validate


def _elasticity_range(value: Any) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise InvalidParameterError("elasticity_range", value, "a pair (low, high)") from None
    if not (0.0 < lo < 1.0 < hi and math.isfinite(hi)):
        raise InvalidParameterError("elasticity_range", value, "a pair with 0 < low < 1 < high")
    return (lo, hi)


@attrs.frozen(kw_only=True)
class CheckConfig:
    """Grids, sample sizes and thresholds of the checks. The defaults suit small models.

    Attributes:
        clip_norms: grid of C for ``clipping_applied`` and for the appendix-B search of an
            unclipped C (log-spaced, wide: 10⁻⁴ … 10⁴).
        batch_sizes: grid of B for design (a) of ``per_example_clipping``.
        large_counts: grid of k (copies of the large-gradient point) for design (b).
        count_batch_size: B of design (b); None means max(batch_sizes).
        per_example_margin: C of the per-example check is ‖g‖ / (margin · B_max), so that the
            large point and the batch mean are both clipped (appendix A: C ≪ ‖g‖/B).
        per_example_clip_norm: use this C instead of the one derived from ``clipping_applied``.
        large_target_scale: how far the large point's MSE target is from the prediction.
        noise_batch_size: B of the batch of ordinary points for the noise checks.
        noise_clip_norm_count: number of C values in [C*, span·C*] for ``noise_calibrated``.
        noise_clip_norm_span: the ratio of the largest to the smallest of them (10, appendix B).
        seeds_per_clip_norm: models trained per C (pairwise distances per C: n(n − 1)/2).
        noise_steps: steps per model in ``noise_calibrated`` (the magnitude test uses 1).
        magnitude_min_samples: fewest standardised coordinates the magnitude test pools.
        noise_multiplier_grid: σ values of the appendix-B search (adaptive optimisers).
        alpha_slope: significance level of the slope t-tests.
        alpha_magnitude: family-wise significance level of the magnitude test (KS and χ² at
            α/2 each).
        flat_rtol: a curve whose values all lie within this relative distance of each other
            counts as flat (no dependence).
        saturation_rtol: a C counts as unclipped when its σ = 0 update differs from the update at
            the largest C by at most this fraction.
        elasticity_range: accepted d log(distance) / d log C in ``noise_calibrated``.
        elasticity_max_stderr: largest standard error of the elasticity that still decides
            (0.125 puts both 0 and 1 four standard errors from the default band edge 0.5).
        control_tolerance: largest accepted σ = 0 distance (between C values or seeds) relative
            to the smallest mean noisy distance.
        filler_tolerance: largest accepted update of a fillers-only batch relative to the update
            with one large point.
    """

    clip_norms: tuple[float, ...] = attrs.field(
        default=tuple(float(c) for c in np.geomspace(1e-4, 1e4, 17)),
        converter=_positive_tuple("clip_norms"),
    )
    batch_sizes: tuple[int, ...] = attrs.field(
        default=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32),
        converter=_positive_tuple("batch_sizes", integer=True),
    )
    large_counts: tuple[int, ...] = attrs.field(
        default=(1, 2, 3, 4, 6, 8), converter=_positive_tuple("large_counts", integer=True)
    )
    count_batch_size: int | None = None
    per_example_margin: float = attrs.field(default=10.0, validator=_positive("per_example_margin"))
    per_example_clip_norm: float | None = None
    large_target_scale: float = attrs.field(default=10.0, validator=_positive("large_target_scale"))
    noise_batch_size: int = attrs.field(default=8, validator=_positive_int("noise_batch_size"))
    noise_clip_norm_count: int = attrs.field(
        default=10, validator=_positive_int("noise_clip_norm_count")
    )
    noise_clip_norm_span: float = attrs.field(
        default=10.0, validator=_positive("noise_clip_norm_span")
    )
    seeds_per_clip_norm: int = attrs.field(
        default=5, validator=_positive_int("seeds_per_clip_norm")
    )
    noise_steps: int = attrs.field(default=1, validator=_positive_int("noise_steps"))
    magnitude_min_samples: int = attrs.field(
        default=2000, validator=_positive_int("magnitude_min_samples")
    )
    noise_multiplier_grid: tuple[float, ...] = attrs.field(
        default=tuple(10.0**e for e in range(-8, 2)),
        converter=_positive_tuple("noise_multiplier_grid"),
    )
    alpha_slope: float = attrs.field(default=0.01, validator=_in_open_unit("alpha_slope"))
    alpha_magnitude: float = attrs.field(default=0.001, validator=_in_open_unit("alpha_magnitude"))
    flat_rtol: float = attrs.field(default=0.01, validator=_in_open_unit("flat_rtol"))
    saturation_rtol: float = attrs.field(default=1e-3, validator=_in_open_unit("saturation_rtol"))
    elasticity_range: tuple[float, float] = attrs.field(
        default=(0.5, 1.5), converter=_elasticity_range
    )
    elasticity_max_stderr: float = attrs.field(
        default=0.125, validator=_positive("elasticity_max_stderr")
    )
    control_tolerance: float = attrs.field(
        default=0.1, validator=_in_open_unit("control_tolerance")
    )
    filler_tolerance: float = attrs.field(default=0.05, validator=_in_open_unit("filler_tolerance"))

    def __attrs_post_init__(self) -> None:
        if self.count_batch_size is not None:
            b = check_positive_int("count_batch_size", self.count_batch_size)
            if b < max(self.large_counts):
                raise InvalidParameterError(
                    "count_batch_size", self.count_batch_size, "at least max(large_counts)"
                )
        elif max(self.batch_sizes) < max(self.large_counts):
            raise InvalidParameterError(
                "large_counts", self.large_counts, "values up to max(batch_sizes)"
            )
        if self.per_example_clip_norm is not None:
            check_positive_finite("per_example_clip_norm", self.per_example_clip_norm)
        if self.noise_clip_norm_count < 3:
            raise InvalidParameterError(
                "noise_clip_norm_count", self.noise_clip_norm_count, "an integer >= 3"
            )
        if self.noise_clip_norm_span <= 1.0:
            raise InvalidParameterError(
                "noise_clip_norm_span", self.noise_clip_norm_span, "a number > 1"
            )
        if self.seeds_per_clip_norm < 2:
            raise InvalidParameterError(
                "seeds_per_clip_norm", self.seeds_per_clip_norm, "an integer >= 2"
            )

    @property
    def counts_batch(self) -> int:
        """B of the count design (b)."""
        return self.count_batch_size or max(self.batch_sizes)

    def to_dict(self) -> dict[str, Any]:
        """The configuration as JSON-ready values."""
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in attrs.asdict(self).items()}


# --------------------------------------------------------------------------- curve analysis
def _trend(
    x: np.ndarray,
    y: np.ndarray,
    *,
    resolution: float,
    flat_rtol: float,
    alpha: float,
    grows: bool,
) -> tuple[str, SlopeTest | None, float]:
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


def _resolution(outcomes: Sequence[StepOutcome]) -> float:
    """Smallest loss change that is not round-off: 100 ulps of the largest loss involved."""
    eps = max(o.loss_epsilon for o in outcomes)
    scale = max(1.0, *(float(np.max(np.abs(np.asarray(o.losses_before, float)))) for o in outcomes))
    return 100.0 * eps * scale


def _distance(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64)))


def _fmt(x: float) -> str:
    return f"{x:.3g}"


# -------------------------------------------------------------------------------- the checker
class DPSGDChecker:
    """Runs the DP-SGD implementation-bug checks on a :class:`StepHarness`.

    The checks share experiments (the gradient-norm estimate of ``clipping_applied`` sets the C
    of ``per_example_clipping``; the unclipped C and the noisy runs are shared by the two noise
    checks), so one checker caches them; call the check methods in any order, or :meth:`run`.

    Args:
        harness: the training step to check.
        input_shape: shape of one model input.
        loss: ``"mse"`` or ``"cross_entropy"``: the loss the step minimises.
        labels: cross-entropy targets as ``"soft"`` probability vectors (zero-gradient fillers
            exist) or ``"hard"`` class indices (fillers keep a residual gradient).
        learning_rate: η of the step, for the expected noise scale of ``noise_magnitude``; None
            estimates η/D from a σ = 0 run instead.
        denominator: D, what the step divides the noisy clipped sum by: ``"batch"`` (the realised
            batch size B, Algorithm 1) or a fixed positive number (e.g. the expected batch size
            q·n).
        plain_sgd: True when the update is −(η/D)·(noisy clipped sum), with no optimiser state;
            False for momentum, Adam and other adaptive optimisers (the magnitude test is then
            skipped and σ is chosen by the appendix-B search).
        noise_multiplier: σ for the noise checks; None means 1.0 for plain SGD and the appendix-B
            search otherwise.
        seed: seeds the synthetic data and the noise seeds of every run.
        config: grids and thresholds.
    """

    def __init__(
        self,
        harness: StepHarness,
        *,
        input_shape: Sequence[int],
        loss: str | LossKind,
        labels: str | LabelKind = "soft",
        learning_rate: float | None = None,
        denominator: str | float = "batch",
        plain_sgd: bool = True,
        noise_multiplier: float | None = None,
        seed: int = 0,
        config: CheckConfig | None = None,
    ) -> None:
        if not (
            callable(getattr(harness, "predict", None)) and callable(getattr(harness, "run", None))
        ):
            raise InvalidParameterError(
                "harness", harness, "an object with predict(x) and run(x, y, ...) methods"
            )
        self._harness = harness
        try:
            self._input_shape = tuple(int(s) for s in input_shape)
        except (TypeError, ValueError):
            raise InvalidParameterError(
                "input_shape", input_shape, "a sequence of positive integers"
            ) from None
        if not self._input_shape or min(self._input_shape) < 1:
            raise InvalidParameterError("input_shape", input_shape, "positive integers")
        self._loss = LossKind.parse(loss)
        self._labels = LabelKind.parse(labels)
        self._lr = (
            None if learning_rate is None else check_positive_finite("learning_rate", learning_rate)
        )
        if isinstance(denominator, str):
            if denominator != "batch":
                raise InvalidParameterError("denominator", denominator, "'batch' or a number > 0")
            self._denominator: str | float = "batch"
        else:
            self._denominator = check_positive_finite("denominator", denominator)
        if not isinstance(plain_sgd, bool):
            raise InvalidParameterError("plain_sgd", plain_sgd, "True or False")
        self._plain_sgd = plain_sgd
        self._sigma_given = (
            None
            if noise_multiplier is None
            else check_positive_finite("noise_multiplier", noise_multiplier)
        )
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
            raise InvalidParameterError("seed", seed, "an integer >= 0")
        self._seed = int(seed)
        if config is None:
            config = CheckConfig()
        if not isinstance(config, CheckConfig):
            raise InvalidParameterError("config", config, "a CheckConfig")
        self._config = config
        if self._config.noise_batch_size > max((*config.batch_sizes, config.counts_batch)):
            raise InvalidParameterError(
                "config.noise_batch_size",
                config.noise_batch_size,
                "at most the largest batch of the clipping checks",
            )
        # caches
        self._pool: ClippingPool | None = None
        self._num_outputs: int | None = None
        self._results: dict[str, CheckResult] = {}
        self._gradient_norm: float | None = None
        self._noise_batch: tuple[np.ndarray, np.ndarray] | None = None
        self._unclipped: dict[str, Any] | None = None
        self._sigma: dict[str, Any] | None = None
        self._noisy: dict[tuple[float, float, int], list[np.ndarray]] = {}
        self._params0: np.ndarray = np.zeros(0)
        self._eps = float(np.finfo(np.float64).eps)
        self._seed_counter = 0
        self.steps_run = 0

    # ------------------------------------------------------------------ plumbing
    @property
    def config(self) -> CheckConfig:
        """The grids and thresholds in use."""
        return self._config

    def _next_seed(self) -> int:
        self._seed_counter += 1
        state = np.random.SeedSequence([self._seed, 7, self._seed_counter]).generate_state(
            1, np.uint64
        )
        return int(state[0] & np.uint64(2**62 - 1))

    def _rng(self, tag: int) -> np.random.Generator:
        return np.random.default_rng([self._seed, tag])

    def _predict(self, x: np.ndarray) -> np.ndarray:
        out = np.asarray(self._harness.predict(x))
        if out.ndim == 1:
            out = out.reshape(-1, 1)
        if out.ndim != 2 or out.shape[0] != x.shape[0]:
            raise InvalidParameterError(
                "harness.predict", f"output of shape {out.shape}", f"shape ({x.shape[0]}, outputs)"
            )
        return out

    @property
    def num_outputs(self) -> int:
        """Output dimension of the model (number of classes for cross-entropy)."""
        if self._num_outputs is None:
            x = self._rng(1).standard_normal((1, *self._input_shape))
            self._num_outputs = int(self._predict(x).shape[1])
        return self._num_outputs

    @property
    def pool(self) -> ClippingPool:
        """The fixed synthetic points of the clipping checks."""
        if self._pool is None:
            cfg = self._config
            largest = max(max(cfg.batch_sizes), cfg.counts_batch, cfg.noise_batch_size)
            self._pool = make_clipping_pool(
                self._predict,
                input_shape=self._input_shape,
                loss=self._loss,
                labels=self._labels,
                max_fillers=largest,
                scale=cfg.large_target_scale,
                rng=self._rng(2),
            )
        return self._pool

    def _run(
        self,
        x: np.ndarray,
        y: np.ndarray,
        *,
        clip: float,
        sigma: float,
        seed: int | None = None,
        steps: int = 1,
    ) -> StepOutcome:
        out = self._harness.run(
            x,
            y,
            max_grad_norm=float(clip),
            noise_multiplier=float(sigma),
            seed=self._next_seed() if seed is None else seed,
            num_steps=steps,
        )
        self.steps_run += steps
        if not isinstance(out, StepOutcome):
            raise InvalidParameterError("harness.run", type(out).__name__, "a StepOutcome")
        b = x.shape[0]
        for name in ("losses_before", "losses_after"):
            arr = getattr(out, name)
            if arr.shape != (b,):
                raise InvalidParameterError(
                    f"StepOutcome.{name}", f"shape {arr.shape}", f"shape ({b},)"
                )
        if out.params_after.shape != out.params_before.shape or out.params_after.ndim != 1:
            raise InvalidParameterError(
                "StepOutcome.params_after",
                f"shape {out.params_after.shape}",
                "a flat vector shaped like params_before",
            )
        return out

    def _result(self, name: str, verdict: Verdict, reason: str, **kw: Any) -> CheckResult:
        result = CheckResult(name=name, title=_TITLES[name], verdict=verdict, reason=reason, **kw)
        self._results[name] = result
        logger.info("check %s: %s", name, verdict.value)
        return result

    # ------------------------------------------------------------- clipping applied
    def clipping_applied(self) -> CheckResult:
        """σ = 0, B = 1, a grid of C: the one-step loss change must depend on C below ‖g‖."""
        if "clipping_applied" in self._results:
            return self._results["clipping_applied"]
        cfg = self._config
        x, y = self.pool.batch(1, num_large=1)
        clips = np.asarray(cfg.clip_norms)
        seed = self._next_seed()
        outs = [self._run(x, y, clip=c, sigma=0.0, seed=seed) for c in clips]
        delta = np.array([float(o.losses_after[0]) - float(o.losses_before[0]) for o in outs])
        disp = np.array([_distance(o.params_after, o.params_before) for o in outs])
        resolution = _resolution(outs)
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
        name = "clipping_applied"
        stat_name = "slope of loss change vs C below the gradient norm"
        ref = float(delta[-1])
        if not np.all(np.isfinite(delta)):
            return self._result(
                name,
                Verdict.INCONCLUSIVE,
                "The step produced a non-finite loss for some C; lower the learning rate.",
                curves=curves,
                details=details,
            )
        if abs(ref) <= resolution:
            return self._result(
                name,
                Verdict.INCONCLUSIVE,
                f"At the largest C the step changes the loss by {_fmt(ref)}, below the numerical "
                f"resolution {_fmt(resolution)}: raise the learning rate.",
                curves=curves,
                details=details,
            )
        tol = max(cfg.flat_rtol * abs(ref), resolution)
        saturated = np.abs(delta - ref) <= tol
        knee = len(clips)
        while knee > 0 and saturated[knee - 1]:
            knee -= 1
        details["relative_variation"] = float(np.max(np.abs(delta - ref)) / abs(ref))
        if knee == 0:
            return self._result(
                name,
                Verdict.FAIL,
                f"The one-step loss change is the same (within {cfg.flat_rtol:.0%}) for every C "
                f"in [{_fmt(clips[0])}, {_fmt(clips[-1])}]: the step ignores C, i.e. gradients "
                "are not clipped (unless the example's gradient norm is below "
                f"{_fmt(clips[0])}; then extend clip_norms downwards).",
                statistic_name="relative variation of the loss change over C",
                statistic=details["relative_variation"],
                curves=curves,
                details=details,
            )
        details["clip_norm_knee"] = float(clips[knee])
        if knee < 3:
            return self._result(
                name,
                Verdict.INCONCLUSIVE,
                f"The loss change depends on C, but only {knee} grid value(s) lie below the "
                f"knee at C ≈ {_fmt(clips[knee])}; extend clip_norms downwards to test the "
                "slope.",
                curves=curves,
                details=details,
            )
        # fit the lower half of the transition, where the update is linear in C even for
        # optimisers that saturate before ‖g‖ (Adam's m/√v)
        progress = np.abs(delta[:knee] - delta[0]) / abs(ref - delta[0])
        lower = max(3, int(np.sum(progress <= 0.5)))
        test = slope_test(clips[:lower], delta[:lower])
        details.update(
            slope=test.slope,
            t_statistic=test.t_statistic,
            points_below_knee=knee,
            points_fitted=lower,
        )
        if test.p_value < cfg.alpha_slope and test.slope != 0:
            g = (ref - test.intercept) / test.slope
            lo, hi = float(clips[knee - 1]), float(clips[knee])
            g = float(min(max(g, lo), hi)) if math.isfinite(g) and g > 0 else hi
            self._gradient_norm = g
            details["gradient_norm_estimate"] = g
            return self._result(
                name,
                Verdict.PASS,
                f"The loss change depends on C below C ≈ {_fmt(g)} (the estimated gradient norm "
                f"of the large-gradient point) and is constant above it, as clipping to C "
                "predicts.",
                statistic_name=stat_name,
                statistic=test.slope,
                p_value=test.p_value,
                alpha=cfg.alpha_slope,
                curves=curves,
                details=details,
            )
        return self._result(
            name,
            Verdict.INCONCLUSIVE,
            "The loss change varies with C but has no significant linear trend below the knee "
            f"(p = {test.p_value:.3g}); the step may be nonlinear in the update (lower the "
            "learning rate) or random at σ = 0.",
            statistic_name=stat_name,
            statistic=test.slope,
            p_value=test.p_value,
            alpha=cfg.alpha_slope,
            curves=curves,
            details=details,
        )

    def gradient_norm_estimate(self) -> float | None:
        """‖g‖ of the large-gradient point, from the knee of ``clipping_applied`` (or None)."""
        self.clipping_applied()
        return self._gradient_norm

    # --------------------------------------------------------- per-example clipping
    def per_example_clipping(self) -> CheckResult:
        """σ = 0, tiny C, fillers plus large-gradient points: the update must scale with 1/B (a)
        and with the number k of large points (b)."""
        if "per_example_clipping" in self._results:
            return self._results["per_example_clipping"]
        cfg = self._config
        name = "per_example_clipping"
        pool = self.pool
        bmax = max(max(cfg.batch_sizes), cfg.counts_batch)
        notes: list[str] = []
        g = None
        if cfg.per_example_clip_norm is not None:
            clip = cfg.per_example_clip_norm
        else:
            g = self.gradient_norm_estimate()
            if g is None:
                clip = cfg.clip_norms[0] / (cfg.per_example_margin * bmax)
                notes.append(
                    "The large point's gradient norm is unknown (clipping_applied did not pass), "
                    f"so C = {_fmt(clip)} may not clip it."
                )
            else:
                clip = g / (cfg.per_example_margin * bmax)
        details: dict[str, Any] = {"clip_norm": clip, "denominator": self._denominator}
        seed = self._next_seed()
        kb = cfg.counts_batch
        # control: fillers only at two batch sizes; with zero-gradient fillers both updates are
        # the same (no move for SGD, the state-driven move for momentum/Adam)
        fx, fy = pool.batch(kb, num_large=0)
        fill = self._run(fx, fy, clip=clip, sigma=0.0, seed=seed)
        hx, hy = pool.batch(max(kb // 2, 1), num_large=0)
        half = self._run(hx, hy, clip=clip, sigma=0.0, seed=seed)
        # (b) the count design
        counts = np.asarray(cfg.large_counts, dtype=float)
        outs_b = []
        for k in cfg.large_counts:
            bx, by = pool.batch(kb, num_large=k)
            outs_b.append(self._run(bx, by, clip=clip, sigma=0.0, seed=seed))
        one_large = _distance(outs_b[0].params_after, fill.params_after)
        filler_ratio = (
            _distance(fill.params_after, half.params_after) / one_large
            if one_large > 0
            else math.inf
        )
        details["filler_update_ratio"] = filler_ratio
        # (a) the paper's batch-size design
        sizes = np.asarray(cfg.batch_sizes, dtype=float)
        outs_a = []
        for b in cfg.batch_sizes:
            ax, ay = pool.batch(b, num_large=1)
            outs_a.append(self._run(ax, ay, clip=clip, sigma=0.0, seed=seed))
        delta_a = np.array([float(o.losses_after[-1] - o.losses_before[-1]) for o in outs_a])
        # the large points' share of the update: the displacement from the fillers-only model
        # (θ₀ for SGD; the state-driven step for momentum/Adam, identical for any batch of
        # zero-gradient fillers, as the control above verifies)
        disp_a = np.array([_distance(o.params_after, fill.params_after) for o in outs_a])
        disp_b = np.array([_distance(o.params_after, fill.params_after) for o in outs_b])
        res = (
            10.0
            * fill.machine_epsilon
            * float(np.linalg.norm(np.asarray(fill.params_after, np.float64)))
        )
        state_a, test_a, change_a = _trend(
            1.0 / sizes[::-1],
            disp_a[::-1],
            resolution=res,
            flat_rtol=cfg.flat_rtol,
            alpha=cfg.alpha_slope,
            grows=True,
        )
        state_b, test_b, change_b = _trend(
            counts,
            disp_b,
            resolution=res,
            flat_rtol=cfg.flat_rtol,
            alpha=cfg.alpha_slope,
            grows=True,
        )
        judge_a = self._denominator == "batch"
        details.update(
            batch_design={
                "state": state_a,
                "judged": judge_a,
                "relative_change": change_a,
                "slope_vs_inverse_batch_size": None if test_a is None else test_a.slope,
                "p_value": None if test_a is None else test_a.p_value,
            },
            count_design={
                "state": state_b,
                "batch_size": kb,
                "relative_change": change_b,
                "slope_vs_count": None if test_b is None else test_b.slope,
                "p_value": None if test_b is None else test_b.p_value,
            },
        )
        curves = (
            Curve(
                "one large point + (B − 1) zero-gradient points",
                sizes,
                disp_a,
                "batch size B",
                "update due to the large point",
                panel="batch size",
            ),
            Curve(
                f"k large points + ({kb} − k) zero-gradient points",
                counts,
                disp_b,
                "number k of large-gradient points",
                "update due to the large points",
                panel="count",
            ),
            Curve(
                "one large point + (B − 1) zero-gradient points",
                sizes,
                delta_a,
                "batch size B",
                "loss change of the large point",
                panel="loss change",
            ),
        )
        common = {"curves": curves, "details": details, "alpha": cfg.alpha_slope}

        def stat(test: SlopeTest | None, label: str) -> dict[str, Any]:
            if test is None:
                return {}
            return {"statistic_name": label, "statistic": test.slope, "p_value": test.p_value}

        stat_a = stat(test_a, "slope of the update vs 1/B (design a)")
        stat_b = stat(test_b, "slope of the update vs k (design b)")
        # a flat curve is judged by its effect size; its slope p-value only reflects round-off
        flat_b = {
            "statistic_name": "largest relative change of the update over k (design b)",
            "statistic": change_b,
        }
        if self._loss is LossKind.CROSS_ENTROPY and self._labels is LabelKind.HARD:
            resid = cross_entropy_residual(self._predict(pool.filler_x), pool.filler_y)
            details["filler_residual_logit_gradient_mean"] = float(resid.mean())
        if state_b == "flat":
            return self._result(
                name,
                Verdict.FAIL,
                f"k copies of the large-gradient point move the model as much as one (the "
                f"update varies by {change_b:.2%} for k = {int(counts[0])}…{int(counts[-1])} at "
                f"B = {kb}, C = {_fmt(clip)}; flat means within {cfg.flat_rtol:.0%}): the step "
                "clips an aggregate (the batch mean or sum), not each example."
                + (
                    f" The batch-size design agrees: the update does not shrink with B (change "
                    f"{change_a:.2%})."
                    if judge_a and state_a == "flat"
                    else ""
                ),
                **flat_b,
                **{**common, "alpha": math.nan},
            )
        if filler_ratio > cfg.filler_tolerance:
            why = (
                " Hard cross-entropy labels cannot zero the gradient (residual softmax − one-hot);"
                " use labels='soft' if the step accepts probability targets."
                if self._labels is LabelKind.HARD
                else " The step may have randomness at σ = 0 or the model output may not be a "
                "deterministic function of the input."
            )
            return self._result(
                name,
                Verdict.INCONCLUSIVE,
                f"Batches of {kb} and {max(kb // 2, 1)} zero-gradient fillers lead to models "
                f"{filler_ratio:.1%} as far apart as one large-gradient point moves the model "
                f"(tolerance {cfg.filler_tolerance:.0%}), so the fillers are not gradient-free "
                "and the synthetic batch does not isolate the large point." + why,
                **stat_b,
                **common,
            )
        if judge_a and state_a == "flat" and state_b == "ok":
            return self._result(
                name,
                Verdict.INCONCLUSIVE,
                "Clipping looks per-example (the update grows with the number of large points), "
                "but the update does not shrink with the batch size although the step was "
                "declared to divide by the realised batch size (denominator='batch'). If the step "
                "divides by a fixed number, pass it as denominator.",
                statistic_name="largest relative change of the update over B (design a)",
                statistic=change_a,
                **{**common, "alpha": math.nan},
            )
        ok_a = (not judge_a) or state_a == "ok"
        if state_b == "ok" and ok_a:
            if g is None and cfg.per_example_clip_norm is None:
                return self._result(
                    name,
                    Verdict.INCONCLUSIVE,
                    "The update scales as per-example clipping predicts, but "
                    + notes[0]
                    + " Set CheckConfig.per_example_clip_norm well below ‖g‖/B_max to decide.",
                    **(stat_a if judge_a else stat_b),
                    **common,
                )
            tail = (
                f"the update shrinks like 1/B over B = {int(sizes[0])}…{int(sizes[-1])} and "
                if judge_a
                else "the update "
            )
            return self._result(
                name,
                Verdict.PASS,
                f"With C = {_fmt(clip)} (≪ ‖g‖/B), {tail}grows with the number of "
                "large-gradient points, as clipping each example before aggregation predicts.",
                **(stat_a if judge_a else stat_b),
                **common,
            )
        states = f"batch-size design: {state_a}; count design: {state_b}"
        return self._result(
            name,
            Verdict.INCONCLUSIVE,
            f"The curves do not show a clear pattern ({states}). 'unresolved' means the update is "
            "below the numerical resolution (raise the learning rate); 'noisy' means no "
            "significant trend; 'unexpected' means the update changes in the wrong direction.",
            **(stat_a if judge_a else stat_b),
            **common,
        )

    # ------------------------------------------------------------ shared noise stages
    def _noise_data(self) -> tuple[np.ndarray, np.ndarray]:
        if self._noise_batch is None:
            self._noise_batch = ordinary_batch(
                input_shape=self._input_shape,
                num_outputs=self.num_outputs,
                batch_size=self._config.noise_batch_size,
                loss=self._loss,
                labels=self._labels,
                rng=self._rng(3),
            )
        return self._noise_batch

    def unclipped_clip_norm(self) -> dict[str, Any]:
        """Appendix B: the smallest grid C from which the σ = 0 update stops changing.

        Returns a dict with ``clip_norm`` (C*, or None when none was found), ``reason``, and the
        ``curve`` (C, loss change, distance to the update at the largest C).
        """
        if self._unclipped is not None:
            return self._unclipped
        cfg = self._config
        x, y = self._noise_data()
        clips = np.asarray(cfg.clip_norms)
        seed = self._next_seed()
        outs = [self._run(x, y, clip=c, sigma=0.0, seed=seed, steps=cfg.noise_steps) for c in clips]
        ref = outs[-1]
        move = _distance(ref.params_after, ref.params_before)
        eps = ref.machine_epsilon
        tol = max(
            cfg.saturation_rtol * move,
            100 * eps * float(np.linalg.norm(np.asarray(ref.params_before, float))),
        )
        gaps = np.array([_distance(o.params_after, ref.params_after) for o in outs])
        delta = np.array([float(np.mean(o.losses_after) - np.mean(o.losses_before)) for o in outs])
        curve = Curve(
            "σ = 0 (appendix B search)",
            clips,
            delta,
            "clip norm C",
            "loss change",
            log_x=True,
            panel="unclipped C search",
        )
        knee = len(clips)
        while knee > 0 and gaps[knee - 1] <= tol:
            knee -= 1
        info: dict[str, Any] = {"curve": curve, "gaps": gaps, "movement": move}
        if move == 0 or not math.isfinite(move):
            info.update(clip_norm=None, reason="the step does not move the model at σ = 0")
        elif knee >= len(clips) - 1:
            info.update(
                clip_norm=None,
                reason=(
                    "the σ = 0 update still changes between the two largest C values "
                    f"({_fmt(clips[-2])}, {_fmt(clips[-1])}): no unclipped C in the grid"
                ),
            )
        else:
            info.update(clip_norm=float(clips[knee]), reason="")
        self._unclipped = info
        return info

    def noise_multiplier(self) -> dict[str, Any]:
        """σ for the noise checks: given, 1.0 for plain SGD, or the appendix-B search."""
        if self._sigma is not None:
            return self._sigma
        if self._sigma_given is not None:
            self._sigma = {"sigma": self._sigma_given, "source": "given"}
        elif self._plain_sgd:
            self._sigma = {"sigma": 1.0, "source": "default for plain SGD"}
        else:
            self._sigma = self._search_sigma()
        return self._sigma

    def _search_sigma(self) -> dict[str, Any]:
        """Appendix B's σ search, judged by linearity rather than by the loss change.

        At the largest C of the noise grid, one seed, each σ of ``noise_multiplier_grid``: the
        distance r(σ) = ‖θ_σ − θ_0‖ from the σ = 0 model. While the noise is small against the
        optimiser's state, r grows like σ; Adam's normalisation makes it saturate beyond that
        (appendix E). The chosen σ is the largest one up to which r(σ) stays proportional to σ
        (local elasticity within 10 % of 1), starting from the smallest σ whose effect is above
        round-off; over C ∈ [C*, span·C*] the noise then stays in the proportional regime.
        """
        cfg = self._config
        star = self.unclipped_clip_norm()["clip_norm"]
        if star is None:
            return {"sigma": None, "source": "appendix-B search needs an unclipped C"}
        top = float(self._noise_grid(star)[-1])
        x, y = self._noise_data()
        seed = self._next_seed()
        base = self._run(x, y, clip=top, sigma=0.0, seed=seed, steps=cfg.noise_steps)
        sig = np.asarray(cfg.noise_multiplier_grid)
        r = np.array(
            [
                _distance(
                    self._run(
                        x, y, clip=top, sigma=s, seed=seed, steps=cfg.noise_steps
                    ).params_after,
                    base.params_after,
                )
                for s in sig
            ]
        )
        floor = (
            1e4
            * base.machine_epsilon
            * max(float(np.linalg.norm(np.asarray(base.params_after, float))), 1e-300)
        )
        visible = np.flatnonzero(r > floor)
        info: dict[str, Any] = {"grid": sig.tolist(), "distances": r.tolist(), "clip_norm": top}
        if visible.size == 0:
            info.update(sigma=None, source="appendix-B search: no σ in the grid moves the model")
            return info
        i = int(visible[0])
        while i + 1 < len(sig) and r[i + 1] > floor:
            local = math.log(r[i + 1] / r[i]) / math.log(sig[i + 1] / sig[i])
            if abs(local - 1.0) > 0.1:
                break
            i += 1
        if i == int(visible[0]):
            info.update(
                sigma=None,
                source="appendix-B search: the model distance is not proportional to σ anywhere",
            )
            return info
        info.update(
            sigma=float(sig[i]),
            source="appendix-B search (largest σ with distance ∝ σ at the largest C)",
        )
        return info

    def _noise_grid(self, star: float) -> np.ndarray:
        cfg = self._config
        return np.linspace(star, cfg.noise_clip_norm_span * star, cfg.noise_clip_norm_count)

    def _noisy_params(self, clip: float, sigma: float, count: int, steps: int) -> list[np.ndarray]:
        key = (float(clip), float(sigma), steps)
        runs = self._noisy.setdefault(key, [])
        x, y = self._noise_data()
        while len(runs) < count:
            o = self._run(x, y, clip=clip, sigma=sigma, steps=steps)
            runs.append(np.asarray(o.params_after, dtype=np.float64))
            self._params0 = np.asarray(o.params_before, dtype=np.float64)
            self._eps = o.machine_epsilon
        return runs[:count]

    # -------------------------------------------------------------- noise calibrated
    def noise_calibrated(self) -> CheckResult:
        """Unclipped C grid, several seeds per C: the pairwise distance must grow like C."""
        if "noise_calibrated" in self._results:
            return self._results["noise_calibrated"]
        cfg = self._config
        name = "noise_calibrated"
        search = self.unclipped_clip_norm()
        star = search["clip_norm"]
        curves: list[Curve] = [search["curve"]]
        if star is None:
            return self._result(
                name,
                Verdict.INCONCLUSIVE,
                f"No unclipped C was found ({search['reason']}); extend clip_norms upwards.",
                curves=curves,
            )
        sig = self.noise_multiplier()
        sigma = sig["sigma"]
        if sigma is None:
            return self._result(
                name,
                Verdict.INCONCLUSIVE,
                f"No noise multiplier could be chosen ({sig['source']}); pass noise_multiplier.",
                curves=curves,
            )
        grid = self._noise_grid(star)
        n = cfg.seeds_per_clip_norm
        steps = cfg.noise_steps
        pair_x, pair_d, means = [], [], []
        for c in grid:
            params = self._noisy_params(c, sigma, n, steps)
            ds = [_distance(params[i], params[j]) for i in range(n) for j in range(i + 1, n)]
            pair_x.extend([c] * len(ds))
            pair_d.extend(ds)
            means.append(float(np.mean(ds)))
        means_a = np.asarray(means)
        # σ = 0 control: one seed per C, plus a second seed at the smallest C
        x, y = self._noise_data()
        ctrl_seed = self._next_seed()
        ctrl = [
            self._run(x, y, clip=c, sigma=0.0, seed=ctrl_seed, steps=steps).params_after
            for c in grid
        ]
        other = self._run(x, y, clip=grid[0], sigma=0.0, steps=steps).params_after
        ctrl_d = np.array([_distance(p, ctrl[0]) for p in ctrl])
        seed_d = _distance(other, ctrl[0])
        curves += [
            Curve(
                f"σ = {sigma:g}: model pairs",
                pair_x,
                pair_d,
                "clip norm C",
                "pairwise parameter distance",
                style="points",
                panel="distance",
            ),
            Curve(
                f"σ = {sigma:g}: mean",
                grid,
                means_a,
                "clip norm C",
                "pairwise parameter distance",
                panel="distance",
            ),
            Curve(
                "σ = 0 control",
                grid,
                ctrl_d,
                "clip norm C",
                "pairwise parameter distance",
                panel="distance",
            ),
        ]
        details: dict[str, Any] = {
            "unclipped_clip_norm": star,
            "clip_norms": grid.tolist(),
            "noise_multiplier": sigma,
            "noise_multiplier_source": sig["source"],
            "seeds_per_clip_norm": n,
            "mean_distances": means_a.tolist(),
            "control_max_distance_between_clip_norms": float(ctrl_d.max()),
            "control_distance_between_seeds": seed_d,
        }
        stat_name = "slope of mean pairwise distance vs C"
        if np.all(means_a == 0):
            return self._result(
                name,
                Verdict.FAIL,
                f"Models trained with different seeds at σ = {sigma:g} are identical: the step "
                "adds no noise, or ignores the seed/generator it is given.",
                curves=curves,
                details=details,
            )
        smallest = float(means_a.min())
        control = max(float(ctrl_d.max()), seed_d) / smallest if smallest > 0 else math.inf
        details["control_ratio"] = control
        ctrl_test = slope_test(grid, ctrl_d)
        details["control_slope_p_value"] = ctrl_test.p_value
        if control > cfg.control_tolerance:
            return self._result(
                name,
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
        lo, hi = cfg.elasticity_range
        if not el_se <= cfg.elasticity_max_stderr:
            return self._result(
                name,
                Verdict.INCONCLUSIVE,
                f"The elasticity d log dist / d log C = {elasticity:.3f} is too imprecise "
                f"(standard error {el_se:.3g} > {cfg.elasticity_max_stderr:g}) to tell 1 "
                f"from 0: raise seeds_per_clip_norm (few parameters, here "
                f"{self._params0.size}, or an adaptive optimiser make the distances noisy).",
                statistic_name=stat_name,
                statistic=test.slope,
                p_value=test.p_value,
                alpha=cfg.alpha_slope,
                curves=curves,
                details=details,
            )
        common = {
            "statistic_name": stat_name,
            "statistic": test.slope,
            "p_value": test.p_value,
            "alpha": cfg.alpha_slope,
            "curves": curves,
            "details": details,
        }
        span = f"C ∈ [{_fmt(grid[0])}, {_fmt(grid[-1])}]"
        if test.p_value < cfg.alpha_slope and test.slope > 0 and lo <= elasticity <= hi:
            return self._result(
                name,
                Verdict.PASS,
                f"Over {span} (nothing clipped) the pairwise distance grows with C "
                f"(elasticity d log dist / d log C = {elasticity:.3f}; 1 expected), so the noise "
                "is calibrated to C. The σ = 0 control is flat.",
                **common,
            )
        if test.p_value >= cfg.alpha_slope or test.slope <= 0:
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
        return self._result(name, Verdict.FAIL, why, **common)

    # -------------------------------------------------------------- noise magnitude
    def update_scale(self, batch_size: int) -> dict[str, Any]:
        """η/D for a batch of ``batch_size``: from the caller, or estimated at σ = 0.

        The estimate runs one large-gradient point among fillers with C = ‖g‖/(margin·B): a
        correct step moves the parameters by exactly (η/D)·C.
        """
        if self._lr is not None:
            denom = batch_size if self._denominator == "batch" else self._denominator
            return {"scale": self._lr / float(denom), "source": "learning_rate / denominator"}
        g = self.gradient_norm_estimate()
        cfg = self._config
        if g is None:
            return {"scale": None, "source": "estimate needs the gradient norm (clipping check)"}
        clip = g / (cfg.per_example_margin * batch_size)
        x, y = self.pool.batch(batch_size, num_large=1)
        o = self._run(x, y, clip=clip, sigma=0.0)
        return {
            "scale": _distance(o.params_after, o.params_before) / clip,
            "source": "estimated from a σ = 0 run with one clipped point (‖Δθ‖ / C)",
        }

    def noise_magnitude(self) -> CheckResult:
        """Plain SGD: (θ₁ − θ₂)/(√2·σC·η/D) must be i.i.d. N(0, 1) (KS and χ² tests)."""
        if "noise_magnitude" in self._results:
            return self._results["noise_magnitude"]
        cfg = self._config
        name = "noise_magnitude"
        if not self._plain_sgd:
            return self._result(
                name,
                Verdict.SKIPPED,
                "The optimiser transforms the noisy gradient (momentum, Adam's m/√v), so the "
                "difference of two runs is not (η/D)·N(0, 2(σC)² I); the scale test of appendix C "
                "applies to plain SGD only. The noise_calibrated check still applies.",
            )
        search = self.unclipped_clip_norm()
        star = search["clip_norm"]
        if star is None:
            return self._result(
                name,
                Verdict.INCONCLUSIVE,
                f"No unclipped C was found ({search['reason']}); extend clip_norms upwards.",
            )
        sigma = self.noise_multiplier()["sigma"]
        bsz = cfg.noise_batch_size
        scale_info = self.update_scale(bsz)
        scale = scale_info["scale"]
        if scale is None or not scale > 0:
            return self._result(
                name,
                Verdict.INCONCLUSIVE,
                f"η/D could not be determined ({scale_info['source']}); pass learning_rate.",
            )
        grid = self._noise_grid(star)
        n = cfg.seeds_per_clip_norm
        k = int(self._noisy_params(grid[0], sigma, 2, 1)[0].size)
        pairs_needed = max(1, math.ceil(cfg.magnitude_min_samples / k))
        per_c = max(n // 2 if cfg.noise_steps == 1 else 1, math.ceil(pairs_needed / len(grid)))
        z_parts, dist_ratio = [], []
        chi_mean = float(scipy.stats.chi(k).mean())
        for c in grid:
            params = self._noisy_params(c, sigma, 2 * per_c, 1)
            s = math.sqrt(2.0) * sigma * c * scale
            for i in range(per_c):
                diff = params[2 * i] - params[2 * i + 1]
                z_parts.append(diff / s)
                dist_ratio.append(float(np.linalg.norm(diff)) / (s * chi_mean))
        z = np.concatenate(z_parts)
        nz = int(z.size)
        expected_std = sigma * float(grid[0]) * scale
        floor = 100.0 * self._eps * float(np.max(np.abs(self._params0))) if nz else 0.0
        a = cfg.alpha_magnitude
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
        mean_dr = float(np.mean(dist_ratio))
        rel_sd = math.sqrt(max(k - chi_mean**2, 0.0)) / chi_mean
        half = scipy.stats.norm.ppf(1 - a / 2) * mean_dr * rel_sd / math.sqrt(len(dist_ratio))
        order = np.sort(z)
        shown = order[np.linspace(0, nz - 1, min(nz, 400)).astype(int)]
        ecdf = (np.searchsorted(order, shown, side="right")) / nz
        grid_z = np.linspace(min(-4.0, float(order[0])), max(4.0, float(order[-1])), 200)
        curves = (
            Curve("standardised coordinates", shown, ecdf, "z = Δθ / (√2·σC·η/D)", "CDF"),
            Curve("N(0, 1)", grid_z, scipy.stats.norm.cdf(grid_z), "z", "CDF"),
        )
        details = {
            "clip_norms": grid.tolist(),
            "noise_multiplier": sigma,
            "batch_size": bsz,
            "update_scale": scale,
            "update_scale_source": scale_info["source"],
            "samples": nz,
            "pairs": len(z_parts),
            "ks_statistic": float(ks.statistic),
            "ks_p_value": float(ks.pvalue),
            "chi2_p_value": p_var,
            "scale_ratio": ratio,
            "scale_ratio_ci": list(ci),
            "expected_distance_ratio": mean_dr,
            "expected_distance_ratio_ci": [mean_dr - half, mean_dr + half],
            "expected_noise_std": expected_std,
        }
        common = {
            "statistic_name": "observed / expected noise scale",
            "statistic": ratio,
            "p_value": p,
            "alpha": a,
            "curves": curves,
            "details": details,
        }
        if expected_std <= floor:
            return self._result(
                name,
                Verdict.INCONCLUSIVE,
                f"The expected noise per coordinate ({_fmt(expected_std)}) is below the float "
                f"round-off of the parameters ({_fmt(floor)}); raise the learning rate or σ.",
                **common,
            )
        ci_text = f"[{ci[0]:.3f}, {ci[1]:.3f}]"
        if ratio == 0:
            return self._result(
                name,
                Verdict.FAIL,
                "Two runs with different seeds end at the same parameters: no noise is added.",
                **common,
            )
        if p >= a:
            return self._result(
                name,
                Verdict.PASS,
                f"The difference of two runs is N(0, 2(σC·η/D)²) per coordinate: observed/"
                f"expected scale {ratio:.4f}, {1 - a:.1%} CI {ci_text}; KS p = "
                f"{ks.pvalue:.3g}, χ² p = {p_var:.3g} over {nz} coordinates.",
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
                f"scale (KS p = {ks.pvalue:.3g}): noise of another shape, or per-layer scales."
            )
        return self._result(
            name,
            Verdict.FAIL,
            hint + f" (KS p = {ks.pvalue:.3g}, χ² p = {p_var:.3g} over {nz} coordinates)",
            **common,
        )

    # -------------------------------------------------------------------- run
    def run(self, checks: Sequence[str] = CHECK_NAMES) -> CheckReport:
        """Run the named checks (default: all four) and return the report."""
        if isinstance(checks, str):
            checks = (checks,)
        unknown = [c for c in checks if c not in CHECK_NAMES]
        if unknown or not checks:
            raise InvalidParameterError("checks", list(checks), f"names from {CHECK_NAMES}")
        start = time.perf_counter()
        results = [getattr(self, c)() for c in CHECK_NAMES if c in checks]
        elapsed = time.perf_counter() - start
        settings = {
            "seed": self._seed,
            "loss": self._loss.value,
            "labels": self._labels.value,
            "learning_rate": self._lr,
            "denominator": self._denominator,
            "plain_sgd": self._plain_sgd,
            "noise_multiplier": (self._sigma or {}).get("sigma", self._sigma_given),
            "input_shape": list(self._input_shape),
            "steps_run": self.steps_run,
            "seconds": elapsed,
            "config": self._config.to_dict(),
        }
        return CheckReport(results=results, settings=settings)


def run_checks(
    harness: StepHarness,
    *,
    input_shape: Sequence[int],
    loss: str | LossKind,
    checks: Sequence[str] = CHECK_NAMES,
    **kwargs: Any,
) -> CheckReport:
    """Run the DP-SGD implementation-bug checks on ``harness``; see :class:`DPSGDChecker`.

    Args:
        harness: the training step to check.
        input_shape: shape of one model input.
        loss: ``"mse"`` or ``"cross_entropy"``.
        checks: which checks to run (names from :data:`CHECK_NAMES`).
        **kwargs: the keyword arguments of :class:`DPSGDChecker` (``labels``,
            ``learning_rate``, ``denominator``, ``plain_sgd``, ``noise_multiplier``, ``seed``,
            ``config``).
    """
    checker = DPSGDChecker(harness, input_shape=input_shape, loss=loss, **kwargs)
    return checker.run(checks)
