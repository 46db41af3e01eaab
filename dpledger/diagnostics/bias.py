"""Clipping bias of one DP step: how far the clipped mean gradient is from the true one.

**These metrics are NOT differentially private.** They are computed from the raw per-example
gradients (or their norms and unclipped sum) of a step, before any noise. They are for debugging
and research on data you may look at; never log them to a place the data's owners cannot see,
never release them, and never let them influence training in a run whose ε you intend to report.

Definitions follow Knolle et al., "Bias-Aware Minimisation" (§3.1, §4 and appendix C). For the
l per-example gradients g_1..g_l of a step (l the batch size, or an expected batch size given as
``denominator``) and flat clipping to C (Algorithm 1, line 3):

* clip(g_i) = g_i / max(1, ‖g_i‖/C), a record is *clipped* when ‖g_i‖ > C;
* ĝ = (1/l) Σ g_i the mini-batch gradient, ĝ_clip = (1/l) Σ clip(g_i) the clipped one;
* the bias vector ĝ_clip − ĝ (the bias of the private gradient: the Gaussian noise adds none,
  Lemma 1) and its norm;
* the decomposition ĝ_clip = a·ĝ + c (Theorem 1) with the *magnitude error*
  a = (1/l) Σ η_i/M_i and the *directional error* c = (1/l) Σ τ_i/M_i, where
  g_i = η_i·ĝ + τ_i, η_i = ⟨g_i, ĝ⟩/‖ĝ‖², τ_i ⊥ ĝ and M_i = max(1, ‖g_i‖/C). Equivalently
  a = ⟨ĝ_clip, ĝ⟩/‖ĝ‖² and c = ĝ_clip − a·ĝ ⊥ ĝ, which is how it is computed here. (The
  appendix prints clip(g_i) = g_i / max(1, C/‖g_i‖) and M_i = max(1, C/‖g_i‖), with the ratio
  inverted; we follow Algorithm 1's clipping, under which the decomposition holds as stated.) The
  appendix's c of ĝ_priv also carries the noise; here c is that of ĝ_clip, its expectation;
* cos(ĝ_clip, ĝ), the cosine similarity the paper's appendix C.3 reports.

Other clipping rules (per-layer, global clipping of Bu et al., automatic clipping) are covered by
passing the clipped per-example vectors themselves. When ĝ = 0 the decomposition is degenerate; we
report a = 0, c = ĝ_clip and a cosine of 0.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from dpledger.errors import InvalidParameterError
from dpledger.validation import check_positive_finite, check_positive_int

__all__ = [
    "ClippingBias",
    "ClippingBiasCallback",
    "ClippingBiasRecorder",
    "clipping_bias",
    "clipping_bias_from_sums",
]

_REL_TOL = 1e-9


@attrs.frozen(eq=False)
class ClippingBias:
    """Bias metrics of one step. NOT private: for debugging only, never release them.

    Attributes:
        num_examples: number of per-example vectors in the step.
        denominator: l, what both sums were divided by (default ``num_examples``).
        fraction_clipped: fraction of the records whose vector clipping shortened.
        bias: the vector ĝ_clip − ĝ.
        bias_norm: ‖ĝ_clip − ĝ‖.
        magnitude_error: a in ĝ_clip = a·ĝ + c (a = ⟨ĝ_clip, ĝ⟩/‖ĝ‖²; 1 when no record is clipped,
            below 1 when clipping shrinks the gradient along ĝ).
        directional_error: the vector c = ĝ_clip − a·ĝ, orthogonal to ĝ.
        directional_error_norm: ‖c‖.
        cosine: cos(ĝ_clip, ĝ).
        mean_gradient_norm: ‖ĝ‖.
        clipped_mean_gradient_norm: ‖ĝ_clip‖.
        mean_example_norm: mean of ‖g_i‖ (None on the fast path without norms).
        max_example_norm: max of ‖g_i‖ (None on the fast path without norms).
    """

    num_examples: int
    denominator: float
    fraction_clipped: float
    bias: np.ndarray
    bias_norm: float
    magnitude_error: float
    directional_error: np.ndarray
    directional_error_norm: float
    cosine: float
    mean_gradient_norm: float
    clipped_mean_gradient_norm: float
    mean_example_norm: float | None = None
    max_example_norm: float | None = None

    def scalars(self) -> dict[str, float]:
        """The scalar metrics, for per-step logging (NOT private)."""
        out = {
            "fraction_clipped": self.fraction_clipped,
            "bias_norm": self.bias_norm,
            "magnitude_error": self.magnitude_error,
            "directional_error_norm": self.directional_error_norm,
            "cosine": self.cosine,
            "mean_gradient_norm": self.mean_gradient_norm,
            "clipped_mean_gradient_norm": self.clipped_mean_gradient_norm,
        }
        if self.mean_example_norm is not None:
            out["mean_example_norm"] = self.mean_example_norm
        if self.max_example_norm is not None:
            out["max_example_norm"] = float(self.max_example_norm)
        return out


ClippingBiasCallback = Callable[[int, ClippingBias], None]
"""What a training adapter calls after a step when bias metrics are on: ``callback(step, metrics)``.

