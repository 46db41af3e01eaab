"""A warning when the model inside a :class:`~dpledger.adapters.tensorflow.DPKerasModel` is
trained directly.

After ``dp_model = DPKerasModel(model, ...)``, ``model.fit(...)``, ``model.train_on_batch(...)``
or ``model.train_step(...)`` would update the same weights with ordinary, non-private steps that
the ledger never sees: the ε the ledger gives would then not describe the trained weights.
:func:`warn_on_direct_training` makes those three methods of the wrapped model warn
(:class:`~dpledger.errors.UnrecordedTrainingWarning` and a log record), once
per call, before they run. The wrapper's own steps call the model's forward pass, never these
methods, and ``predict`` / ``evaluate`` are left alone, so neither warns.

The other way round, compiling the inner model and calling ``fit`` on the wrapper:
:func:`check_wrapper_compiled` says that the wrapper is the model to compile.
"""

from __future__ import annotations

import functools
import logging
import threading
import warnings
from collections.abc import Callable
from typing import Any

import keras

from dpledger.errors import NotCompiledError, UnrecordedTrainingWarning

__all__ = ["GUARDED_METHODS", "check_wrapper_compiled", "warn_on_direct_training"]

_log = logging.getLogger(__name__)

GUARDED_METHODS = ("fit", "train_on_batch", "train_step")
"""The methods of a wrapped model that take training steps."""

_MARK = "_dpledger_wrapper_name"
_inside = threading.local()  # depth of guarded calls in this thread (fit calls train_step)


def _message(model: keras.Model, method: str) -> str:
    return (
        f"model {model.name!r} is wrapped by the DPKerasModel "
        f"{getattr(model, _MARK, '?')!r}: its own {method}() takes steps that are NOT private "
        "and are NOT recorded in the ledger, so the ledger's ε would not describe the trained "
        "weights. Train the DPKerasModel instead (dp_model.fit / dp_model.train_on_batch)."
    )


def _guarded(model: keras.Model, method: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        depth = getattr(_inside, "depth", 0)
        if depth == 0:
            message = _message(model, method)
            warnings.warn(message, UnrecordedTrainingWarning, stacklevel=2)
            _log.warning(message)
        _inside.depth = depth + 1
        try:
            return original(*args, **kwargs)
        finally:
            _inside.depth = depth

    return guarded


def warn_on_direct_training(model: keras.Model, *, wrapper_name: str) -> None:
    """Make ``model``'s :data:`GUARDED_METHODS` warn that their steps are neither private nor
    recorded (once per outermost call: ``fit`` does not warn again for each ``train_step``).

    The methods are replaced on the instance only (its class and other models are unchanged);
    a model wrapped again keeps one guard and names the latest wrapper.

    Args:
        model: the wrapped Keras model.
        wrapper_name: the name of the :class:`~dpledger.adapters.tensorflow.DPKerasModel`, for
            the message.
    """
    guarded = getattr(model, _MARK, None) is not None
    object.__setattr__(model, _MARK, wrapper_name)
    if guarded:
        return
    for method in GUARDED_METHODS:
        object.__setattr__(model, method, _guarded(model, method, getattr(model, method)))


def check_wrapper_compiled(wrapper: keras.Model, inner: keras.Model, method: str) -> None:
    """Refuse ``wrapper.<method>`` before the wrapper itself was compiled.

    Raises:
        NotCompiledError: the wrapper was not compiled; the message says that the wrapper, not
            the model inside it, is the one to compile (with the inner model's optimizer and
            loss when the inner model was compiled instead).
    """
    if getattr(wrapper, "compiled", False):
        return
    if getattr(inner, "compiled", False):
        optimizer = type(getattr(inner, "optimizer", None)).__name__
        loss = getattr(inner, "loss", None)
        shown = type(loss).__name__ if not isinstance(loss, str) else repr(loss)
        what = (
            f"the model inside it was compiled (optimizer {optimizer}, loss {shown}), but the "
            "DPKerasModel was not: compile the DPKerasModel instead, e.g. "
            "dp_model.compile(optimizer=..., loss=...) with that optimizer and loss (its "
            "steps use the wrapper's optimizer and loss; the inner model's compile is not used)"
        )
    else:
        what = "call dp_model.compile(optimizer=..., loss=...) on the DPKerasModel first"
    raise NotCompiledError(f"DPKerasModel.{method}() before DPKerasModel.compile(): {what}")
