"""Canaries for privacy audits, and the scores that test for them.

A canary is the record by which the two data sets of the distinguishing game differ: D and
D' = D ∪ {canary} (Jagielski et al. 2020; Tramèr et al. 2022, "Debugging Differential Privacy",
§3.1). The audit is only as strong as the canary is easy to detect, so this module builds the two
kinds that work best for DP-SGD, and the scores that look for them.

**Input canaries** (black box: only the trained model's loss on the canary is observed).

* :func:`out_of_distribution_canary`: a record whose input is non-zero *only* on the features that
  are zero in every record of D (for the scikit-learn digits: the always-blank pixels 0, 32 and
  39), with a large value there. For a model whose first layer is linear, every real record's
  gradient with respect to the weights of those features is zero, so those weights move only by
  the canary's clipped gradient and the noise; the canary's loss then reflects the canary far
  more than the rest of the data. The large value makes the canary's own gradient point almost
  entirely into those weights (a linear layer's weight gradient is (∂ℓ/∂o)·xᵀ, of norm
  ‖∂ℓ/∂o‖·‖x‖), so that after clipping to C nearly all of it changes the canary's logits.
* :func:`mislabeled_canary`: an ordinary record with a wrong label (the case study's choice).

The black-box score is the negative loss on the canary (:func:`loss_score`): higher means "more
likely trained with the canary".

**Gradient canaries** (white box: the parameters before and after training are observed; Nasr et
al. 2023, "Tight auditing of differentially private machine learning"). A
:class:`GradientCanary` is a record whose per-example gradient is the *same* vector g at every
parameter value θ, with ‖g‖ ≥ C, so that clipping turns it into exactly C·ĝ with ĝ = g/‖g‖.
:func:`dirac_gradient_canary` puts g on one coordinate (a Dirac canary). Under DP-SGD with plain
SGD (learning rate η, fixed-denominator average over q·n, T steps) the parameters move by

    θ_T − θ_0 = −(η/(q·n)) · Σ_t ( Σ_{i ∈ R_t} clip_C(g_i(θ_t)) + ξ_t ),   ξ_t ~ N(0, σ̃² I),

so the score s = ⟨θ_0 − θ_T, ĝ⟩ (:meth:`GradientCanary.score`) is (η/(q·n))·(K·C + N(0, T·σ̃²))
plus the projection of the other records' clipped gradients on ĝ, where K is the number of steps
whose sample held the canary. When no other record's gradient has a component along ĝ (a Dirac
canary on a coordinate the data never touch), and with full batches (q = 1, K = T), the score
measured in units of η·C/(q·n) is N(T, T·z²) with the canary and N(0, T·z²) without, z = σ̃/C:
exactly the two Gaussians whose trade-off curve is that of μ-GDP with μ = √T/z, which is the
privacy of the mechanism itself. That audit can therefore reach the accountant's ε up to
sampling error.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import attrs
import numpy as np

from dpledger.errors import InvalidParameterError

__all__ = [
    "GradientCanary",
    "InputCanary",
    "dirac_gradient_canary",
    "loss_score",
    "mislabeled_canary",
    "out_of_distribution_canary",
]


def _features_matrix(features: Any) -> np.ndarray:
    try:
        x = np.asarray(features, dtype=np.float64)
    except (TypeError, ValueError):
        raise InvalidParameterError(
            "features", features, "a 2-D array of finite numbers (records × features)"
        ) from None
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0 or not np.all(np.isfinite(x)):
        raise InvalidParameterError(
            "features",
            f"<array of shape {x.shape}>",
            "a non-empty 2-D array of finite numbers (records × features)",
        )
    return x


def _label(value: Any, name: str = "label") -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise InvalidParameterError(name, value, "a class index (an integer >= 0)")
    return int(value)


def _positive(name: str, value: Any) -> float:
    ok = not isinstance(value, bool) and isinstance(value, numbers.Real)
    if not ok or not math.isfinite(value) or value <= 0:
        raise InvalidParameterError(name, value, "a finite number > 0")
    return float(value)


def _frozen_vector(name: str, value: Any) -> np.ndarray:
    try:
        v = np.array(value, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise InvalidParameterError(name, value, "a 1-D array of finite numbers") from None
    if v.size == 0 or not np.all(np.isfinite(v)):
        raise InvalidParameterError(name, value, "a non-empty 1-D array of finite numbers")
    v.setflags(write=False)
    return v


@attrs.frozen(eq=False)
class InputCanary:
    """A canary record for a black-box audit: an input and its label.

    Attributes:
        features: the record's input (a read-only float64 vector).
        label: its class.
        kind: ``"out_of_distribution"`` or ``"mislabeled"``.
        active_features: for an out-of-distribution canary, the features it sets (those that are
            zero in every record of the data set it was built for); empty otherwise.
    """

    features: np.ndarray = attrs.field(converter=lambda v: _frozen_vector("features", v))
    label: int = attrs.field(converter=_label)
    kind: str = "out_of_distribution"
    active_features: tuple[int, ...] = attrs.field(default=(), converter=tuple)

    @property
    def num_features(self) -> int:
        """Length of the input vector."""
        return int(self.features.size)


def out_of_distribution_canary(
    features: Any, *, label: int, magnitude: float, max_features: int | None = None
) -> InputCanary:
    """A record that is non-zero only on the features that are zero in every given record.

    x_c[j] = ``magnitude`` for every feature j with x_ij = 0 for all records i (the first
    ``max_features`` of them, if given), and 0 elsewhere; its label is ``label``. For a model whose
    first layer is linear, no record of the data set has a gradient on the weights of those
    features, so only the canary and the noise move them (see the module docstring).

    Args:
        features: the data set's inputs, records × features.
        label: the canary's class.
        magnitude: the value of the active features (> 0); larger values put more of the
            canary's clipped gradient on the weights only it touches.
        max_features: use at most this many of the always-zero features (None: all).

    Raises:
        InvalidParameterError: bad arguments, or no feature is zero in every record (then use
            :func:`mislabeled_canary`, or add an input feature the data do not use).
    """
    x = _features_matrix(features)
    label = _label(label)
    magnitude = _positive("magnitude", magnitude)
    dead = np.flatnonzero(np.all(x == 0.0, axis=0))
    if max_features is not None:
        if (
            isinstance(max_features, bool)
            or not isinstance(max_features, numbers.Integral)
            or max_features < 1
        ):
            raise InvalidParameterError("max_features", max_features, "an integer >= 1 or None")
        dead = dead[: int(max_features)]
    if dead.size == 0:
        raise InvalidParameterError(
            "features",
            f"<array of shape {x.shape} with no feature that is zero in every record>",
            "a data set with at least one always-zero feature for an out-of-distribution canary "
            "(use mislabeled_canary otherwise)",
        )
    canary = np.zeros(x.shape[1])
    canary[dead] = magnitude
    return InputCanary(
        features=canary,
        label=label,
        kind="out_of_distribution",
        active_features=tuple(int(j) for j in dead),
    )


def mislabeled_canary(features: Any, labels: Any, *, index: int, label: int) -> InputCanary:
    """Record ``index`` of a data set with its label replaced by ``label`` (Tramèr et al. 2022).

    Args:
        features: inputs, records × features (e.g. a held-out set the canary is taken from).
        labels: their labels.
        index: which record to copy.
        label: the wrong label to give it (must differ from its own).
    """
    x = _features_matrix(features)
    y = np.asarray(labels).reshape(-1)
    if y.size != x.shape[0]:
        raise InvalidParameterError(
            "labels", f"<{y.size} labels>", f"one label per record ({x.shape[0]})"
        )
    if isinstance(index, bool) or not isinstance(index, numbers.Integral):
        raise InvalidParameterError("index", index, f"an integer in [0, {x.shape[0]})")
    if not 0 <= index < x.shape[0]:
        raise InvalidParameterError("index", index, f"an integer in [0, {x.shape[0]})")
    label = _label(label)
    if int(y[index]) == label:
        raise InvalidParameterError(
            "label", label, f"a class other than record {index}'s own label {int(y[index])}"
        )
    return InputCanary(features=x[index], label=label, kind="mislabeled")


def loss_score(loss: Any) -> float:
    """The black-box score of one trained model: −(its loss on the canary).

    Training on the canary lowers its loss, so higher scores mean "more likely included", as
    :func:`~dpledger.audit.threshold_selection.epsilon_bound_from_scores` expects.
    """
    value = float(np.asarray(loss, dtype=np.float64))
    if not math.isfinite(value):
        raise InvalidParameterError("loss", loss, "a finite number")
    return -value


@attrs.frozen(eq=False)
class GradientCanary:
    """A record whose per-example gradient is the fixed vector g at every θ (white box).

    The gradient is over all of the model's trainable parameters, flattened and concatenated in
    the model's parameter order. ‖g‖ must be at least the clip bound C of the audited run, so that
    the clipped gradient is exactly C·ĝ (checked by :meth:`check_clip_bound`).

    Attributes:
        gradient: g (a read-only float64 vector).
    """

    gradient: np.ndarray = attrs.field(converter=lambda v: _frozen_vector("gradient", v))

    def __attrs_post_init__(self) -> None:
        if not np.any(self.gradient != 0.0):
            raise InvalidParameterError("gradient", "<the zero vector>", "a non-zero vector")

    @property
    def norm(self) -> float:
        """‖g‖."""
        return float(np.linalg.norm(self.gradient))

    @property
    def direction(self) -> np.ndarray:
        """ĝ = g/‖g‖."""
        return self.gradient / self.norm

    @property
    def num_parameters(self) -> int:
        """Length of the parameter vector."""
        return int(self.gradient.size)

    def check_clip_bound(self, l2_norm_bound: float) -> None:
        """Raise unless ‖g‖ ≥ C, i.e. unless clipping maps g to exactly C·ĝ."""
        c = _positive("l2_norm_bound", l2_norm_bound)
        if self.norm < c:
            raise InvalidParameterError(
                "l2_norm_bound",
                l2_norm_bound,
                f"at most the canary's gradient norm {self.norm:g} (a canary below the clip "
                "bound contributes less than C and audits a weaker record than DP covers)",
            )

    def score(self, initial_parameters: Any, final_parameters: Any, *, unit: float = 1.0) -> float:
        """⟨θ_0 − θ_T, ĝ⟩ / unit: how far training moved the parameters against the canary.

        Gradient descent moves θ along −g when the canary is in the sample, so higher scores
        mean "more likely included". With ``unit`` = η·C/(q·n) the score counts canary
        inclusions (see the module docstring).

        Args:
            initial_parameters: θ_0, flattened like :attr:`gradient`.
            final_parameters: θ_T, flattened the same way.
            unit: the score's unit (> 0).
        """
        unit = _positive("unit", unit)
        before = np.asarray(initial_parameters, dtype=np.float64).reshape(-1)
        after = np.asarray(final_parameters, dtype=np.float64).reshape(-1)
        for name, v in (("initial_parameters", before), ("final_parameters", after)):
            if v.size != self.num_parameters:
                raise InvalidParameterError(
                    name, f"<{v.size} parameters>", f"{self.num_parameters} parameters"
                )
        value = float(np.dot(before - after, self.direction)) / unit
        if not math.isfinite(value):
            raise InvalidParameterError("final_parameters", "<non-finite>", "finite parameters")
        return value


def dirac_gradient_canary(
    *, num_parameters: int, index: int, norm: float, sign: float = 1.0
) -> GradientCanary:
    """The gradient canary g = sign·norm·e_index: all of it on one coordinate.

    Args:
        num_parameters: length of the flattened parameter vector.
        index: the coordinate.
        norm: ‖g‖ (> 0; at least the clip bound C of the audited run).
        sign: +1 or −1, the sign of the canary's gradient on that coordinate.
    """
    if (
        isinstance(num_parameters, bool)
        or not isinstance(num_parameters, numbers.Integral)
        or num_parameters < 1
    ):
        raise InvalidParameterError("num_parameters", num_parameters, "an integer >= 1")
    if isinstance(index, bool) or not isinstance(index, numbers.Integral):
        raise InvalidParameterError("index", index, f"an integer in [0, {num_parameters})")
    if not 0 <= index < num_parameters:
        raise InvalidParameterError("index", index, f"an integer in [0, {num_parameters})")
    norm = _positive("norm", norm)
    if sign not in (1, -1) or isinstance(sign, bool):
        raise InvalidParameterError("sign", sign, "+1 or -1")
    g = np.zeros(int(num_parameters))
    g[int(index)] = float(sign) * norm
    return GradientCanary(gradient=g)