Adapters compute the metrics only when a callback is registered, so a step without one costs
nothing extra. The metrics are NOT private; see the module docstring.
"""


class ClippingBiasRecorder:
    """A bias callback that keeps every step's scalar metrics. NOT private: debugging only.

    Pass it as an adapter's ``bias_callback``; after training, :meth:`values` gives one metric per
    recorded step and :meth:`means` the mean over steps of each metric (every step weighted
    equally, as the bias magnitude "averaged over training iterations" of Knolle et al.,
    appendix C.3). Only the scalars of :meth:`ClippingBias.scalars` are kept, not the bias
    vectors, so memory grows by a few numbers per step. A metric a step did not report (the
    per-example norms on the distributed fast path) is NaN for that step.

    Example::

        recorder = ClippingBiasRecorder()
        optimizer = DPOptimizer(..., bias_callback=recorder)
        ...  # train
        recorder.means()["bias_norm"]  # mean over steps of ‖ĝ_clip − ĝ‖ (NOT private)
    """

    def __init__(self) -> None:
        self._steps: list[int] = []
        self._rows: list[dict[str, float]] = []

    def __call__(self, step: int, metrics: ClippingBias) -> None:
        """Record ``metrics`` of step ``step`` (the :data:`ClippingBiasCallback` signature)."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise InvalidParameterError("step", step, "a step index (an integer >= 0)")
        if not isinstance(metrics, ClippingBias):
            raise InvalidParameterError("metrics", metrics, "a ClippingBias")
        self._steps.append(int(step))
        self._rows.append(metrics.scalars())

    def __len__(self) -> int:
        return len(self._steps)

    @property
    def steps(self) -> tuple[int, ...]:
        """The step indices recorded, in order."""
        return tuple(self._steps)

    @property
    def names(self) -> tuple[str, ...]:
        """The metrics some recorded step reported, in the order of :meth:`ClippingBias.scalars`."""
        seen: dict[str, None] = {}
        for row in self._rows:
            seen.update(dict.fromkeys(row))
        return tuple(seen)

    def values(self, name: str) -> np.ndarray:
        """One value of metric ``name`` per recorded step (NaN where a step did not report it).

        Raises:
            InvalidParameterError: ``name`` is not a metric any recorded step reported.
        """
        if name not in self.names:
            valid = ", ".join(repr(n) for n in self.names) or "none (no step recorded yet)"
            raise InvalidParameterError("name", name, f"one of the recorded metrics: {valid}")
        return np.array([row.get(name, math.nan) for row in self._rows], dtype=np.float64)

    def means(self) -> dict[str, float]:
        """Mean over the recorded steps of each metric (over the steps that reported it).

        Empty when no step was recorded.
        """
        out = {}
        for name in self.names:
            v = self.values(name)
            out[name] = float(np.mean(v[~np.isnan(v)]))
        return out


