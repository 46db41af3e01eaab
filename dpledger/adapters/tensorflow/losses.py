"""Per-example losses: the loss of each record separately, shape ``(B,)``.

Per-example clipping (McMahan & Andrew, Sec. 2: each record's vector is clipped before the sum)
needs ℓ_i(θ) for every record i of the batch, never only their mean. :func:`per_example_loss`
turns what a Keras user already has into a :class:`PerExampleLoss`:

* a ``keras.losses.Loss`` with ``reduction="none"`` (or ``None``) is used as it is;
* a ``keras.losses.Loss`` with any other reduction (``"sum_over_batch_size"``, ``"sum"``,
  ``"mean"``, ``"mean_with_sample_weight"``) hides the per-example terms. With
  ``auto_reduction=True`` (the default) a copy with ``reduction="none"`` is made from the loss's
  config (and logged); otherwise :class:`~dpledger.errors.PerExampleLossError`
  says what to change;
* a string is resolved with ``keras.losses.get`` and then treated as above;
* any other callable ``loss(y_true, y_pred)`` must return a tensor whose leading axis is the
  batch; a scalar is refused when the loss is called.

A loss value of rank > 1 (a sequence model's ``(B, T)`` losses) is averaged over its non-batch
axes, which for equal lengths matches Keras's ``"sum_over_batch_size"`` up to the factor 1/B.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from dpledger.errors import InvalidParameterError, PerExampleLossError

__all__ = ["PerExampleLoss", "per_example_loss"]

_log = logging.getLogger(__name__)

_UNREDUCED = (None, "none")


class PerExampleLoss:
    """A loss returning one value per example: ``loss(y_true, y_pred)`` has shape ``(B,)``.

    Args:
        fn: ``fn(y_true, y_pred)`` returning a tensor with the batch on its leading axis.
        name: a name for messages.
    """

    def __init__(self, fn: Callable[[Any, Any], Any], *, name: str) -> None:
        if not callable(fn):
            raise PerExampleLossError(f"loss={fn!r} is not callable")
        self.fn = fn
        self.name = name

    def __repr__(self) -> str:
        return f"PerExampleLoss(name={self.name!r})"

    def __call__(self, y_true: Any, y_pred: Any) -> tf.Tensor:
        """The per-example losses ℓ_i, shape ``(B,)``.

        Raises:
            PerExampleLossError: when the loss returns a scalar, a non-float tensor, or a
                leading axis whose static length differs from the batch size of ``y_pred``.
        """
        values = tf.convert_to_tensor(self.fn(y_true, y_pred))
        if not values.dtype.is_floating:
            raise PerExampleLossError(
                f"loss {self.name!r} returned dtype {values.dtype.name}; a per-example loss "
                "must return floating-point values"
            )
        if values.shape.rank == 0:
            raise PerExampleLossError(
                f"loss {self.name!r} returned a scalar, so the per-example terms are hidden in a "
                "reduction. Return one value per example (shape (batch,)): for a Keras loss pass "
                "reduction='none', e.g. keras.losses.SparseCategoricalCrossentropy("
                "from_logits=True, reduction='none')"
            )
        batch = _static_batch_size(y_pred)
        lead = values.shape[0]
        if batch is not None and lead is not None and lead != batch:
            raise PerExampleLossError(
                f"loss {self.name!r} returned shape {values.shape.as_list()} for a batch of "
                f"{batch} predictions; its leading axis must be the batch (shape ({batch},))"
            )
        if values.shape.rank is not None and values.shape.rank > 1:
            values = tf.reduce_mean(values, axis=list(range(1, values.shape.rank)))
        return values


def _static_batch_size(y_pred: Any) -> int | None:
    for t in tf.nest.flatten(y_pred):
        shape = getattr(t, "shape", None)
        if shape is not None and len(shape) > 0:
            return tf.TensorShape(shape)[0]
    return None


def _unreduced_copy(loss: keras.losses.Loss) -> keras.losses.Loss:
    config = dict(loss.get_config())
    config["reduction"] = "none"
    copy = type(loss).from_config(config)
    if getattr(copy, "reduction", "missing") not in _UNREDUCED:
        raise TypeError("the copy did not take reduction='none'")
    return copy


def per_example_loss(loss: Any, *, auto_reduction: bool = True) -> PerExampleLoss:
    """Turn a Keras loss, a loss name or a callable into a :class:`PerExampleLoss`.

    Args:
        loss: a ``keras.losses.Loss``, a name understood by ``keras.losses.get``, a callable
            ``loss(y_true, y_pred)`` returning per-example values, or a :class:`PerExampleLoss`.
        auto_reduction: when ``loss`` is a Keras loss whose reduction hides the per-example
            terms, use a copy of it with ``reduction="none"`` instead of raising.

    Returns:
        The per-example loss.

    Raises:
        PerExampleLossError: when ``loss`` is not callable, names no Keras loss, or is a Keras
            loss with a reducing ``reduction`` and ``auto_reduction`` is False (or the loss
            cannot be copied with ``reduction="none"``).
    """
    if isinstance(loss, PerExampleLoss):
        return loss
    if not isinstance(auto_reduction, bool):
        raise InvalidParameterError("auto_reduction", auto_reduction, "True or False")
    if isinstance(loss, str):
        try:
            resolved = keras.losses.get(loss)
        except (ValueError, TypeError) as exc:
            raise PerExampleLossError(
                f"loss={loss!r} names no Keras loss ({exc}); pass a keras.losses.Loss with "
                "reduction='none' or a callable returning one value per example"
            ) from exc
        if resolved is None:
            raise PerExampleLossError(f"loss={loss!r} names no Keras loss")
        return per_example_loss(resolved, auto_reduction=auto_reduction)
    if isinstance(loss, keras.losses.Loss):
        if loss.reduction in _UNREDUCED:
            return PerExampleLoss(loss, name=loss.name)
        hint = (
            f"construct it with reduction='none' (e.g. {type(loss).__name__}(..., "
            "reduction='none')) or pass auto_reduction=True"
        )
        if not auto_reduction:
            raise PerExampleLossError(
                f"loss {loss.name!r} has reduction={loss.reduction!r}, which hides the "
                f"per-example terms that per-example clipping needs; {hint}"
            )
        try:
            copy = _unreduced_copy(loss)
        except Exception as exc:  # a custom Loss whose config cannot be round-tripped
            raise PerExampleLossError(
                f"loss {loss.name!r} has reduction={loss.reduction!r} and could not be copied "
                f"with reduction='none' ({type(exc).__name__}: {exc}); construct it with "
                "reduction='none' yourself"
            ) from exc
        _log.info(
            "loss %r has reduction=%r; using a copy with reduction='none' for per-example losses",
            loss.name,
            loss.reduction,
        )
        return PerExampleLoss(copy, name=copy.name)
    if callable(loss):
        name = getattr(loss, "name", None) or getattr(loss, "__name__", None) or repr(loss)
        return PerExampleLoss(loss, name=str(name))
    raise PerExampleLossError(
        f"loss={loss!r} is not a Keras loss, a loss name or a callable; pass e.g. "
        "keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction='none')"
    )
