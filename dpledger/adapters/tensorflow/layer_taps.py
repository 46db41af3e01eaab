"""The fast path's taps: while the engine traces one forward pass, each call of a layer that
has a rule is routed through the rule's ``forward``, whose outputs are watched by the gradient
tape (the layer's output gradients give the ghost norms and the book-keeping sums).

The routing is an instance-level ``call`` installed, reference-counted, on the planned layers
(:class:`CallRouter`), dispatching to the recorder active in the calling thread
(``tf.distribute`` traces replicas in threads). A tap refuses what would make the per-example
norms wrong (a layer that does not see the batch along axis 0, a call inside nested control
flow) with :class:`FastPathUnsupportedError`, on which the engine falls back to the vectorised
path.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf

from dpledger.adapters.tensorflow.model_plan import PlanEntry
from dpledger.errors import InvalidParameterError

__all__ = [
    "CALL_ROUTER",
    "CallRouter",
    "FastPathUnsupportedError",
    "LayerRecorder",
    "batch_size_of",
    "graph_token",
    "static_batch_size",
    "underlying_variable",
]


class FastPathUnsupportedError(Exception):
    """Raised while tracing the fast path when the model turns out to need the other one."""


def underlying_variable(variable: Any) -> Any:
    """The ``tf.Variable`` behind a Keras variable (what a GradientTape reports)."""
    value = getattr(variable, "value", None)
    if isinstance(value, tf.Variable):
        return value
    return getattr(variable, "_value", variable)


def batch_size_of(inputs: Any) -> tf.Tensor:
    """The batch size of ``inputs``: the leading axis of its first tensor with one."""
    for t in tf.nest.flatten(inputs):
        if t is not None:
            t = tf.convert_to_tensor(t)
            if t.shape.rank is None or t.shape.rank >= 1:
                return tf.shape(t)[0]
    raise InvalidParameterError("inputs", inputs, "a tensor (or structure) with a batch axis")


def static_batch_size(inputs: Any) -> int | None:
    """The batch size of ``inputs`` when known at trace time, else None."""
    for t in tf.nest.flatten(inputs):
        if t is not None:
            shape = tf.TensorShape(getattr(t, "shape", None))
            if shape.rank is not None and shape.rank >= 1:
                return shape[0]
    return None


def graph_token() -> Any:
    """The graph being traced (None when eager): taps refuse calls from another graph."""
    return None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()


class LayerRecorder:
    """Taps registered layers during one traced forward pass of the fast path."""

    def __init__(
        self,
        entries: Sequence[PlanEntry],
        tape: tf.GradientTape,
        probe: tf.GradientTape,
        batch_size: tf.Tensor,
        static_batch: int | None,
    ) -> None:
        self.entries = entries
        self.tape = tape
        self.probe = probe
        self.batch_size = batch_size
        self.static_batch = static_batch
        self.graph = graph_token()
        self.taps: list[tf.Tensor] = []
        self.index_of = {id(entry.layer): i for i, entry in enumerate(entries)}
        # per entry: list of (saved, [tap indices])
        self.calls: list[list[tuple[Any, list[int]]]] = [[] for _ in entries]

    def _tap(self, entry: PlanEntry, indices: list[int]) -> Callable[[tf.Tensor], tf.Tensor]:
        def tap(z: tf.Tensor) -> tf.Tensor:
            if graph_token() is not self.graph:
                raise FastPathUnsupportedError(
                    f"layer {entry.layer.name!r} is called inside a nested function or control "
                    "flow (tf.cond / tf.while_loop / an inner tf.function)"
                )
            z = tf.convert_to_tensor(z)
            lead = z.shape[0] if z.shape.rank else None
            if z.shape.rank == 0:
                raise FastPathUnsupportedError(f"layer {entry.layer.name!r} returned a scalar")
            if lead is not None and self.static_batch is not None and lead != self.static_batch:
                raise FastPathUnsupportedError(
                    f"layer {entry.layer.name!r} sees a leading axis of {lead} for a batch of "
                    f"{self.static_batch} (the model reshapes the batch axis)"
                )
            if lead is None or self.static_batch is None:
                with tf.control_dependencies(
                    [
                        tf.debugging.assert_equal(
                            tf.shape(z)[0],
                            self.batch_size,
                            message=(
                                f"layer {entry.layer.name!r} does not see the batch along axis "
                                "0; per-example norms of the fast path would be wrong. Use "
                                "strategy='generic'."
                            ),
                        )
                    ]
                ):
                    z = tf.identity(z)
            self.tape.watch(z)
            indices.append(len(self.taps))
            self.taps.append(z)
            return z

        return tap

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        """Route calls of the planned layers, made by this thread, through :meth:`call`."""
        layers = [entry.layer for entry in self.entries]
        CALL_ROUTER.install(layers)
        stack = _active_recorders()
        stack.append(self)
        try:
            yield
        finally:
            stack.pop()
            CALL_ROUTER.uninstall(layers)

    def call(self, layer: keras.layers.Layer, original: Callable, args: Any, kwargs: Any) -> Any:
        """The tapped forward of one call of ``layer``, or its own ``call`` if not planned."""
        index = self.index_of.get(id(layer))
        if index is None:
            return original(*args, **kwargs)
        entry = self.entries[index]
        indices: list[int] = []
        with self.probe.stop_recording():
            outputs, saved = entry.rule.forward(
                entry.layer, original, args, kwargs, self._tap(entry, indices)
            )
        self.calls[index].append((saved, indices))
        return outputs


_local = threading.local()


def _active_recorders() -> list[LayerRecorder]:
    stack = getattr(_local, "recorders", None)
    if stack is None:
        stack = _local.recorders = []
    return stack


class CallRouter:
    """Installs, reference-counted, an instance-level ``call`` on layers that dispatches to the
    recorder active in the calling thread (``tf.distribute`` traces replicas in threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._installed: dict[int, tuple[int, Any]] = {}  # id(layer) -> (count, previous)

    def install(self, layers: Sequence[keras.layers.Layer]) -> None:
        with self._lock:
            for layer in layers:
                count, previous = self._installed.get(id(layer), (0, None))
                if count == 0:
                    previous = layer.__dict__.get("call", _MISSING)
                    object.__setattr__(layer, "call", self._router(layer, layer.call))
                self._installed[id(layer)] = (count + 1, previous)

    def uninstall(self, layers: Sequence[keras.layers.Layer]) -> None:
        with self._lock:
            for layer in layers:
                count, previous = self._installed[id(layer)]
                if count > 1:
                    self._installed[id(layer)] = (count - 1, previous)
                    continue
                del self._installed[id(layer)]
                if previous is _MISSING:
                    object.__delattr__(layer, "call")
                else:
                    object.__setattr__(layer, "call", previous)

    @staticmethod
    def _router(layer: keras.layers.Layer, original: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            stack = _active_recorders()
            if not stack:
                return original(*args, **kwargs)
            return stack[-1].call(layer, original, args, kwargs)

        return call


CALL_ROUTER = CallRouter()
_MISSING = object()