def _per_example_matrix(name: str, value: Any) -> np.ndarray:
    """(n, d) float64 from an array (n, ...) or a sequence of per-group arrays (n, ...)."""
    expected = "an array of shape (num_examples, ...) or a list of such arrays (one per group)"
    if isinstance(value, (list, tuple)):
        if not value:
            raise InvalidParameterError(name, value, expected)
        parts = [np.asarray(v, dtype=np.float64) for v in value]
        if any(p.ndim < 1 or p.size == 0 for p in parts) or len({p.shape[0] for p in parts}) != 1:
            raise InvalidParameterError(name, value, expected + " with one common first axis")
        mat = np.concatenate([p.reshape(p.shape[0], -1) for p in parts], axis=1)
    else:
        try:
            arr = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError):
            raise InvalidParameterError(name, value, expected) from None
        if arr.ndim < 1:
            raise InvalidParameterError(name, value, expected)
        if arr.shape[0] < 1 or arr.size == 0:
            raise InvalidParameterError(name, f"(shape {arr.shape})", "at least one example")
        mat = arr.reshape(arr.shape[0], -1)
    if not np.all(np.isfinite(mat)):
        raise InvalidParameterError(name, "(array with non-finite entries)", "finite numbers")
    return mat


def _vector(name: str, value: Any) -> np.ndarray:
    if isinstance(value, (list, tuple)) and value and np.ndim(value[0]) > 0:
        vec = np.concatenate([np.asarray(v, dtype=np.float64).reshape(-1) for v in value])
    else:
        vec = np.asarray(value, dtype=np.float64).reshape(-1)
    if vec.size < 1 or not np.all(np.isfinite(vec)):
        raise InvalidParameterError(name, "(array)", "a non-empty vector of finite numbers")
    return vec


def _denominator(value: Any, n: int) -> float:
    if value is None:
        return float(n)
    return check_positive_finite("denominator", value)


def _decompose(
    g_hat: np.ndarray,
    g_clip: np.ndarray,
    *,
    num_examples: int,
    denominator: float,
    fraction_clipped: float,
    mean_example_norm: float | None,
    max_example_norm: float | None,
) -> ClippingBias:
    norm_g = float(np.linalg.norm(g_hat))
    norm_c = float(np.linalg.norm(g_clip))
    dot = float(np.dot(g_clip, g_hat))
    if norm_g == 0.0:
        a = 0.0
        cosine = 0.0
    else:
        a = dot / (norm_g * norm_g)
        cosine = 0.0 if norm_c == 0.0 else min(max(dot / (norm_g * norm_c), -1.0), 1.0)
    c = g_clip - a * g_hat
    bias = g_clip - g_hat
    return ClippingBias(
        num_examples=num_examples,
        denominator=denominator,
        fraction_clipped=fraction_clipped,
        bias=bias,
        bias_norm=float(np.linalg.norm(bias)),
        magnitude_error=a,
        directional_error=c,
        directional_error_norm=float(np.linalg.norm(c)),
        cosine=cosine,
        mean_gradient_norm=norm_g,
        clipped_mean_gradient_norm=norm_c,
        mean_example_norm=mean_example_norm,
        max_example_norm=max_example_norm,
    )


def clipping_bias(
    per_example_gradients: Any,
    *,
    l2_norm_bound: float | None = None,
    clipped_gradients: Any = None,
    denominator: float | None = None,
) -> ClippingBias:
    """Bias metrics of a step from its per-example gradients. NOT private: never release them.

    Give exactly one of ``l2_norm_bound`` (flat clipping: clip(g) = g / max(1, ‖g‖/C)) or
    ``clipped_gradients`` (the clipped vectors of any clipping rule, in the same layout).

    Args:
        per_example_gradients: array (num_examples, ...) or a list of per-group arrays
            (num_examples, ...), concatenated per example.
        l2_norm_bound: C > 0 for flat clipping of the whole per-example vector.
        clipped_gradients: the clipped per-example vectors, same layout as the gradients.
        denominator: l, what both sums are divided by (default: the number of examples; pass the
            expected batch size to match a Poisson-sampled step's normalisation).

    Returns:
        The step's :class:`ClippingBias`.
    """
    g = _per_example_matrix("per_example_gradients", per_example_gradients)
    n = g.shape[0]
    norms = np.linalg.norm(g, axis=1)
    if (l2_norm_bound is None) == (clipped_gradients is None):
        raise InvalidParameterError(
            "l2_norm_bound/clipped_gradients",
            (l2_norm_bound, "given" if clipped_gradients is not None else None),
            "exactly one of the two",
        )
    if l2_norm_bound is not None:
        bound = check_positive_finite("l2_norm_bound", l2_norm_bound)
        scale = 1.0 / np.maximum(1.0, norms / bound)
        clipped = g * scale[:, None]
        num_clipped = int(np.count_nonzero(norms > bound))
    else:
        clipped = _per_example_matrix("clipped_gradients", clipped_gradients)
        if clipped.shape != g.shape:
            raise InvalidParameterError(
                "clipped_gradients",
                f"(shape {clipped.shape})",
                f"the same layout as per_example_gradients (shape {g.shape})",
            )
        clipped_norms = np.linalg.norm(clipped, axis=1)
        num_clipped = int(np.count_nonzero(clipped_norms < norms * (1.0 - _REL_TOL)))
    denom = _denominator(denominator, n)
    return _decompose(
        g.sum(axis=0) / denom,
        clipped.sum(axis=0) / denom,
        num_examples=n,
        denominator=denom,
        fraction_clipped=num_clipped / n,
        mean_example_norm=float(norms.mean()),
        max_example_norm=float(norms.max()),
    )


