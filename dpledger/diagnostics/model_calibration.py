"""Model calibration of a classifier: NLL, expected and maximum calibration error, reliability
diagrams.

Definitions as in Bu et al., "On the Convergence and Calibration of Deep Learning with
Differential Privacy" (§6, after Naeini et al. 2015). For an M-class classifier with predicted
probability vector π_i for example i, prediction f(x_i) = argmax_k π_ik and label y_i:

* confidence P̂_i = max_k π_ik, correctness 1{f(x_i) = y_i};
* NLL = −(1/n) Σ_i log π_{i, y_i} (the test loss); ∞ if some π_{i, y_i} = 0;
* ECE = E[ |P(f(x) = y | P̂ = p) − p| ] and MCE = max_p |P(f(x) = y | P̂ = p) − p|, estimated by
  binning the confidences into B bins: with acc_b and conf_b the mean correctness and mean
  confidence of the n_b examples in bin b,

      ECE = Σ_b (n_b / n)·|acc_b − conf_b|,     MCE = max over non-empty bins of |acc_b − conf_b|.

Binning: ``"equal_width"`` (default) uses the B intervals ((b−1)/B, b/B] for b = 1..B (the first is
[0, 1/B]); ``"equal_mass"`` sorts the examples by confidence (ties kept in input order) and splits
them into B consecutive groups whose sizes differ by at most one (``numpy.array_split``), so bin b
covers [min, max] of its confidences.

These metrics are computed on whatever data they are given; they are not differentially private
when that data is private.
"""

from __future__ import annotations

import enum
import math
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from dpledger.errors import InvalidParameterError
from dpledger.validation import check_enum, check_positive_int

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = [
    "Binning",
    "ModelCalibrationMetrics",
    "ReliabilityDiagram",
    "model_calibration_metrics",
    "plot_reliability_diagram",
]

_ROW_SUM_TOL = 1e-6


class Binning(str, enum.Enum):
    """How confidences are grouped into bins."""

    EQUAL_WIDTH = "equal_width"
    EQUAL_MASS = "equal_mass"

    @classmethod
    def parse(cls, value: Binning | str) -> Binning:
        """The binning named by ``value``."""
        return check_enum("binning", value, cls)


@attrs.frozen(eq=False)
class ReliabilityDiagram:
    """Per-bin data of a reliability diagram (arrays of length B).

    Attributes:
        binning: how the bins were formed.
        lower: lower edge of each bin (equal-mass: the smallest confidence in it).
        upper: upper edge of each bin (equal-mass: the largest confidence in it).
        count: examples in each bin.
        confidence: mean confidence in each bin (NaN for an empty bin).
        accuracy: fraction correct in each bin (NaN for an empty bin).
    """

    binning: Binning
    lower: np.ndarray
    upper: np.ndarray
    count: np.ndarray
    confidence: np.ndarray
    accuracy: np.ndarray

    @property
    def gap(self) -> np.ndarray:
        """|accuracy − confidence| per bin (NaN for an empty bin)."""
        return np.abs(self.accuracy - self.confidence)


@attrs.frozen(eq=False)
class ModelCalibrationMetrics:
    """Calibration of a classifier on a data set.

    Attributes:
        num_examples: n.
        accuracy: fraction of correct predictions.
        nll: mean negative log-likelihood of the true labels.
        ece: expected calibration error (binned).
        mce: maximum calibration error over non-empty bins.
        mean_confidence: mean of the confidences P̂_i.
        reliability: the per-bin data.
    """

    num_examples: int
    accuracy: float
    nll: float
    ece: float
    mce: float
    mean_confidence: float
    reliability: ReliabilityDiagram

    def scalars(self) -> dict[str, float]:
        """accuracy, nll, ece, mce and mean confidence as a dict (e.g. for a results table)."""
        return {
            "accuracy": self.accuracy,
            "nll": self.nll,
            "ece": self.ece,
            "mce": self.mce,
            "mean_confidence": self.mean_confidence,
        }


def _probabilities(value: Any) -> np.ndarray:
    expected = (
        "an array (n, M) of class probabilities with rows summing to 1, or (n,) probabilities "
        "of class 1 for a binary classifier"
    )
    try:
        p = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise InvalidParameterError("probabilities", value, expected) from None
    if p.ndim == 1:
        p = np.stack([1.0 - p, p], axis=1)
    if p.ndim != 2 or p.shape[0] < 1 or p.shape[1] < 2:
        raise InvalidParameterError("probabilities", f"(shape {p.shape})", expected)
    if not np.all(np.isfinite(p)) or np.any(p < 0.0) or np.any(p > 1.0):
        raise InvalidParameterError("probabilities", "(array)", expected + ", entries in [0, 1]")
    if np.any(np.abs(p.sum(axis=1) - 1.0) > _ROW_SUM_TOL):
        raise InvalidParameterError("probabilities", "(array)", expected)
    return p


