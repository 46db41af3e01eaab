"""Synthetic batches for the DP-SGD implementation-bug checks (no real data needed).

Section 3.1 of "Finding Private Bugs: Debugging Implementations of DP-SGD" builds a mini-batch
whose per-example gradients are known without looking at them: the labels of the *filler* points
are set to the model's own prediction, ``y_i = argmin_y L(y, M(x_i))``, so their loss is minimal
and their gradient is zero; one *large-gradient* point gets a label far from the prediction. The
features do not matter, so they are drawn from a standard normal distribution.

Zero gradient, per loss (f = M(x) the model output, m its dimension):

* mean squared error, L = (1/m)·‖f − y‖²: with y = f, ∂L/∂f = (2/m)(f − y) = 0.
* cross-entropy with soft (probability) targets, L = −Σ_j y_j log softmax(f)_j: with
  y = softmax(f), ∂L/∂f = softmax(f) − y = 0.
* cross-entropy with hard (class-index) targets: the loss is minimal at y = argmax f, but
  ∂L/∂f = softmax(f) − e_y is *not* zero; its norm, the *residual*, is
  √((1 − p_max)² + Σ_{j≠y} p_j²) with p = softmax(f). Such fillers contribute a small gradient
  of their own, which biases the per-example clipping check; use soft targets where the training
  code accepts them (``torch.nn.functional.cross_entropy`` and Keras'
  ``CategoricalCrossentropy`` do). :func:`cross_entropy_residual` reports the residual.

Large gradient: for MSE, y = f − a·(1 + |f|)·sign(f) (sign(0) = 1) with scale a ≫ 1, so
|∂L/∂f_j| = (2a/m)(1 + |f_j|) ≥ 2a/m (the paper's y = −a·f fails when f ≈ 0); for cross-entropy,
the least likely class, whose output gradient softmax(f) − e_y has norm ≥ 1 − p_min ≥ 1 − 1/m.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from dpledger.errors import InvalidParameterError
from dpledger.validation import (
    check_enum,
    check_non_negative_int,
    check_positive_finite,
    check_positive_int,
)

__all__ = [
    "ClippingPool",
    "LabelKind",
    "LossKind",
    "check_input_shape",
    "cross_entropy_residual",
    "large_gradient_targets",
    "make_clipping_pool",
    "ordinary_batch",
    "softmax",
    "zero_gradient_targets",
]


class LossKind(str, enum.Enum):
    """The training loss the synthetic targets are built for."""

    MSE = "mse"
    CROSS_ENTROPY = "cross_entropy"

    @classmethod
    def parse(cls, value: Any, *, parameter: str = "loss") -> LossKind:
        """Return the loss named by ``value`` (an instance or its string value)."""
        return check_enum(parameter, value, cls)


class LabelKind(str, enum.Enum):
    """How cross-entropy targets are given: probability vectors (soft) or class indices (hard)."""

    SOFT = "soft"
    HARD = "hard"

    @classmethod
    def parse(cls, value: Any, *, parameter: str = "labels") -> LabelKind:
        """Return the label kind named by ``value`` (an instance or its string value)."""
        return check_enum(parameter, value, cls)


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax, computed in float64 after subtracting the row maximum."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def _predictions_2d(predictions: Any) -> np.ndarray:
    f = np.asarray(predictions)
    if f.ndim != 2 or f.shape[0] < 1 or f.shape[1] < 1:
        raise InvalidParameterError(
            "predictions", f"array of shape {f.shape}", "a 2-d array (batch, outputs)"
        )
    if not np.all(np.isfinite(f)):
        raise InvalidParameterError("predictions", "array with non-finite values", "finite")
    return f


def _check_classes(f: np.ndarray) -> None:
    if f.shape[1] < 2:
        raise InvalidParameterError(
            "predictions", f"array of shape {f.shape}", "at least 2 logits for cross-entropy"
        )


def zero_gradient_targets(predictions: Any, *, loss: Any, labels: Any = "soft") -> np.ndarray:
    """Targets at which each example's loss is minimal given the model's outputs.

    Args:
        predictions: model outputs f = M(x), shape (batch, outputs): values for MSE, logits for
            cross-entropy.
        loss: ``"mse"`` or ``"cross_entropy"``.
        labels: for cross-entropy, ``"soft"`` (y = softmax(f), zero gradient) or ``"hard"``
            (y = argmax f, residual gradient, see :func:`cross_entropy_residual`).

    Returns:
        MSE: y = f (same dtype). Cross-entropy soft: float64 probabilities (batch, outputs).
        Cross-entropy hard: int64 class indices (batch,).
    """
    kind = LossKind.parse(loss)
    f = _predictions_2d(predictions)
    if kind is LossKind.MSE:
        return f.copy()
    _check_classes(f)
    if LabelKind.parse(labels) is LabelKind.SOFT:
        return softmax(f)
    return np.argmax(f, axis=1).astype(np.int64)


def large_gradient_targets(
    predictions: Any, *, loss: Any, labels: Any = "soft", scale: float = 10.0
) -> np.ndarray:
    """Targets far from the model's outputs, giving a large per-example gradient.

    Args:
        predictions: model outputs f, shape (batch, outputs).
        loss: ``"mse"`` or ``"cross_entropy"``.
        labels: for cross-entropy, ``"soft"`` (one-hot float vectors) or ``"hard"`` (indices).
        scale: for MSE, the factor a in y = f − a·(1 + |f|)·sign(f); must be > 0.

    Returns:
        Targets in the same layout as :func:`zero_gradient_targets`; for cross-entropy the least
        likely class of each example.
    """
    kind = LossKind.parse(loss)
    a = check_positive_finite("scale", scale)
    f = _predictions_2d(predictions)
    if kind is LossKind.MSE:
        direction = np.where(f < 0, -1.0, 1.0)
        return (f - a * (1.0 + np.abs(f)) * direction).astype(f.dtype, copy=False)
    _check_classes(f)
    worst = np.argmin(f, axis=1).astype(np.int64)
    if LabelKind.parse(labels) is LabelKind.HARD:
        return worst
    return np.eye(f.shape[1], dtype=np.float64)[worst]


def cross_entropy_residual(predictions: Any, targets: Any) -> np.ndarray:
    """Norm of ∂L/∂f = softmax(f) − y for cross-entropy targets ``targets`` (per example).

    Zero for soft targets y = softmax(f); for hard targets y = argmax f it equals
    √((1 − p_max)² + Σ_{j≠argmax} p_j²) with p = softmax(f).
    """
    f = _predictions_2d(predictions)
    _check_classes(f)
    p = softmax(f)
    y = np.asarray(targets)
    if y.ndim == 1:
        y = np.eye(f.shape[1], dtype=np.float64)[y.astype(np.int64)]
    return np.linalg.norm(p - y, axis=1)


def check_input_shape(input_shape: Sequence[int]) -> tuple[int, ...]:
    """``input_shape`` as a tuple of ints, each ≥ 1; else :class:`InvalidParameterError`."""
    try:
        shape = tuple(int(s) for s in input_shape)
    except (TypeError, ValueError):
        raise InvalidParameterError(
            "input_shape", input_shape, "a sequence of positive integers"
        ) from None
    if not shape or any(s < 1 for s in shape):
        raise InvalidParameterError("input_shape", input_shape, "a sequence of positive integers")
    return shape


@attrs.frozen
class ClippingPool:
    """Fixed synthetic points for the clipping checks (section 3.1).

    The same filler points and the same large-gradient point are reused for every batch, so
    between batches only the batch size B and the number k of large-gradient points change.

    Attributes:
        filler_x: inputs of the zero-gradient points, shape (max_fillers, *input_shape).
        filler_y: their targets (the model's own predictions).
        large_x: input of the large-gradient point, shape (1, *input_shape).
        large_y: its target.
    """

    filler_x: np.ndarray
    filler_y: np.ndarray
    large_x: np.ndarray
    large_y: np.ndarray

    @property
    def max_batch_size(self) -> int:
        """The largest batch :meth:`batch` can build."""
        return int(self.filler_x.shape[0]) + 1

    def batch(self, batch_size: int, *, num_large: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """B − k filler points followed by k copies of the large-gradient point.

        Args:
            batch_size: B ≥ 1.
            num_large: k, with 0 ≤ k ≤ B and B − k ≤ the number of fillers.

        Returns:
            (x, y); the large-gradient points are the last k rows.
        """
        b = check_positive_int("batch_size", batch_size)
        k = check_non_negative_int("num_large", num_large, maximum=b)
        fillers = b - k
        if fillers > self.filler_x.shape[0]:
            raise InvalidParameterError(
                "batch_size", batch_size, f"at most {self.filler_x.shape[0] + k} for this pool"
            )
        x = np.concatenate([self.filler_x[:fillers]] + [self.large_x] * k, axis=0)
        y = np.concatenate([self.filler_y[:fillers]] + [self.large_y] * k, axis=0)
        return x, y


def make_clipping_pool(
    predict: Callable[[np.ndarray], np.ndarray],
    *,
    input_shape: Sequence[int],
    loss: Any,
    labels: Any = "soft",
    max_fillers: int,
    scale: float = 10.0,
    rng: np.random.Generator,
    dtype: Any = np.float64,
) -> ClippingPool:
    """Draw filler and large-gradient inputs and label them with the model's predictions.

    Args:
        predict: maps inputs (n, *input_shape) to the starting model's outputs (n, outputs).
        input_shape: shape of one input.
        loss: ``"mse"`` or ``"cross_entropy"``.
        labels: ``"soft"`` or ``"hard"`` (cross-entropy only).
        max_fillers: how many zero-gradient points to draw (the largest B − 1 needed).
        scale: the MSE target distance of :func:`large_gradient_targets`.
        rng: source of the inputs.
        dtype: dtype of the inputs.
    """
    shape = check_input_shape(input_shape)
    n = check_positive_int("max_fillers", max_fillers)
    filler_x = rng.standard_normal((n, *shape)).astype(dtype)
    large_x = rng.standard_normal((1, *shape)).astype(dtype)
    filler_y = zero_gradient_targets(predict(filler_x), loss=loss, labels=labels)
    large_y = large_gradient_targets(predict(large_x), loss=loss, labels=labels, scale=scale)
    return ClippingPool(filler_x=filler_x, filler_y=filler_y, large_x=large_x, large_y=large_y)


def ordinary_batch(
    *,
    input_shape: Sequence[int],
    num_outputs: int,
    batch_size: int,
    loss: Any,
    labels: Any = "soft",
    rng: np.random.Generator,
    dtype: Any = np.float64,
) -> tuple[np.ndarray, np.ndarray]:
    """A batch of ordinary points: standard normal inputs and random targets.

    MSE targets are standard normal; cross-entropy targets are uniformly random classes (one-hot
    float vectors for soft labels, int64 indices for hard labels). Used for the noise checks and
    for warming up an adaptive optimiser's state.
    """
    shape = check_input_shape(input_shape)
    m = check_positive_int("num_outputs", num_outputs)
    b = check_positive_int("batch_size", batch_size)
    kind = LossKind.parse(loss)
    x = rng.standard_normal((b, *shape)).astype(dtype)
    if kind is LossKind.MSE:
        return x, rng.standard_normal((b, m)).astype(dtype)
    if m < 2:
        raise InvalidParameterError("num_outputs", num_outputs, "at least 2 for cross-entropy")
    classes = rng.integers(0, m, size=b).astype(np.int64)
    if LabelKind.parse(labels) is LabelKind.HARD:
        return x, classes
    return x, np.eye(m, dtype=np.float64)[classes]
