"""The black-box interface the checks drive: a DP training step run from a fixed starting model.

A :class:`StepHarness` runs the step on a given batch with a given clip norm C, noise multiplier σ
and seed, and returns a :class:`StepOutcome`: the parameters and per-example losses before and
after. The checks see nothing else of the implementation.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import attrs
import numpy as np

__all__ = ["StepHarness", "StepOutcome", "machine_epsilon"]


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
        return machine_epsilon(self.params_after.dtype)

    @property
    def loss_epsilon(self) -> float:
        """Machine epsilon of the losses' dtype (a harness may evaluate losses in float64)."""
        return machine_epsilon(self.losses_after.dtype)


def machine_epsilon(dtype: Any) -> float:
    """Machine epsilon of a floating ``dtype``; that of float64 for any other dtype."""
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
        l2_norm_bound: float,
        noise_multiplier: float,
        seed: int,
        num_steps: int = 1,
    ) -> StepOutcome:
        """Run ``num_steps`` DP steps on the whole batch (x, y) from the starting model.

        Args:
            x: inputs (B, *input_shape), float64 (cast to the model's dtype).
            y: targets: float (B, outputs) for MSE and soft cross-entropy, int64 (B,) for hard
                cross-entropy.
            l2_norm_bound: the clip norm C.
            noise_multiplier: σ; the noise on the clipped sum has standard deviation σ·C.
            seed: seeds the step's noise; equal seeds must give equal noise.
            num_steps: steps to take on the same batch.
        """
        ...
