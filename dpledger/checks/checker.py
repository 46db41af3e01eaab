"""Implementation-bug checks for DP-SGD, run on a black-box training step (framework-free).

Follows "Finding Private Bugs: Debugging Implementations of DP-SGD" (sections 3–4, appendices A,
B, C, E) and the batch-size sensitivity bug of Tramèr et al., "Debugging Differential Privacy"
(section 4). A correct DP-SGD step on a batch of B examples with per-example gradients g_b is

    θ' = θ − (η/D)·( Σ_b g_b·min(1, C/‖g_b‖) + N(0, (σC)² I) )                          (★)

with learning rate η, clip norm C, noise multiplier σ and normaliser D (the realised batch size B
in Algorithm 1 of the paper; a fixed expected batch size q·n in dpledger's adapters). The checks
drive the step from outside — through a :class:`StepHarness` that runs it from a fixed starting
model on a given batch with given C, σ and seed and returns the parameters and per-example losses
— and test four consequences of (★), one module each:

``clipping_applied`` (:mod:`dpledger.checks.clipping_applied`)
    σ = 0, B = 1, a grid of C: the one-step loss change depends on C below the gradient norm.
``per_example_clipping`` (:mod:`dpledger.checks.per_example_clipping`)
    σ = 0, tiny C: the large points' update shrinks like 1/B and grows with their number k.
``noise_calibrated`` (:mod:`dpledger.checks.noise_calibrated`)
    unclipped C: the distance between models trained with different seeds grows like C.
``noise_magnitude`` (:mod:`dpledger.checks.noise_magnitude`)
    plain SGD: the difference of two runs is N(0, 2(ησC/D)² I).

The step runs through a :class:`~dpledger.checks.step_driver.StepDriver`; the experiments the
noise checks share are in :mod:`dpledger.checks.noise_stages`.

Adaptive optimisers (appendix E): the harness warms the optimiser state up before the measured
step (:func:`dpledger.checks.torch_step.check_dp_optimizer`), the noise multiplier is chosen by
a variant of the appendix-B search (the largest σ for which the model moves in proportion to σ at
the largest C of the noise grid, so the distances stay out of Adam's saturation regime, appendix
E), and the magnitude test is skipped because Adam's update m/√v is not a scaled Gaussian.

Multiple testing. The clipping checks run at σ = 0, so a deterministic step gives deterministic
curves: their verdict rests on the effect size (``flat_rtol``) and the slope t-test (α =
``alpha_slope``) guards against a curve that varies without a trend. The noise-calibration check
fails a correct step only if a slope whose t-statistic is in the hundreds looks insignificant, so
its false-alarm rate is negligible. The magnitude test rejects a correct step with probability
``alpha_magnitude`` (0.001 by default): that is the family-wise false-alarm rate of a run of all
four checks, measured in ``benchmarks/checks_false_alarms.py``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from dpledger.checks import clipping_applied as _clipping_applied
from dpledger.checks import noise_calibrated as _noise_calibrated
from dpledger.checks import noise_magnitude as _noise_magnitude
from dpledger.checks import per_example_clipping as _per_example_clipping
from dpledger.checks.config import CheckConfig
from dpledger.checks.noise_stages import NoiseStages
from dpledger.checks.report import CheckReport, CheckResult
from dpledger.checks.step_driver import StepDriver
from dpledger.checks.step_harness import StepHarness
from dpledger.checks.synthetic_data import ClippingPool, LabelKind, LossKind
from dpledger.errors import InvalidParameterError

__all__ = ["CHECK_NAMES", "DPSGDChecker", "run_checks"]

logger = logging.getLogger(__name__)

CHECK_NAMES: tuple[str, ...] = (
    _clipping_applied.NAME,
    _per_example_clipping.NAME,
    _noise_calibrated.NAME,
    _noise_magnitude.NAME,
)


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
        self._driver = StepDriver(
            harness=harness,
            input_shape=input_shape,
            loss=loss,
            labels=labels,
            learning_rate=learning_rate,
            denominator=denominator,
            plain_sgd=plain_sgd,
            noise_multiplier=noise_multiplier,
            seed=seed,
            config=config,
        )
        self._noise = NoiseStages(self._driver)
        self._results: dict[str, CheckResult] = {}
        self._gradient_norm: float | None = None

    @property
    def config(self) -> CheckConfig:
        """The grids and thresholds in use."""
        return self._driver.config

    @property
    def steps_run(self) -> int:
        """Training steps the checks have run so far."""
        return self._driver.steps_run

    @property
    def num_outputs(self) -> int:
        """Output dimension of the model (number of classes for cross-entropy)."""
        return self._driver.num_outputs

    @property
    def pool(self) -> ClippingPool:
        """The fixed synthetic points of the clipping checks."""
        return self._driver.pool

    def _store(self, result: CheckResult) -> CheckResult:
        self._results[result.name] = result
        logger.info("check %s: %s", result.name, result.verdict.value)
        return result

    def clipping_applied(self) -> CheckResult:
        """σ = 0, B = 1, a grid of C: the one-step loss change must depend on C below ‖g‖."""
        if _clipping_applied.NAME not in self._results:
            result, self._gradient_norm = _clipping_applied.check_clipping_applied(self._driver)
            self._store(result)
        return self._results[_clipping_applied.NAME]

    def gradient_norm_estimate(self) -> float | None:
        """‖g‖ of the large-gradient point, from the knee of ``clipping_applied`` (or None)."""
        self.clipping_applied()
        return self._gradient_norm

    def per_example_clipping(self) -> CheckResult:
        """σ = 0, tiny C, fillers plus large-gradient points: the update must scale with 1/B (a)
        and with the number k of large points (b)."""
        if _per_example_clipping.NAME not in self._results:
            self._store(
                _per_example_clipping.check_per_example_clipping(
                    self._driver, self.gradient_norm_estimate
                )
            )
        return self._results[_per_example_clipping.NAME]

    def unclipped_clip_norm(self) -> dict[str, Any]:
        """Appendix B: the smallest grid C from which the σ = 0 update stops changing; see
        :meth:`dpledger.checks.noise_stages.NoiseStages.unclipped_clip_norm`."""
        return self._noise.unclipped_clip_norm()

    def noise_multiplier(self) -> dict[str, Any]:
        """σ for the noise checks: given, 1.0 for plain SGD, or the appendix-B search."""
        return self._noise.noise_multiplier()

    def noise_calibrated(self) -> CheckResult:
        """Unclipped C grid, several seeds per C: the pairwise distance must grow like C."""
        if _noise_calibrated.NAME not in self._results:
            self._store(_noise_calibrated.check_noise_calibrated(self._driver, self._noise))
        return self._results[_noise_calibrated.NAME]

    def update_scale(self, batch_size: int) -> dict[str, Any]:
        """η/D for a batch of ``batch_size``: from the caller, or estimated at σ = 0; see
        :func:`dpledger.checks.noise_magnitude.update_scale`."""
        return _noise_magnitude.update_scale(self._driver, batch_size, self.gradient_norm_estimate)

    def noise_magnitude(self) -> CheckResult:
        """Plain SGD: (θ₁ − θ₂)/(√2·σC·η/D) must be i.i.d. N(0, 1) (KS and χ² tests)."""
        if _noise_magnitude.NAME not in self._results:
            self._store(
                _noise_magnitude.check_noise_magnitude(self._driver, self._noise, self.update_scale)
            )
        return self._results[_noise_magnitude.NAME]

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
        driver = self._driver
        settings = {
            **driver.settings(),
            "noise_multiplier": self._noise.chosen_noise_multiplier,
            "input_shape": list(driver.input_shape),
            "steps_run": driver.steps_run,
            "seconds": elapsed,
            "config": driver.config.to_dict(),
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
