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

* **ghost** (the fast path) — per-example norms without materialising per-example gradients
  where that is cheaper
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
* **generic** (the vectorised path) — ``tf.vectorized_map`` of a per-example forward and
  backward pass
  (:mod:`~dpledger.adapters.tensorflow.vectorized`); works for any differentiable model and
  materialises the B per-example gradients.

``strategy="auto"`` uses the fast path when every trainable variable belongs to a layer with a
rule, is used only inside that layer's forward, and every such layer sees the whole batch along
axis 0; otherwise it falls back to the vectorised path and logs why, once per engine.

Models whose layers mix the records of a batch are refused with
:class:`~dpledger.errors.RecordMixingLayerError` (BatchNormalization in
training mode, stateful RNNs): per-example gradients are not defined for them. Recurrent
layers with ``recurrent_dropout`` are refused with
:class:`~dpledger.errors.UnsupportedLayerError`.

Regularisation losses in ``model.losses`` are not per-example terms and are not included here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import keras
import tensorflow as tf

from dpledger.adapters.tensorflow import layer_rules as _layer_rules  # noqa: F401 (registers)
from dpledger.adapters.tensorflow.layer_taps import (
    FastPathUnsupportedError,
    batch_size_of,
    static_batch_size,
)
from dpledger.adapters.tensorflow.losses import PerExampleLoss, per_example_loss
from dpledger.adapters.tensorflow.model_plan import (
    ModelAnalysis,
    fast_path_plan,
    refuse_record_mixing,
)
from dpledger.adapters.tensorflow.norm_paths import (
    NormBatch,
    PerExampleNorms,
    fast_norms,
    vectorized_norms,
)
from dpledger.errors import InvalidParameterError, UnsupportedLayerError

__all__ = [
    "ClippedGradients",
    "PerExampleGradientEngine",
    "PerExampleNorms",
    "check_built",
    "engine_strategy",
]

_log = logging.getLogger(__name__)

_STRATEGIES = ("auto", "ghost", "generic")


def engine_strategy(strategy: str | None) -> str:
    """The engine's ``strategy`` (``"auto"``, ``"ghost"``, ``"generic"``; None: ``"auto"``).

    Raises:
        InvalidParameterError: a value outside the strategies (``"per_example"`` has no
            TensorFlow engine).
    """
    strategy = "auto" if strategy is None else strategy
    if not isinstance(strategy, str) or strategy not in _STRATEGIES:
        raise InvalidParameterError(
            "strategy",
            strategy,
            "'auto', 'ghost' or 'generic' with TensorFlow ('generic' materialises the "
            "per-example gradients of any model; 'per_example' is PyTorch only)",
        )
    return strategy


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


def check_built(model: keras.Model) -> None:
    """Refuse a model whose variables do not exist yet (naming the fix)."""
    if not model.built:
        raise InvalidParameterError(
            "model",
            model.name,
            "a built model: call it on a batch or call model.build(input_shape) first",
        )


