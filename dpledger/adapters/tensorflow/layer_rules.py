"""Fast-path rules for Dense, EinsumDense, Conv2D, Embedding and LayerNormalization.

Notation: B records, activations A_i ∈ R^{T×K} (T positions: 1 for a plain Dense, the sequence
positions for a Dense on a sequence, the output pixels with their K = k_h·k_w·C_in input patch
for a convolution), output gradients G_i ∈ R^{T×C}. A linear layer's per-example kernel
gradient is A_iᵀ G_i, and

    ‖A_iᵀ G_i‖²_F = ⟨A_i A_iᵀ, G_i G_iᵀ⟩_F                       (ghost norm, Li et al. 2022)

costs O(T²(K + C)) instead of O(T·K·C) for materialising A_iᵀ G_i; for T = 1 it is
‖a_i‖²‖g_i‖². Each rule takes the cheaper of the two for the static shapes at hand. The clipped
sum Σ_i f_i A_iᵀ G_i is then one ordinary weight gradient with the output gradients rescaled,
(A)ᵀ (f ⊙ G) — a single matmul, or one ``Conv2DBackpropFilter`` for a convolution — or, when the
per-example gradients were materialised for the norm, the contraction Σ_i f_i (A_iᵀ G_i).

Biases: ∂ℓ_i/∂b = Σ_t G_{i,t}. Embedding: the per-example gradient of the table adds the output
gradients of equal ids, so the norm is computed over the distinct (record, id) pairs.
LayerNormalization: ∂ℓ_i/∂γ = Σ G_i ⊙ x̂_i, ∂ℓ_i/∂β = Σ G_i over the non-parameter axes, with x̂ the
normalised input.

Every rule computes in the dtype of the variable it differentiates, and returns tensors in it.

The rules live in this module (Dense, Embedding, LayerNormalization),
:mod:`~dpledger.adapters.tensorflow.einsum_rule`, :mod:`~dpledger.adapters.tensorflow.conv_rule`
and :mod:`~dpledger.adapters.tensorflow.recurrent_rules`; their shared algebra is in
:mod:`~dpledger.adapters.tensorflow.rule_algebra`. Importing this module registers them all
but the recurrent ones.
"""

from __future__ import annotations

import warnings

import keras
import tensorflow as tf

from dpledger.adapters.tensorflow.conv_rule import Conv2DRule
from dpledger.adapters.tensorflow.einsum_rule import EinsumDenseRule
from dpledger.adapters.tensorflow.errors import RecordMixingLayerError
from dpledger.adapters.tensorflow.registry import LayerGradientRule, register_layer_rule
from dpledger.adapters.tensorflow.rule_algebra import (
    _common_unsupported,
    _concat_positions,
    _contract,
    _first_input,
    _LinearKernelRule,
    _positions,
    _records,
    _rows_sq,
    _scale_records,
)

__all__ = [
    "Conv2DRule",
    "DenseRule",
    "EinsumDenseRule",
    "EmbeddingRule",
    "LayerNormalizationRule",
]


# --------------------------------------------------------------------------------------------
# Dense


class DenseRule(_LinearKernelRule):
    """``keras.layers.Dense``: z = x W + b on the last axis of x, y = activation(z)."""

    def unsupported_reason(self, layer: keras.layers.Layer) -> str | None:
        """See :meth:`LayerGradientRule.unsupported_reason`."""
        return _common_unsupported(layer)

    def variables(self, layer: keras.layers.Layer) -> tuple[keras.Variable, ...]:
        """(kernel, bias) or (kernel,)."""
        return (layer.kernel,) if layer.bias is None else (layer.kernel, layer.bias)

    def forward(self, layer, call, args, kwargs, tap):
        """See :meth:`LayerGradientRule.forward`."""
        x = _first_input(args, kwargs)
        z = keras.ops.matmul(x, layer.kernel)
        if layer.bias is not None:
            z = keras.ops.add(z, layer.bias)
        z = tap(z)
        return (layer.activation(z) if layer.activation is not None else z), x

    def squared_norms(self, layer, calls, *, batch_size):
        """See :meth:`LayerGradientRule.squared_norms`."""
        dtype = layer.kernel.dtype
        a = _concat_positions([_positions(c.saved, batch_size, dtype) for c in calls])
        g = _concat_positions([_positions(c.output_gradients[0], batch_size, dtype) for c in calls])
        kernel_sq, kernel_res = self._kernel_terms(a, g)
        if layer.bias is None:
            return (kernel_sq,), (kernel_res,)
        bias_pe = tf.reduce_sum(g, axis=1)
        return (kernel_sq, _rows_sq(bias_pe)), (kernel_res, bias_pe)

    def weighted_sums(self, layer, residual, factors):
        """See :meth:`LayerGradientRule.weighted_sums`."""
        sums = [self._kernel_sum(residual[0], factors[0])]
        if layer.bias is not None:
            sums.append(_contract(factors[1], residual[1]))
        return tuple(sums)


# --------------------------------------------------------------------------------------------
# Embedding