def _labels(value: Any, n: int, m: int) -> np.ndarray:
    y = np.asarray(value)
    if y.ndim != 1 or y.shape[0] != n or y.dtype.kind not in "iub":
        raise InvalidParameterError("labels", value, f"{n} integer class labels in [0, {m - 1}]")
    y = y.astype(np.int64)
    if np.any(y < 0) or np.any(y >= m):
        raise InvalidParameterError("labels", value, f"{n} integer class labels in [0, {m - 1}]")
    return y


def model_calibration_metrics(
    probabilities: Any,
    labels: Any,
    *,
    num_bins: int = 15,
    binning: Binning | str = Binning.EQUAL_WIDTH,
) -> ModelCalibrationMetrics:
    """NLL, ECE, MCE and reliability-diagram data of a classifier's predicted probabilities.

    Args:
        probabilities: (n, M) predicted class probabilities (rows sum to 1), or (n,) probability
            of class 1 for a binary classifier.
        labels: (n,) true class labels in [0, M).
        num_bins: B ≥ 1.
        binning: ``"equal_width"`` or ``"equal_mass"`` (see the module docstring).

    Returns:
        The metrics with the per-bin data.
    """
    p = _probabilities(probabilities)
    n, m = p.shape
    y = _labels(labels, n, m)
    num_bins = check_positive_int("num_bins", num_bins)
    binning = Binning.parse(binning)

    pred = np.argmax(p, axis=1)
    conf = p[np.arange(n), pred]
    correct = (pred == y).astype(np.float64)
    p_true = p[np.arange(n), y]
    with np.errstate(divide="ignore"):
        nll = float(-np.mean(np.log(p_true)))
    if math.isnan(nll):  # pragma: no cover - p_true is in [0, 1]
        nll = math.inf

    if binning is Binning.EQUAL_WIDTH:
        edges = np.linspace(0.0, 1.0, num_bins + 1)
        # bin b (0-based) holds (b/B, (b+1)/B]; confidence 0 (impossible for a max) goes to bin 0.
        idx = np.clip(np.ceil(conf * num_bins).astype(np.int64) - 1, 0, num_bins - 1)
        groups = [np.flatnonzero(idx == b) for b in range(num_bins)]
        lower, upper = edges[:-1].copy(), edges[1:].copy()
    else:
        order = np.argsort(conf, kind="stable")
        groups = list(np.array_split(order, num_bins))
        lower = np.array([conf[g].min() if g.size else np.nan for g in groups])
        upper = np.array([conf[g].max() if g.size else np.nan for g in groups])

    count = np.array([g.size for g in groups], dtype=np.int64)
    bin_conf = np.array([conf[g].mean() if g.size else np.nan for g in groups])
    bin_acc = np.array([correct[g].mean() if g.size else np.nan for g in groups])
    gaps = np.abs(bin_acc - bin_conf)
    nonempty = count > 0
    ece = float(np.sum(count[nonempty] / n * gaps[nonempty]))
    mce = float(np.max(gaps[nonempty]))
    return ModelCalibrationMetrics(
        num_examples=n,
        accuracy=float(correct.mean()),
        nll=nll,
        ece=ece,
        mce=mce,
        mean_confidence=float(conf.mean()),
        reliability=ReliabilityDiagram(
            binning=binning,
            lower=lower,
            upper=upper,
            count=count,
            confidence=bin_conf,
            accuracy=bin_acc,
        ),
    )


def plot_reliability_diagram(
    metrics: ModelCalibrationMetrics,
    *,
    ax: Axes | None = None,
    title: str | None = None,
) -> Axes:
    """Reliability diagram: accuracy per confidence bin against the diagonal of perfect calibration.

    matplotlib (the ``plot`` extra) is imported when called.

    Args:
        metrics: the result of :func:`model_calibration_metrics`.
        ax: axes to draw on (a new figure when None).
        title: axes title (default: the ECE and MCE).

    Returns:
        The axes.
    """
    if not isinstance(metrics, ModelCalibrationMetrics):
        raise InvalidParameterError("metrics", metrics, "a ModelCalibrationMetrics")
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=(4.5, 4.5))
    rel = metrics.reliability
    nonempty = rel.count > 0
    left = rel.lower[nonempty]
    width = rel.upper[nonempty] - rel.lower[nonempty]
    width = np.where(width > 0, width, 0.01)
    ax.bar(
        left,
        rel.accuracy[nonempty],
        width=width,
        align="edge",
        alpha=0.7,
        edgecolor="black",
        label="accuracy",
    )
    ax.plot(
        rel.confidence[nonempty],
        rel.confidence[nonempty],
        "o",
        color="red",
        markersize=3,
        label="mean confidence",
    )
    ax.plot([0.0, 1.0], [0.0, 1.0], "k:", label="perfect calibration")
    ax.set_xlim(0.0, 1.0)
    ax.set_ylim(0.0, 1.0)
    ax.set_xlabel("confidence")
    ax.set_ylabel("accuracy")
    ax.set_title(title if title is not None else f"ECE {metrics.ece:.3f}, MCE {metrics.mce:.3f}")
    ax.legend(loc="upper left")
    return ax
