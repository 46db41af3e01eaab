"""Stage (a) of the engine's step, the per-example squared gradient norms, on its two paths:
the fast path (taps on the layers that have a rule, one backward pass to their outputs, the
rules' ghost norms) and the vectorised path (``tf.vectorized_map`` of a per-example forward and
backward pass). :class:`~dpledger.adapters.tensorflow.engine.PerExampleGradientEngine` chooses
the path and keeps what each leaves for the clipped sums (the residual).
"""

from __future__ import annotations

from typing import Any

import attrs
import keras
import tensorflow as tf

from dpledger.adapters.tensorflow.layer_taps import (
    FastPathUnsupportedError,
    LayerRecorder,
    batch_size_of,
    static_batch_size,
    underlying_variable,
)
from dpledger.adapters.tensorflow.losses import PerExampleLoss
from dpledger.adapters.tensorflow.model_plan import ModelAnalysis, all_layers
from dpledger.adapters.tensorflow.registry import LayerCall
from dpledger.adapters.tensorflow.vectorized import per_example_map

__all__ = [
    "NormBatch",
    "PerExampleNorms",
    "fast_norms",
    "per_example_losses",
    "vectorized_norms",
]


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
class NormBatch:
    """A batch for stage (a): the model's inputs, the loss's targets, the optional per-example
    loss weights and the optional mask of the records that count (padding rows excluded)."""

    inputs: Any
    targets: Any
    sample_weight: Any
    mask: Any


def per_example_losses(
    loss: PerExampleLoss, targets: Any, predictions: Any, sample_weight: Any, mask: Any = None
) -> tf.Tensor:
    """ℓ_i for each record: the loss times the sample weights, 0 where ``mask`` is False."""
    losses = loss(targets, predictions)
    if sample_weight is not None:
        losses = losses * tf.cast(tf.reshape(sample_weight, [-1]), losses.dtype)
    if mask is not None:
        losses = tf.where(mask, losses, tf.zeros_like(losses))
    return losses


def fast_norms(
    model: keras.Model, loss: PerExampleLoss, analysis: ModelAnalysis, batch: NormBatch
) -> PerExampleNorms:
    """Stage (a) on the fast path: one forward pass with the planned layers tapped, one
    backward pass to their outputs, and each rule's ghost norms.

    Raises:
        FastPathUnsupportedError: the model needs the vectorised path.
    """
    inputs, targets, sample_weight, mask = attrs.astuple(batch, recurse=False)
    entries = analysis.entries
    assert entries is not None
    variables = analysis.variables
    batch_size = batch_size_of(inputs)
    with (
        tf.GradientTape(watch_accessed_variables=False) as tape,
        tf.GradientTape() as probe,
    ):
        recorder = LayerRecorder(entries, tape, probe, batch_size, static_batch_size(inputs))
        with recorder.patched():
            predictions = model(inputs, training=True)
        losses = per_example_losses(loss, targets, predictions, sample_weight, mask)
        total = tf.reduce_sum(losses)
    trainable = {id(underlying_variable(v)): v for v in variables}
    stray = [trainable[id(w)] for w in probe.watched_variables() if id(w) in trainable]
    if stray:
        raise FastPathUnsupportedError(
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


def vectorized_norms(
    model: keras.Model, loss: PerExampleLoss, analysis: ModelAnalysis, batch: NormBatch
) -> tuple[PerExampleNorms, list[str]]:
    """Stage (a) on the vectorised path: ``tf.vectorized_map`` of a per-example forward and
    backward pass, materialising the B per-example gradients.

    Returns:
        The norms, and the ops that ran one example at a time in a ``tf.while_loop``.
    """
    inputs, targets, sample_weight, mask = attrs.astuple(batch, recurse=False)
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
            predictions = model(x, training=True)
            example_loss = per_example_losses(
                loss,
                y,
                predictions,
                tf.expand_dims(e["w"], 0) if "w" in e else None,
                tf.expand_dims(e["m"], 0) if "m" in e else None,
            )
            total = tf.reduce_sum(example_loss)
        grads = tape.gradient(
            total, list(variables), unconnected_gradients=tf.UnconnectedGradients.ZERO
        )
        squeezed = tf.nest.map_structure(lambda t: tf.squeeze(t, 0), predictions)
        dense = tuple(tf.convert_to_tensor(g) for g in grads)  # IndexedSlices → dense
        return dense, tf.reshape(example_loss, []), squeezed

    recurrent = [layer.name for layer in all_layers(model) if isinstance(layer, keras.layers.RNN)]
    in_loop = (
        f"tf.vectorized_map cannot vectorise the recurrent layer(s) {', '.join(recurrent)}"
        if recurrent
        else None
    )
    (grads, losses, predictions), loops = per_example_map(one, elems, in_loop=in_loop)
    squared = tuple(tf.reduce_sum(tf.square(g), axis=list(range(1, g.shape.rank))) for g in grads)
    return PerExampleNorms(
        squared_norms=squared,
        losses=losses,
        predictions=predictions,
        residual={"vectorized": tuple(grads)},
    ), loops
