"""The driver of the checks: runs a :class:`~dpledger.checks.step_harness.StepHarness` on
synthetic batches and collects what each run returns.

One :class:`StepDriver` serves every check of a run, so that the noise seeds, the synthetic data
and the count of steps are shared: the seed of run i is derived from the checker's seed and i, so
the same checks in the same order give the same runs.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from dpledger.checks.config import CheckConfig
from dpledger.checks.step_harness import StepHarness, StepOutcome
from dpledger.checks.synthetic_data import (
    ClippingPool,
    LabelKind,
    LossKind,
    check_input_shape,
    make_clipping_pool,
    ordinary_batch,
)
from dpledger.errors import InvalidParameterError
from dpledger.validation import check_bool, check_non_negative_int, check_positive_finite

__all__ = ["StepDriver"]


def _denominator(value: str | float) -> str | float:
    if isinstance(value, str):
        if value != "batch":
            raise InvalidParameterError("denominator", value, "'batch' or a number > 0")
        return "batch"
    return check_positive_finite("denominator", value)


def _config(value: CheckConfig | None) -> CheckConfig:
    config = CheckConfig() if value is None else value
    if not isinstance(config, CheckConfig):
        raise InvalidParameterError("config", config, "a CheckConfig")
    if config.noise_batch_size > max((*config.batch_sizes, config.counts_batch)):
        raise InvalidParameterError(
            "config.noise_batch_size",
            config.noise_batch_size,
            "at most the largest batch of the clipping checks",
        )
    return config


def _harness(value: Any) -> StepHarness:
    if not (callable(getattr(value, "predict", None)) and callable(getattr(value, "run", None))):
        raise InvalidParameterError(
            "harness", value, "an object with predict(x) and run(x, y, ...) methods"
        )
    return value


def _learning_rate(value: float | None) -> float | None:
    return None if value is None else check_positive_finite("learning_rate", value)


def _noise_multiplier(value: float | None) -> float | None:
    return None if value is None else check_positive_finite("noise_multiplier", value)


def _seed(value: int) -> int:
    return check_non_negative_int("seed", value)


@attrs.define(kw_only=True, eq=False)
class StepDriver:
    """Runs the step under test for the checks and holds what the checks share.

    The keyword arguments are checked in the order listed, each by a converter, so that the
    first bad one is the one named.

    Args:
        harness: the training step to check.
        input_shape: shape of one model input.
        loss: ``"mse"`` or ``"cross_entropy"``: the loss the step minimises.
        labels: ``"soft"`` or ``"hard"`` cross-entropy targets.
        learning_rate: η of the step, or None.
        denominator: ``"batch"`` or the fixed number the step divides the noisy sum by.
        plain_sgd: True when the update is −(η/D)·(noisy clipped sum), with no optimiser state.
        noise_multiplier: σ for the noise checks, or None (the attribute
            ``given_noise_multiplier``).
        seed: seeds the synthetic data and the noise seeds of every run.
        config: grids and thresholds (None: the defaults).

    Raises:
        InvalidParameterError: a bad argument.
    """

    harness: StepHarness = attrs.field(converter=_harness)
    input_shape: tuple[int, ...] = attrs.field(converter=check_input_shape)
    loss: LossKind = attrs.field(converter=LossKind.parse)
    labels: LabelKind = attrs.field(default="soft", converter=LabelKind.parse)
    learning_rate: float | None = attrs.field(default=None, converter=_learning_rate)
    denominator: str | float = attrs.field(default="batch", converter=_denominator)
    plain_sgd: bool = attrs.field(default=True, converter=lambda v: check_bool("plain_sgd", v))
    given_noise_multiplier: float | None = attrs.field(
        default=None, converter=_noise_multiplier, alias="noise_multiplier"
    )
    seed: int = attrs.field(default=0, converter=_seed)
    config: CheckConfig = attrs.field(default=None, converter=_config)
    steps_run: int = attrs.field(default=0, init=False)
    _seed_counter: int = attrs.field(default=0, init=False)
    _pool: ClippingPool | None = attrs.field(default=None, init=False)
    _num_outputs: int | None = attrs.field(default=None, init=False)
    _noise_batch: tuple[np.ndarray, np.ndarray] | None = attrs.field(default=None, init=False)

    def next_seed(self) -> int:
        """A fresh noise seed: the i-th call returns the same seed for the same checker seed."""
        self._seed_counter += 1
        state = np.random.SeedSequence([self.seed, 7, self._seed_counter]).generate_state(
            1, np.uint64
        )
        return int(state[0] & np.uint64(2**62 - 1))

    def rng(self, tag: int) -> np.random.Generator:
        """The generator of the synthetic data numbered ``tag``."""
        return np.random.default_rng([self.seed, tag])

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Outputs (n, outputs) of the starting model, checked for their shape."""
        out = np.asarray(self.harness.predict(x))
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
            x = self.rng(1).standard_normal((1, *self.input_shape))
            self._num_outputs = int(self.predict(x).shape[1])
        return self._num_outputs

    @property
    def pool(self) -> ClippingPool:
        """The fixed synthetic points of the clipping checks."""
        if self._pool is None:
            cfg = self.config
            largest = max(max(cfg.batch_sizes), cfg.counts_batch, cfg.noise_batch_size)
            self._pool = make_clipping_pool(
                self.predict,
                input_shape=self.input_shape,
                loss=self.loss,
                labels=self.labels,
                max_fillers=largest,
                scale=cfg.large_target_scale,
                rng=self.rng(2),
            )
        return self._pool

    def noise_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """The fixed batch of ordinary points of the noise checks."""
        if self._noise_batch is None:
            self._noise_batch = ordinary_batch(
                input_shape=self.input_shape,
                num_outputs=self.num_outputs,
                batch_size=self.config.noise_batch_size,
                loss=self.loss,
                labels=self.labels,
                rng=self.rng(3),
            )
        return self._noise_batch

    def run(
        self,
        x: np.ndarray,
        y: np.ndarray,
        *,
        clip: float,
        sigma: float,
        seed: int | None = None,
        steps: int = 1,
    ) -> StepOutcome:
        """Run the step ``steps`` times on (x, y) with clip norm ``clip`` and noise multiplier
        ``sigma`` (seed None: the next noise seed), and check the shapes of what it returns."""
        out = self.harness.run(
            x,
            y,
            l2_norm_bound=float(clip),
            noise_multiplier=float(sigma),
            seed=self.next_seed() if seed is None else seed,
            num_steps=steps,
        )
        self.steps_run += steps
        _check_outcome(out, x.shape[0])
        return out

    def settings(self) -> dict[str, Any]:
        """The settings of the step under test, for the report."""
        return {
            "seed": self.seed,
            "loss": self.loss.value,
            "labels": self.labels.value,
            "learning_rate": self.learning_rate,
            "denominator": self.denominator,
            "plain_sgd": self.plain_sgd,
        }


def _check_outcome(out: Any, batch_size: int) -> None:
    if not isinstance(out, StepOutcome):
        raise InvalidParameterError("harness.run", type(out).__name__, "a StepOutcome")
    for name in ("losses_before", "losses_after"):
        arr = getattr(out, name)
        if arr.shape != (batch_size,):
            raise InvalidParameterError(
                f"StepOutcome.{name}", f"shape {arr.shape}", f"shape ({batch_size},)"
            )
    if out.params_after.shape != out.params_before.shape or out.params_after.ndim != 1:
        raise InvalidParameterError(
            "StepOutcome.params_after",
            f"shape {out.params_after.shape}",
            "a flat vector shaped like params_before",
        )
