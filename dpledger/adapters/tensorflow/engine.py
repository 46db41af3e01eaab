"""Per-example gradient norms and clipped sums for Keras 3 models on TensorFlow.

The engine serves the three stages of a clipped Gaussian sum query (McMahan & Andrew, Sec. 2-3)
for the gradient g_i = ∇_θ ℓ_i of each record i of a batch, variable by variable:

(a) per-example squared norms ‖g_{i,j}‖² of each trainable variable w_j, shape ``(B,)`` each,
    from which a clipping strategy forms group norms;
(b) the strategy's per-example factors f_{i,j} (flat min(1, C/‖g_i‖), global 1{‖g_i‖ ≤ C},
    automatic C/(‖g_i‖ + γ), per-group bounds, joint scaled clipping…) — not the engine's job;
(c) the clipped sums Σ_i f_{i,j} g_{i,j} for each variable, to which noise is then added.

:meth:`PerExampleGradientEngine.norms` does (a) and keeps a *residual*;
:meth:`PerExampleGradientEngine.clipped_sum` does (c) from that residual with factors computed
anywhere in between (no second forward or backward pass); :meth:`clipped_gradients` does
(a)-(c) in one call with an in-graph factor function. All of it runs inside ``tf.function`` on
whatever device the tensors live, and keeps the variables' dtypes.

Two paths compute (a) and (c):

* **fast** — per-example norms without materialising per-example gradients where that is cheaper
  (ghost norm, Li et al. 2022), from the activations and output gradients of the layers that have
  a rule in :mod:`~dpledger.adapters.tensorflow.registry` (Dense, EinsumDense, Conv2D, Embedding,
  LayerNormalization, and SimpleRNN, LSTM, GRU — also inside ``Bidirectional`` — built in; see
  :mod:`~dpledger.adapters.tensorflow.recurrent_rules`). One forward pass and one backward pass
  that stops at the layer outputs (no weight gradients), then the clipped sums by book-keeping:
  per layer, one weight gradient of the rescaled output gradients (Bu et al. 2023). Book-keeping
  rather than a second backward pass on Σ_i f_i ℓ_i — the usual TensorFlow Privacy approach,
  correct because the f_i are constants — because (1) it allows a different factor per variable or
  group, which a reweighted loss cannot express, (2) the factors may be computed outside the
  traced step, and (3) it was faster on every benchmark model (the second backward repeats the
  input-gradient chain through every layer; see benchmarks/RESULTS.md).
* **vectorized** — ``tf.vectorized_map`` of a per-example forward and backward pass
  (:mod:`~dpledger.adapters.tensorflow.vectorized`); works for any differentiable model and
  materialises the B per-example gradients.

``method="auto"`` uses the fast path when every trainable variable belongs to a layer with a
rule, is used only inside that layer's forward, and every such layer sees the whole batch along
axis 0; otherwise it falls back to the vectorised path and logs why, once per engine.

Models whose layers mix the records of a batch are refused with
:class:`~dpledger.adapters.tensorflow.errors.RecordMixingLayerError` (BatchNormalization in
training mode, stateful RNNs): per-example gradients are not defined for them. Recurrent
layers with ``recurrent_dropout`` are refused with
:class:`~dpledger.adapters.tensorflow.errors.UnsupportedLayerError`.

Regularisation losses in ``model.losses`` are not per-example terms and are not included here.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import keras
import tensorflow as tf

from dpledger.adapters.tensorflow import layer_rules as _layer_rules  # noqa: F401 (registers)
from dpledger.adapters.tensorflow.errors import RecordMixingLayerError, UnsupportedLayerError
from dpledger.adapters.tensorflow.losses import PerExampleLoss, per_example_loss
from dpledger.adapters.tensorflow.recurrent_rules import refuse_unsupported_recurrent
from dpledger.adapters.tensorflow.registry import LayerCall, LayerGradientRule, layer_rule
from dpledger.adapters.tensorflow.vectorized import per_example_map
from dpledger.errors import InvalidParameterError

__all__ = [
    "ClippedGradients",
    "PerExampleGradientEngine",
    "PerExampleNorms",
    "check_built",
]

_log = logging.getLogger(__name__)

_METHODS = ("auto", "fast", "vectorized")


@attrs.frozen
class PerExampleNorms:
    """Stage (a) of a step: per-example squared norms, losses, predictions and a residual.

    A ``tf.nest`` structure of tensors, so it can be returned from a ``tf.function``.

    Attributes:
        squared_norms: ‖∂ℓ_i/∂w_j‖² for each trainable variable w_j of the engine, in the order
            of :attr:`PerExampleGradientEngine.trainable_variables`; shape ``(B,)``, the
            variable's dtype.
        losses: the per-example losses ℓ_i (times the sample weights, when given), shape (B,).
        predictions: the model's outputs for the batch.
        residual: what :meth:`PerExampleGradientEngine.clipped_sum` needs (opaque).
    """

    squared_norms: tuple[tf.Tensor, ...]
    losses: tf.Tensor
    predictions: Any
    residual: Any


@attrs.frozen
class ClippedGradients:
    """Stages (a)-(c) of a step.

    Attributes:
        sums: Σ_i f_{i,j} ∂ℓ_i/∂w_j for each trainable variable, its shape and dtype.
        squared_norms: as in :class:`PerExampleNorms`.
        factors: f_{·,j} for each variable, shape ``(B,)``, the variable's dtype.
        losses: the per-example losses, shape ``(B,)``.
        predictions: the model's outputs for the batch.
    """

    sums: tuple[tf.Tensor, ...]
    squared_norms: tuple[tf.Tensor, ...]
    factors: tuple[tf.Tensor, ...]
    losses: tf.Tensor
    predictions: Any


class _FastPathUnsupportedError(Exception):
    """Raised while tracing the fast path when the model turns out to need the other one."""


@attrs.frozen
class _PlanEntry:
    layer: keras.layers.Layer
    rule: LayerGradientRule
    variables: tuple[Any, ...]
    # position of each rule variable in the engine's trainable variables, or None if frozen
    slots: tuple[int | None, ...]


@attrs.frozen
class _Analysis:
    key: tuple[int, ...]
    variables: tuple[Any, ...]
    entries: tuple[_PlanEntry, ...] | None
    fast_unsupported: str | None


def check_built(model: keras.Model) -> None:
    """Refuse a model whose variables do not exist yet (naming the fix)."""
    if not model.built:
        raise InvalidParameterError(
            "model",
            model.name,
            "a built model: call it on a batch or call model.build(input_shape) first",
        )


def _children(layer: keras.layers.Layer) -> list[keras.layers.Layer]:
    flatten = getattr(layer, "_flatten_layers", None)
    if flatten is None:  # pragma: no cover - every Keras 3 layer has it
        return list(getattr(layer, "layers", []))
    return list(flatten(include_self=False, recursive=False))


def _all_layers(model: keras.layers.Layer) -> list[keras.layers.Layer]:
    return list(model._flatten_layers(include_self=False, recursive=True))


def _underlying(variable: Any) -> Any:
    """The ``tf.Variable`` behind a Keras variable (what a GradientTape reports)."""
    value = getattr(variable, "value", None)
    if isinstance(value, tf.Variable):
        return value
    return getattr(variable, "_value", variable)


def _batch_size(inputs: Any) -> tf.Tensor:
    for t in tf.nest.flatten(inputs):
        if t is not None:
            t = tf.convert_to_tensor(t)
            if t.shape.rank is None or t.shape.rank >= 1:
                return tf.shape(t)[0]
    raise InvalidParameterError("inputs", inputs, "a tensor (or structure) with a batch axis")


def _static_batch_size(inputs: Any) -> int | None:
    for t in tf.nest.flatten(inputs):
        if t is not None:
            shape = tf.TensorShape(getattr(t, "shape", None))
            if shape.rank is not None and shape.rank >= 1:
                return shape[0]
    return None


def _graph_token() -> Any:
    return None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()


class _Recorder:
    """Taps registered layers during one traced forward pass of the fast path."""

    def __init__(
        self,
        entries: Sequence[_PlanEntry],
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
        self.graph = _graph_token()
        self.taps: list[tf.Tensor] = []
        self.index_of = {id(entry.layer): i for i, entry in enumerate(entries)}
        # per entry: list of (saved, [tap indices])
        self.calls: list[list[tuple[Any, list[int]]]] = [[] for _ in entries]

    def _tap(self, entry: _PlanEntry, indices: list[int]) -> Callable[[tf.Tensor], tf.Tensor]:
        def tap(z: tf.Tensor) -> tf.Tensor:
            if _graph_token() is not self.graph:
                raise _FastPathUnsupportedError(
                    f"layer {entry.layer.name!r} is called inside a nested function or control "
                    "flow (tf.cond / tf.while_loop / an inner tf.function)"
                )
            z = tf.convert_to_tensor(z)
            lead = z.shape[0] if z.shape.rank else None
            if z.shape.rank == 0:
                raise _FastPathUnsupportedError(f"layer {entry.layer.name!r} returned a scalar")
            if lead is not None and self.static_batch is not None and lead != self.static_batch:
                raise _FastPathUnsupportedError(
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
                                "method='vectorized'."
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
        _CALL_ROUTER.install(layers)
        stack = _active_recorders()
        stack.append(self)
        try:
            yield
        finally:
            stack.pop()
            _CALL_ROUTER.uninstall(layers)

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


def _active_recorders() -> list[_Recorder]:
    stack = getattr(_local, "recorders", None)
    if stack is None:
        stack = _local.recorders = []
    return stack


class _CallRouter:
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


_CALL_ROUTER = _CallRouter()
_MISSING = object()


class PerExampleGradientEngine:
    """Per-example squared gradient norms and clipped sums for a Keras model.

    Args:
        model: a built ``keras.Model`` (functional, sequential or subclassed).
        loss: the per-example loss: a Keras loss with ``reduction="none"``, a Keras loss or loss
            name to switch to ``reduction="none"`` (see ``auto_reduction``), or a callable
            ``loss(y_true, y_pred)`` returning shape ``(B,)``.
        method: ``"auto"`` (fast path, falling back to the vectorised path when the model needs
            it), ``"fast"`` (fast path or :class:`UnsupportedLayerError`), or ``"vectorized"``.
        auto_reduction: switch a Keras loss with a reducing ``reduction`` to ``"none"`` instead
            of raising :class:`PerExampleLossError`.

    Raises:
        InvalidParameterError: for a model that is not a Keras model or a bad ``method``.
        PerExampleLossError: for a loss that cannot give per-example values.

    The model must be built (called once, or ``model.build(shape)``) before the first step.
    The engine calls ``model(inputs, training=True)``.

    Errors raised while a ``tf.function`` with AutoGraph traces a step reach the caller as
    TensorFlow's ``StagingError`` carrying the original message (AutoGraph re-creates only
    exception types with a plain constructor); calling a method once eagerly, or tracing with
    ``autograph=False``, gives the typed error.
    """

    def __init__(
        self,
        model: keras.Model,
        loss: Any,
        *,
        method: str = "auto",
        auto_reduction: bool = True,
    ) -> None:
        if not isinstance(model, keras.Model):
            raise InvalidParameterError("model", model, "a keras.Model")
        if method not in _METHODS:
            raise InvalidParameterError("method", method, f"one of {', '.join(_METHODS)}")
        self._model = model
        self._loss = per_example_loss(loss, auto_reduction=auto_reduction)
        self._method = method
        self._analysis_cache: _Analysis | None = None
        self._fallback_logged = False
        self._while_loops_logged = False
        self._last_path: str | None = None
        self._forced_vectorized: str | None = None
        self._refuse_record_mixing()
        if model.built:
            analysis = self._analysis()
            if method == "fast" and analysis.fast_unsupported is not None:
                self._use_vectorized(analysis.fast_unsupported)

    # ---------------------------------------------------------------- properties

    @property
    def model(self) -> keras.Model:
        """The model."""
        return self._model

    @property
    def loss(self) -> PerExampleLoss:
        """The per-example loss."""
        return self._loss

    @property
    def method(self) -> str:
        """The requested method: ``"auto"``, ``"fast"`` or ``"vectorized"``."""
        return self._method

    @property
    def path(self) -> str | None:
        """The path the last traced step used (``"fast"`` or ``"vectorized"``), or None."""
        return self._last_path

    @property
    def trainable_variables(self) -> tuple[Any, ...]:
        """The model's trainable variables, the order of every per-variable result."""
        return tuple(self._model.trainable_variables)

    # ---------------------------------------------------------------- model analysis

    def _analysis(self) -> _Analysis:
        variables = self.trainable_variables
        key = tuple(id(v) for v in variables)
        cached = self._analysis_cache
        if cached is not None and cached.key == key:
            return cached
        check_built(self._model)
        self._refuse_record_mixing()
        entries, reason = self._plan(variables)
        analysis = _Analysis(key=key, variables=variables, entries=entries, fast_unsupported=reason)
        self._analysis_cache = analysis
        return analysis

    def _refuse_record_mixing(self) -> None:
        for layer in _all_layers(self._model):
            refuse_unsupported_recurrent(layer)
            if isinstance(layer, keras.layers.LayerNormalization):
                self._refuse_batch_axis_normalization(layer)
            if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
                raise RecordMixingLayerError(
                    f"layer {layer.name!r} (BatchNormalization) normalises each example with the "
                    "statistics of the whole batch in training mode, so per-example gradients "
                    "are not defined and clipping them would not bound any record's influence. "
                    "Replace it with keras.layers.GroupNormalization or "
                    "keras.layers.LayerNormalization, or freeze it (layer.trainable = False "
                    "runs it in inference mode with its moving statistics).",
                    layer_name=layer.name,
                    layer_type=type(layer).__name__,
                )

    @staticmethod
    def _refuse_batch_axis_normalization(layer: keras.layers.Layer) -> None:
        axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
        try:
            rank: int | None = len(layer.input.shape)
        except (AttributeError, ValueError):  # not a functional layer: checked when traced
            rank = None
        if any(a == 0 or (rank is not None and a % rank == 0) for a in axes):
            raise RecordMixingLayerError(
                f"layer {layer.name!r} (LayerNormalization) normalises over axis 0, the batch, "
                "so it mixes the records of a batch; normalise over the feature axes (axis=-1)",
                layer_name=layer.name,
                layer_type=type(layer).__name__,
            )

    def _plan(self, variables: tuple[Any, ...]) -> tuple[tuple[_PlanEntry, ...] | None, str | None]:
        if self._method == "vectorized":
            return None, "method='vectorized' was requested"
        slot_of = {id(v): i for i, v in enumerate(variables)}
        entries: list[_PlanEntry] = []
        covered: dict[int, str] = {}
        problems: list[str] = []
        stack = list(reversed(_children(self._model)))
        while stack:
            layer = stack.pop()
            rule = layer_rule(type(layer))
            has_trainable = bool(layer.trainable_variables)
            if rule is None or not has_trainable:
                stack.extend(reversed(_children(layer)))
                continue
            reason = rule.unsupported_reason(layer)
            if reason is not None:
                problems.append(f"layer {layer.name!r} ({type(layer).__name__}): {reason}")
                continue
            rule_vars = tuple(rule.variables(layer))
            for v in rule_vars:
                if id(v) in covered:
                    problems.append(
                        f"variable {v.path!r} is shared by layers {covered[id(v)]!r} and "
                        f"{layer.name!r}"
                    )
                covered[id(v)] = layer.name
            entries.append(
                _PlanEntry(
                    layer=layer,
                    rule=rule,
                    variables=rule_vars,
                    slots=tuple(slot_of.get(id(v)) for v in rule_vars),
                )
            )
        missing = [v for v in variables if id(v) not in covered]
        if missing:
            problems.append(
                "no fast-path rule covers the trainable variable(s) "
                + ", ".join(repr(v.path) for v in missing)
                + " (register a LayerGradientRule for their layer type)"
            )
        if problems:
            return None, "; ".join(problems)
        return tuple(e for e in entries if any(s is not None for s in e.slots)), None

    def _use_vectorized(self, reason: str) -> None:
        if self._method == "fast":
            raise UnsupportedLayerError(
                f"the fast path cannot handle model {self._model.name!r}: {reason}. Use "
                "method='auto' or method='vectorized'.",
                layer_name=self._model.name,
                layer_type=type(self._model).__name__,
            )
        if not self._fallback_logged and self._method == "auto":
            self._fallback_logged = True
            _log.warning(
                "model %r: using the vectorised per-example gradient path (slower, more "
                "memory) because %s",
                self._model.name,
                reason,
            )

    # ---------------------------------------------------------------- public API

    @tf.autograph.experimental.do_not_convert
    def norms(
        self, inputs: Any, targets: Any, *, sample_weight: Any | None = None
    ) -> PerExampleNorms:
        """Stage (a): per-example squared gradient norms of each trainable variable.

        Args:
            inputs: the model's inputs for a batch of B records (tensor or structure).
            targets: the targets passed to the loss as ``y_true`` (or None).
            sample_weight: optional per-example weights w_i, shape (B,); the loss of record i is
                then w_i·ℓ_i.

        Returns:
            The norms, losses, predictions and the residual for :meth:`clipped_sum`.

        Raises:
            RecordMixingLayerError: the model has a BatchNormalization layer in training mode.
            UnsupportedLayerError: with ``method="fast"`` when the fast path cannot be used.
            PerExampleLossError: when the loss does not return per-example values.
        """
        analysis = self._analysis()
        inputs = tf.nest.map_structure(tf.convert_to_tensor, inputs)
        static_batch = _static_batch_size(inputs)
        if static_batch is not None and static_batch > 0:
            return self._dispatch(analysis, inputs, targets, sample_weight, None)
        # The batch may be empty (Poisson sampling). TensorFlow's oneDNN convolutions fail on
        # empty batches, so an empty batch is run as one all-zero record whose loss is masked
        # to 0 (its output gradients are then 0), and the results are cut back to B rows.
        batch = _batch_size(inputs)
        nonempty = batch > 0

        def pad(t: Any) -> Any:
            if t is None:
                return None
            t = tf.convert_to_tensor(t)
            return tf.cond(
                nonempty,
                lambda: t,
                lambda: tf.zeros(tf.concat([[1], tf.shape(t)[1:]], axis=0), t.dtype),
            )

        padded_batch = tf.maximum(batch, 1)
        mask = tf.range(padded_batch) < batch
        result = self._dispatch(
            analysis,
            tf.nest.map_structure(pad, inputs),
            None if targets is None else tf.nest.map_structure(pad, targets),
            None if sample_weight is None else pad(tf.reshape(sample_weight, [-1])),
            mask,
        )

        def cut(t: Any) -> Any:
            return t[:batch] if tf.is_tensor(t) and t.shape.rank else t

        return PerExampleNorms(
            squared_norms=tuple(n[:batch] for n in result.squared_norms),
            losses=result.losses[:batch],
            predictions=tf.nest.map_structure(cut, result.predictions),
            residual={**result.residual, "padding": padded_batch - batch},
        )

    def _dispatch(
        self, analysis: _Analysis, inputs: Any, targets: Any, sample_weight: Any, mask: Any
    ) -> PerExampleNorms:
        if analysis.entries is not None and self._forced_vectorized is None:
            try:
                result = self._fast_norms(analysis, inputs, targets, sample_weight, mask)
                self._last_path = "fast"
                return result
            except _FastPathUnsupportedError as exc:
                self._forced_vectorized = str(exc)
        reason = self._forced_vectorized or analysis.fast_unsupported or "unknown"
        if self._method != "vectorized":
            self._use_vectorized(reason)
        result = self._vectorized_norms(analysis, inputs, targets, sample_weight, mask)
        self._last_path = "vectorized"
        return result

    @tf.autograph.experimental.do_not_convert
    def clipped_sum(
        self, norms: PerExampleNorms, *, factors: tf.Tensor | Sequence[tf.Tensor]
    ) -> tuple[tf.Tensor, ...]:
        """Stage (c): Σ_i f_{i,j} ∂ℓ_i/∂w_j for each trainable variable w_j.

        Args:
            norms: what :meth:`norms` returned for the batch.
            factors: one ``(B,)`` tensor used for every variable, or a sequence with one
                ``(B,)`` tensor per trainable variable (e.g. per-layer clipping).

        Returns:
            One tensor per trainable variable, with its shape and dtype.

        Raises:
            InvalidParameterError: when the number of factor vectors is not 1 or the number of
                trainable variables.
        """
        analysis = self._analysis()
        variables = analysis.variables
        per_variable = self._factors(factors, variables)
        residual = norms.residual
        if "padding" in residual:  # an empty batch was run as one masked record
            per_variable = tuple(tf.pad(f, [[0, residual["padding"]]]) for f in per_variable)
        if "vectorized" in residual:
            return tuple(
                tf.tensordot(f, g, axes=1)
                for f, g in zip(per_variable, residual["vectorized"], strict=True)
            )
        entries = analysis.entries
        if entries is None:
            raise InvalidParameterError(
                "norms", "a fast-path residual", "norms computed by this engine's current model"
            )
        sums: list[tf.Tensor | None] = [None] * len(variables)
        for entry, layer_residual in zip(entries, residual["fast"], strict=True):
            if "calls" not in layer_residual:
                continue  # the layer was not called: its gradient is zero
            layer_residual = layer_residual["calls"]
            ones = None
            rule_factors = []
            for v, slot in zip(entry.variables, entry.slots, strict=True):
                if slot is not None:
                    rule_factors.append(per_variable[slot])
                else:
                    ones = ones if ones is not None else tf.ones_like(per_variable[0], v.dtype)
                    rule_factors.append(tf.cast(ones, v.dtype))
            layer_sums = entry.rule.weighted_sums(entry.layer, layer_residual, rule_factors)
            for slot, s in zip(entry.slots, layer_sums, strict=True):
                if slot is not None:
                    sums[slot] = s
        return tuple(
            tf.zeros(v.shape, v.dtype) if s is None else tf.cast(s, v.dtype)
            for v, s in zip(variables, sums, strict=True)
        )

    @tf.autograph.experimental.do_not_convert
    def clipped_gradients(
        self,
        inputs: Any,
        targets: Any,
        *,
        clip_factors: Callable[[tuple[tf.Tensor, ...]], tf.Tensor | Sequence[tf.Tensor]],
        sample_weight: Any | None = None,
    ) -> ClippedGradients:
        """Stages (a)-(c) in one call, with the factors computed in the same graph.

        Args:
            inputs: the model's inputs for a batch.
            targets: the targets for the loss.
            clip_factors: maps the per-variable squared norms (a tuple of ``(B,)`` tensors) to
                the factors: one ``(B,)`` tensor for all variables, or one per variable.
            sample_weight: optional per-example loss weights, shape (B,).

        Returns:
            The clipped sums with the norms, factors, losses and predictions they came from.
        """
        norms = self.norms(inputs, targets, sample_weight=sample_weight)
        variables = self._analysis().variables
        factors = self._factors(clip_factors(norms.squared_norms), variables)
        sums = self.clipped_sum(norms, factors=factors)
        return ClippedGradients(
            sums=sums,
            squared_norms=norms.squared_norms,
            factors=factors,
            losses=norms.losses,
            predictions=norms.predictions,
        )

    # ---------------------------------------------------------------- helpers

    @staticmethod
    def _factors(
        factors: tf.Tensor | Sequence[tf.Tensor], variables: Sequence[Any]
    ) -> tuple[tf.Tensor, ...]:
        if isinstance(factors, (list, tuple)):
            if len(factors) != len(variables):
                raise InvalidParameterError(
                    "factors",
                    f"a sequence of {len(factors)} tensors",
                    f"one (B,) tensor, or {len(variables)} (one per trainable variable)",
                )
            return tuple(tf.cast(f, v.dtype) for f, v in zip(factors, variables, strict=True))
        f = tf.convert_to_tensor(factors)
        if f.shape.rank is not None and f.shape.rank != 1:
            raise InvalidParameterError(
                "factors", f"a tensor of shape {f.shape.as_list()}", "shape (B,)"
            )
        return tuple(tf.cast(f, v.dtype) for v in variables)

    def _per_example_losses(
        self, targets: Any, predictions: Any, sample_weight: Any, mask: Any = None
    ) -> tf.Tensor:
        losses = self._loss(targets, predictions)
        if sample_weight is not None:
            losses = losses * tf.cast(tf.reshape(sample_weight, [-1]), losses.dtype)
        if mask is not None:
            losses = tf.where(mask, losses, tf.zeros_like(losses))
        return losses

    def _fast_norms(
        self, analysis: _Analysis, inputs: Any, targets: Any, sample_weight: Any, mask: Any
    ) -> PerExampleNorms:
        entries = analysis.entries
        assert entries is not None
        variables = analysis.variables
        batch_size = _batch_size(inputs)
        with (
            tf.GradientTape(watch_accessed_variables=False) as tape,
            tf.GradientTape() as probe,
        ):
            recorder = _Recorder(entries, tape, probe, batch_size, _static_batch_size(inputs))
            with recorder.patched():
                predictions = self._model(inputs, training=True)
            losses = self._per_example_losses(targets, predictions, sample_weight, mask)
            total = tf.reduce_sum(losses)
        trainable = {id(_underlying(v)): v for v in variables}
        stray = [trainable[id(w)] for w in probe.watched_variables() if id(w) in trainable]
        if stray:
            raise _FastPathUnsupportedError(
                "the variable(s) "
                + ", ".join(repr(v.path) for v in stray)
                + " are used outside the forward pass of the layer that owns them"
            )
        if recorder.taps:
            grads = tape.gradient(
                total, recorder.taps, unconnected_gradients=tf.UnconnectedGradients.ZERO
            )
        else:
            grads = []
        norms: list[tf.Tensor | None] = [None] * len(variables)
        residuals: list[Any] = []
        for entry, calls in zip(entries, recorder.calls, strict=True):
            if not calls:
                residuals.append({})
                continue
            layer_calls = [
                LayerCall(saved=saved, output_gradients=tuple(grads[i] for i in indices))
                for saved, indices in calls
            ]
            layer_norms, layer_residual = entry.rule.squared_norms(
                entry.layer, layer_calls, batch_size=batch_size
            )
            residuals.append({"calls": layer_residual})
            for slot, n in zip(entry.slots, layer_norms, strict=True):
                if slot is not None:
                    norms[slot] = n
        squared = tuple(
            tf.zeros(tf.reshape(batch_size, [1]), v.dtype) if n is None else tf.cast(n, v.dtype)
            for v, n in zip(variables, norms, strict=True)
        )
        return PerExampleNorms(
            squared_norms=squared,
            losses=losses,
            predictions=predictions,
            residual={"fast": tuple(residuals)},
        )

    def _vectorized_norms(
        self, analysis: _Analysis, inputs: Any, targets: Any, sample_weight: Any, mask: Any
    ) -> PerExampleNorms:
        variables = analysis.variables
        elems: dict[str, Any] = {"x": inputs}
        if targets is not None:
            elems["y"] = targets
        if sample_weight is not None:
            elems["w"] = tf.reshape(sample_weight, [-1])
        if mask is not None:
            elems["m"] = mask

        @tf.autograph.experimental.do_not_convert
        def one(e: dict[str, Any]) -> tuple[Any, ...]:
            x = tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), e["x"])
            y = tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), e["y"]) if "y" in e else None
            with tf.GradientTape() as tape:
                predictions = self._model(x, training=True)
                loss = self._per_example_losses(
                    y,
                    predictions,
                    tf.expand_dims(e["w"], 0) if "w" in e else None,
                    tf.expand_dims(e["m"], 0) if "m" in e else None,
                )
                total = tf.reduce_sum(loss)
            grads = tape.gradient(
                total, list(variables), unconnected_gradients=tf.UnconnectedGradients.ZERO
            )
            squeezed = tf.nest.map_structure(lambda t: tf.squeeze(t, 0), predictions)
            dense = tuple(tf.convert_to_tensor(g) for g in grads)  # IndexedSlices → dense
            return dense, tf.reshape(loss, []), squeezed

        recurrent = [
            layer.name for layer in _all_layers(self._model) if isinstance(layer, keras.layers.RNN)
        ]
        in_loop = (
            f"tf.vectorized_map cannot vectorise the recurrent layer(s) {', '.join(recurrent)}"
            if recurrent
            else None
        )
        (grads, losses, predictions), loops = per_example_map(one, elems, in_loop=in_loop)
        if loops and not self._while_loops_logged:
            self._while_loops_logged = True
            _log.warning(
                "model %r: the vectorised path runs some ops one example at a time in a "
                "tf.while_loop because they have no vectorised (pfor) converter: %s",
                self._model.name,
                "; ".join(loops),
            )
        squared = tuple(
            tf.reduce_sum(tf.square(g), axis=list(range(1, g.shape.rank))) for g in grads
        )
        return PerExampleNorms(
            squared_norms=squared,
            losses=losses,
            predictions=predictions,
            residual={"vectorized": tuple(grads)},
        )