class EmbeddingRule(LayerGradientRule):
    """``keras.layers.Embedding``: y = E[ids].

    ∂ℓ_i/∂E adds the output gradients of the positions of record i that hold the same id, so
    ‖∂ℓ_i/∂E‖² = Σ_v ‖Σ_{t: id_{i,t} = v} G_{i,t}‖², computed over the distinct (i, v) pairs.
    The clipped sum scatters the rescaled output gradients into a dense table.
    """

    def unsupported_reason(self, layer: keras.layers.Layer) -> str | None:
        """See :meth:`LayerGradientRule.unsupported_reason`."""
        return _common_unsupported(layer)

    def variables(self, layer: keras.layers.Layer) -> tuple[keras.Variable, ...]:
        """(embeddings,)."""
        return (layer.embeddings,)

    def forward(self, layer, call, args, kwargs, tap):
        """See :meth:`LayerGradientRule.forward`."""
        ids = _first_input(args, kwargs)
        if ids.dtype not in ("int32", "int64", tf.int32, tf.int64):
            ids = keras.ops.cast(ids, "int32")
        out = keras.ops.take(layer.embeddings, ids, axis=0)
        out = tap(keras.ops.cast(out, layer.compute_dtype))
        return out, ids

    def squared_norms(self, layer, calls, *, batch_size):
        """See :meth:`LayerGradientRule.squared_norms`."""
        dtype = layer.embeddings.dtype
        dim = layer.embeddings.shape[-1]
        ids = _concat_positions([_records(tf.cast(c.saved, tf.int64), batch_size) for c in calls])
        g = _concat_positions([_positions(c.output_gradients[0], batch_size, dtype) for c in calls])
        if ids.shape[1] == 1:
            norms = _rows_sq(g)
        else:
            vocab = tf.constant(layer.embeddings.shape[0], tf.int64)
            record = tf.range(tf.cast(batch_size, tf.int64), dtype=tf.int64)[:, None]
            keys = tf.reshape(record * vocab + ids, [-1])
            unique, index = tf.unique(keys, out_idx=tf.int64)
            summed = tf.math.unsorted_segment_sum(
                tf.reshape(g, [-1, dim]), index, tf.size(unique, out_type=tf.int64)
            )
            norms = tf.math.unsorted_segment_sum(
                tf.reduce_sum(tf.square(summed), axis=1), unique // vocab, batch_size
            )
        return (norms,), ((ids, g),)

    def weighted_sums(self, layer, residual, factors):
        """See :meth:`LayerGradientRule.weighted_sums`."""
        ids, g = residual[0]
        dim = layer.embeddings.shape[-1]
        scaled = _scale_records(g, factors[0])
        table = tf.math.unsorted_segment_sum(
            tf.reshape(scaled, [-1, dim]), tf.reshape(ids, [-1]), layer.embeddings.shape[0]
        )
        return (table,)


# --------------------------------------------------------------------------------------------
# LayerNormalization


class LayerNormalizationRule(LayerGradientRule):
    """``keras.layers.LayerNormalization``: y = γ ⊙ x̂ + β over ``layer.axis``.

    The forward is Keras's own; x̂ is recomputed from the saved input for the norms with Keras's
    ``ops.layer_normalization`` without γ and β (x̂ = (x − mean)/√(var + ε), or x/√(var + ε)
    with the deprecated ``rms_scaling``). Per-example γ and β gradients are materialised: they
    have the size of the normalised axes only.
    """

    def unsupported_reason(self, layer: keras.layers.Layer) -> str | None:
        """See :meth:`LayerGradientRule.unsupported_reason`."""
        return _common_unsupported(layer)

    def variables(self, layer: keras.layers.Layer) -> tuple[keras.Variable, ...]:
        """γ and/or β, those the layer has."""
        return tuple(v for v in (layer.gamma, layer.beta) if v is not None)

    @staticmethod
    def _axes(layer: keras.layers.Layer, rank: int) -> list[int]:
        axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
        axes = sorted(a % rank for a in axes)
        if 0 in axes:
            raise RecordMixingLayerError(
                f"LayerNormalization layer {layer.name!r} normalises over axis 0, the batch, so "
                "it mixes the records of a batch; normalise over the feature axes (axis=-1)",
                layer_name=layer.name,
                layer_type=type(layer).__name__,
            )
        return axes

    def forward(self, layer, call, args, kwargs, tap):
        """See :meth:`LayerGradientRule.forward`."""
        x = _first_input(args, kwargs)
        self._axes(layer, len(x.shape))
        out = tap(call(*args, **kwargs))
        return out, x

    def squared_norms(self, layer, calls, *, batch_size):
        """See :meth:`LayerGradientRule.squared_norms`."""
        variables = self.variables(layer)
        dtype = variables[0].dtype
        per_example: list[tf.Tensor | None] = [None] * len(variables)
        for c in calls:
            x = c.saved
            rank = x.shape.rank
            axes = self._axes(layer, rank)
            with warnings.catch_warnings():  # rms_scaling's deprecation, already shown by Keras
                warnings.simplefilter("ignore")
                # Keras's own formula without γ and β, so that x̂ rounds as in the forward.
                x_hat = keras.ops.layer_normalization(
                    x, None, None, axis=axes, epsilon=layer.epsilon, rms_scaling=layer.rms_scaling
                )
            x_hat = tf.cast(x_hat, dtype)
            g = tf.cast(c.output_gradients[0], dtype)
            reduce = [a for a in range(1, rank) if a not in axes]
            terms = []
            if layer.gamma is not None:
                terms.append(tf.reduce_sum(g * x_hat, axis=reduce) if reduce else g * x_hat)
            if layer.beta is not None:
                terms.append(tf.reduce_sum(g, axis=reduce) if reduce else g)
            for j, t in enumerate(terms):
                per_example[j] = t if per_example[j] is None else per_example[j] + t
        return tuple(_rows_sq(t) for t in per_example), tuple(per_example)

    def weighted_sums(self, layer, residual, factors):
        """See :meth:`LayerGradientRule.weighted_sums`."""
        return tuple(_contract(f, pe) for f, pe in zip(factors, residual, strict=True))


register_layer_rule(keras.layers.Dense, DenseRule(), replace=True)
register_layer_rule(keras.layers.Embedding, EmbeddingRule(), replace=True)
register_layer_rule(keras.layers.LayerNormalization, LayerNormalizationRule(), replace=True)