class PerExampleGradientEngine:
    """Per-example squared gradient norms and clipped sums for a Keras model.

    Args:
        model: a built ``keras.Model`` (functional, sequential or subclassed).
        loss: the per-example loss: a Keras loss with ``reduction="none"``, a Keras loss or loss
            name to switch to ``reduction="none"`` (see ``auto_reduction``), or a callable
            ``loss(y_true, y_pred)`` returning shape ``(B,)``.
        strategy: ``"auto"`` (fast path, falling back to the vectorised path when the model
            needs it), ``"ghost"`` (fast path or :class:`UnsupportedLayerError`), or
            ``"generic"`` (the vectorised path); the values of
            :attr:`~dpledger.mechanisms.DPConfig.strategy` (``"per_example"`` is PyTorch only).
        auto_reduction: switch a Keras loss with a reducing ``reduction`` to ``"none"`` instead
            of raising :class:`PerExampleLossError`.

    Raises:
        InvalidParameterError: for a model that is not a Keras model or a bad ``strategy``.
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
        strategy: str = "auto",
        auto_reduction: bool = True,
    ) -> None:
        if not isinstance(model, keras.Model):
            raise InvalidParameterError("model", model, "a keras.Model")
        strategy = engine_strategy(strategy)
        self._model = model
        self._loss = per_example_loss(loss, auto_reduction=auto_reduction)
        self._strategy = strategy
        self._analysis_cache: ModelAnalysis | None = None
        self._fallback_logged = False
        self._while_loops_logged = False
        self._last_path: str | None = None
        self._forced_vectorized: str | None = None
        refuse_record_mixing(self._model)
        if model.built:
            analysis = self._analysis()
            if strategy == "ghost" and analysis.fast_unsupported is not None:
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
    def strategy(self) -> str:
        """The requested strategy: ``"auto"``, ``"ghost"`` or ``"generic"``."""
        return self._strategy

    @property
    def path(self) -> str | None:
        """The path the last traced step used (``"ghost"`` or ``"generic"``), or None."""
        return self._last_path

    @property
    def trainable_variables(self) -> tuple[Any, ...]:
        """The model's trainable variables, the order of every per-variable result."""
        return tuple(self._model.trainable_variables)

    # ---------------------------------------------------------------- model analysis

    def _analysis(self) -> ModelAnalysis:
        variables = self.trainable_variables
        key = tuple(id(v) for v in variables)
        cached = self._analysis_cache
        if cached is not None and cached.key == key:
            return cached
        check_built(self._model)
        refuse_record_mixing(self._model)
        entries, reason = fast_path_plan(self._model, variables, strategy=self._strategy)
        analysis = ModelAnalysis(
            key=key, variables=variables, entries=entries, fast_unsupported=reason
        )
        self._analysis_cache = analysis
        return analysis

    def _use_vectorized(self, reason: str) -> None:
        if self._strategy == "ghost":
            raise UnsupportedLayerError(
                f"the fast path cannot handle model {self._model.name!r}: {reason}. Use "
                "strategy='auto' or strategy='generic'.",
                layer_name=self._model.name,
                layer_type=type(self._model).__name__,
            )
        if not self._fallback_logged and self._strategy == "auto":
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
            UnsupportedLayerError: with ``strategy="ghost"`` when the fast path cannot be used.
            PerExampleLossError: when the loss does not return per-example values.
        """
        analysis = self._analysis()
        inputs = tf.nest.map_structure(tf.convert_to_tensor, inputs)
        static_batch = static_batch_size(inputs)
        if static_batch is not None and static_batch > 0:
            return self._dispatch(analysis, inputs, targets, sample_weight, None)
        # The batch may be empty (Poisson sampling). TensorFlow's oneDNN convolutions fail on
        # empty batches, so an empty batch is run as one all-zero record whose loss is masked
        # to 0 (its output gradients are then 0), and the results are cut back to B rows.
        batch = batch_size_of(inputs)
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
        self, analysis: ModelAnalysis, inputs: Any, targets: Any, sample_weight: Any, mask: Any
    ) -> PerExampleNorms:
        if analysis.entries is not None and self._forced_vectorized is None:
            try:
                result = self._fast_norms(analysis, inputs, targets, sample_weight, mask)
                self._last_path = "ghost"
                return result
            except FastPathUnsupportedError as exc:
                self._forced_vectorized = str(exc)
        reason = self._forced_vectorized or analysis.fast_unsupported or "unknown"
        if self._strategy != "generic":
            self._use_vectorized(reason)
        result = self._vectorized_norms(analysis, inputs, targets, sample_weight, mask)
        self._last_path = "generic"
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

    def _fast_norms(
        self, analysis: ModelAnalysis, inputs: Any, targets: Any, sample_weight: Any, mask: Any
    ) -> PerExampleNorms:
        batch = NormBatch(inputs, targets, sample_weight, mask)
        return fast_norms(self._model, self._loss, analysis, batch)

    def _vectorized_norms(
        self, analysis: ModelAnalysis, inputs: Any, targets: Any, sample_weight: Any, mask: Any
    ) -> PerExampleNorms:
        batch = NormBatch(inputs, targets, sample_weight, mask)
        norms, loops = vectorized_norms(self._model, self._loss, analysis, batch)
        if loops and not self._while_loops_logged:
            self._while_loops_logged = True
            _log.warning(
                "model %r: the vectorised path runs some ops one example at a time in a "
                "tf.while_loop because they have no vectorised (pfor) converter: %s",
                self._model.name,
                "; ".join(loops),
            )
        return norms