def clipping_bias_from_sums(
    *,
    unclipped_sum: Any,
    clipped_sum: Any,
    num_examples: int,
    per_example_norms: Sequence[float] | np.ndarray | None = None,
    l2_norm_bound: float | None = None,
    num_clipped: int | None = None,
    denominator: float | None = None,
) -> ClippingBias:
    """Bias metrics from the sums of a step (the fast path). NOT private: never release them.

    An adapter that already has Σ g_i and Σ clip(g_i) (and the per-example norms it clipped with)
    gets every metric without materialising the per-example gradients here. The fraction clipped
    comes from ``per_example_norms`` with ``l2_norm_bound`` (‖g_i‖ > C), or from ``num_clipped``.

    Args:
        unclipped_sum: Σ g_i (a vector, or a list of per-group arrays, concatenated).
        clipped_sum: Σ clip(g_i), same layout.
        num_examples: number of examples summed (≥ 1).
        per_example_norms: ‖g_i‖ for each example, with ``l2_norm_bound``.
        l2_norm_bound: C of flat clipping, with ``per_example_norms``.
        num_clipped: number of clipped records, instead of norms and bound.
        denominator: l, what both sums are divided by (default ``num_examples``).
    """
    n = check_positive_int("num_examples", num_examples)
    g_sum = _vector("unclipped_sum", unclipped_sum)
    c_sum = _vector("clipped_sum", clipped_sum)
    if g_sum.shape != c_sum.shape:
        raise InvalidParameterError(
            "clipped_sum", f"(size {c_sum.size})", f"the size of unclipped_sum ({g_sum.size})"
        )
    mean_norm: float | None = None
    max_norm: float | None = None
    if per_example_norms is not None:
        norms = np.asarray(per_example_norms, dtype=np.float64).reshape(-1)
        if norms.size != n or not np.all(np.isfinite(norms)) or np.any(norms < 0):
            raise InvalidParameterError(
                "per_example_norms", "(array)", f"{n} finite norms >= 0 (one per example)"
            )
        mean_norm, max_norm = float(norms.mean()), float(norms.max())
    if num_clipped is not None:
        if (
            isinstance(num_clipped, bool)
            or not isinstance(num_clipped, numbers.Integral)
            or not 0 <= num_clipped <= n
        ):
            raise InvalidParameterError("num_clipped", num_clipped, f"an integer in [0, {n}]")
        clipped_count = int(num_clipped)
    elif per_example_norms is not None and l2_norm_bound is not None:
        bound = check_positive_finite("l2_norm_bound", l2_norm_bound)
        clipped_count = int(np.count_nonzero(norms > bound))
    else:
        raise InvalidParameterError(
            "num_clipped",
            num_clipped,
            "the number of clipped records, or per_example_norms together with l2_norm_bound",
        )
    denom = _denominator(denominator, n)
    return _decompose(
        g_sum / denom,
        c_sum / denom,
        num_examples=n,
        denominator=denom,
        fraction_clipped=clipped_count / n,
        mean_example_norm=mean_norm,
        max_example_norm=max_norm,
    )
