"""Hand-written NumPy DP-SGD steps for linear regression (correct and deliberately buggy).

They implement :class:`dpledger.checks.step_harness.StepHarness` without any ML framework, so the
framework-free checks can be tested on their own. The model is f(x) = W x + b with per-example
loss (1/m)·‖f(x) − y‖²; its per-example gradient is (2/m)(f − y) ⊗ [x, 1].
"""

from __future__ import annotations

import numpy as np

from dpledger.checks.step_harness import StepOutcome

__all__ = ["BUGS", "NumpyLinearHarness"]

#: bug name → what the step does wrong
BUGS = {
    None: "correct DP-SGD",
    "no_clip": "no clipping",
    "clip_mean": "clips the batch-mean gradient instead of each example's",
    "clip_sum": "clips the summed gradient, then divides by the batch size",
    "uncalibrated": "noise N(0, σ²) instead of N(0, (σC)²)",
    "noise_over_batch": "noise standard deviation σC/B",
}


def _clip_rows(g: np.ndarray, c: float) -> np.ndarray:
    norms = np.linalg.norm(g, axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        factor = np.where(norms > c, c / norms, 1.0)
    return g * factor


class NumpyLinearHarness:
    """One DP-SGD step (or a few) on a linear model with MSE loss.

    Args:
        dim: input dimension.
        outputs: output dimension m.
        lr: learning rate η.
        bug: a key of :data:`BUGS`.
        denominator: None divides by the realised batch size; a number divides by it.
        seed: seeds the starting parameters.
        dtype: parameter dtype (float64 or float32).
    """

    def __init__(
        self,
        *,
        dim: int = 5,
        outputs: int = 1,
        lr: float = 0.01,
        bug: str | None = None,
        denominator: float | None = None,
        seed: int = 0,
        dtype: type = np.float64,
    ) -> None:
        assert bug in BUGS
        rng = np.random.default_rng(seed)
        self.dim, self.m, self.lr, self.bug, self.denominator = dim, outputs, lr, bug, denominator
        self.dtype = dtype
        self.theta0 = rng.normal(0.0, 0.5, outputs * (dim + 1)).astype(dtype)
        self.calls = 0

    def _split(self, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        w = theta[: self.m * self.dim].reshape(self.m, self.dim)
        return w, theta[self.m * self.dim :]

    def _forward(self, theta: np.ndarray, x: np.ndarray) -> np.ndarray:
        w, b = self._split(theta)
        return x.astype(self.dtype) @ w.T + b

    def predict(self, x: np.ndarray) -> np.ndarray:
        return self._forward(self.theta0, x)

    def _losses(self, theta: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        r = self._forward(theta, x) - y.astype(self.dtype)
        return np.mean(r * r, axis=1)

    def _grads(self, theta: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        r = (2.0 / self.m) * (self._forward(theta, x) - y.astype(self.dtype))
        gw = r[:, :, None] * x.astype(self.dtype)[:, None, :]
        return np.concatenate([gw.reshape(len(x), -1), r], axis=1)

    def run(self, x, y, *, l2_norm_bound, noise_multiplier, seed, num_steps=1):
        self.calls += 1
        rng = np.random.default_rng(seed)
        theta = self.theta0.copy()
        b = len(x)
        d = float(b if self.denominator is None else self.denominator)
        c, s = l2_norm_bound, noise_multiplier
        for _ in range(num_steps):
            g = self._grads(theta, x, y)
            k = g.shape[1]
            std = s * c
            if self.bug == "uncalibrated":
                std = s
            elif self.bug == "noise_over_batch":
                std = s * c / b
            noise = rng.normal(0.0, 1.0, k) * std
            if self.bug == "no_clip":
                update = (g.sum(axis=0) + noise) / d
            elif self.bug == "clip_mean":
                update = _clip_rows(g.sum(axis=0, keepdims=True) / d, c)[0] + noise / d
            elif self.bug == "clip_sum":
                update = (_clip_rows(g.sum(axis=0, keepdims=True), c)[0] + noise) / d
            else:
                update = (_clip_rows(g, c).sum(axis=0) + noise) / d
            theta = (theta - self.lr * update).astype(self.dtype)
        return StepOutcome(
            params_before=self.theta0,
            params_after=theta,
            losses_before=self._losses(self.theta0, x, y),
            losses_after=self._losses(theta, x, y),
        )
