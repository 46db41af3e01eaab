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

The rules live in this module (Dense, Conv2D), :mod:`~dpledger.adapters.tensorflow.einsum_rule`,
:mod:`~dpledger.adapters.tensorflow.embedding_rule`,
:mod:`~dpledger.adapters.tensorflow.normalization_rule` and
:mod:`~dpledger.adapters.tensorflow.recurrent_rules`; their shared algebra is in
:mod:`~dpledger.adapters.tensorflow.rule_algebra`. Importing this module registers them all
but the recurrent ones.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from dpledger.adapters.tensorflow.conv_gradients import (
    patch_gram,
    patch_gram_supported,
    per_example_conv2d_kernel_gradients,
)
from dpledger.adapters.tensorflow.einsum_rule import EinsumDenseRule
from dpledger.adapters.tensorflow.embedding_rule import EmbeddingRule
from dpledger.adapters.tensorflow.normalization_rule import LayerNormalizationRule
from dpledger.adapters.tensorflow.registry import LayerRule, register_layer_rule
from dpledger.adapters.tensorflow.rule_algebra import (
    _common_unsupported,
    _concat_positions,
    _contract,
    _first_input,
    _ghost_is_cheaper,
    _LinearKernelRule,
    _outer_norms,
    _positions,
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
        """See :meth:`LayerRule.unsupported_reason`."""
        return _common_unsupported(layer)

    def forward(self, layer, call, args, kwargs, tap):
        """See :meth:`LayerRule.forward`."""
        x = _first_input(args, kwargs)
        return self._output(layer, keras.ops.matmul(x, layer.kernel), tap), x

    def squared_norms(self, layer, calls, *, batch_size):
        """See :meth:`LayerRule.squared_norms`."""
        dtype = layer.kernel.dtype
        a = _concat_positions([_positions(c.saved, batch_size, dtype) for c in calls])
        g = _concat_positions([_positions(c.output_gradients[0], batch_size, dtype) for c in calls])
        kernel_sq, kernel_res = self._kernel_terms(a, g)
        if layer.bias is None:
            return (kernel_sq,), (kernel_res,)
        bias_pe = tf.reduce_sum(g, axis=1)
        return (kernel_sq, _rows_sq(bias_pe)), (kernel_res, bias_pe)

    def weighted_sums(self, layer, residual, factors):
        """See :meth:`LayerRule.weighted_sums`."""
        sums = [self._kernel_sum(residual[0], factors[0])]
        if layer.bias is not None:
            sums.append(_contract(factors[1], residual[1]))
        return tuple(sums)


class Conv2DRule(LayerRule):
    """``keras.layers.Conv2D`` (groups = 1, padding "valid" or "same", any strides/dilation).

    With T output pixels, K = k_h·k_w·C and F filters, the kernel norms are either ghost norms
    from the Gram matrices of the input patches (when T·(K + F) < K·F, typical of deep layers
    with small feature maps; for a kernel that is a multiple of the stride the Gram matrices come
    from the input's blocks without building the patches,
    :func:`~dpledger.adapters.tensorflow.conv_gradients.patch_gram`; the clipped sum is then one
    ``Conv2DBackpropFilter`` on the rescaled output gradients) or the norms of the materialised
    per-example gradients, computed by one grouped ``Conv2DBackpropFilter`` or from the patch
    matrices (see :mod:`~dpledger.adapters.tensorflow.conv_gradients`; the clipped sum is then
    their contraction with the factors).
    """

    def unsupported_reason(self, layer: keras.layers.Layer) -> str | None:
        """See :meth:`LayerRule.unsupported_reason`."""
        reason = _common_unsupported(layer)
        if reason is not None:
            return reason
        if layer.groups != 1:
            return f"groups={layer.groups}"
        if layer.padding not in ("valid", "same"):
            return f"padding={layer.padding!r}"
        return None

    def variables(self, layer: keras.layers.Layer) -> tuple[keras.Variable, ...]:
        """(kernel, bias) or (kernel,)."""
        return (layer.kernel, layer.bias) if layer.use_bias else (layer.kernel,)

    def forward(self, layer, call, args, kwargs, tap):
        """See :meth:`LayerRule.forward`."""
        x = _first_input(args, kwargs)
        z = layer.convolution_op(x, layer.kernel)
        if layer.use_bias:
            if layer.data_format == "channels_last":
                shape = (1,) * (layer.rank + 1) + (layer.filters,)
            else:
                shape = (1, layer.filters) + (1,) * layer.rank
            z = keras.ops.add(z, keras.ops.reshape(layer.bias, shape))
        z = tap(z)
        return (layer.activation(z) if layer.activation is not None else z), x

    @staticmethod
    def _nhwc(layer: keras.layers.Layer, t: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
        t = tf.cast(t, dtype)
        return tf.transpose(t, [0, 2, 3, 1]) if layer.data_format == "channels_first" else t

    @staticmethod
    def _patch_ghost_norms(layer, xs, g_flat, batch_size, dtype):
        """Ghost norms from the input patches of every call (``tf.image.extract_patches``)."""
        kh, kw = layer.kernel_size
        patches = _concat_positions(
            [
                _positions(
                    tf.image.extract_patches(
                        x,
                        sizes=[1, kh, kw, 1],
                        strides=[1, *layer.strides, 1],
                        rates=[1, *layer.dilation_rate, 1],
                        padding=layer.padding.upper(),
                    ),
                    batch_size,
                    dtype,
                )
                for x in xs
            ]
        )
        norms, _ = _outer_norms(patches, g_flat)
        return norms

    def squared_norms(self, layer, calls, *, batch_size):
        """See :meth:`LayerRule.squared_norms`."""
        dtype = layer.kernel.dtype
        kernel_shape = tuple(layer.kernel.shape)
        kh, kw, cin, cout = kernel_shape
        xs = [self._nhwc(layer, c.saved, dtype) for c in calls]
        gs = [self._nhwc(layer, c.output_gradients[0], dtype) for c in calls]
        g_flat = _concat_positions([_positions(g, batch_size, dtype) for g in gs])
        if _ghost_is_cheaper(g_flat.shape[1], kh * kw * cin, cout):
            kernel_res: dict[str, Any] = {"conv": tuple(zip(xs, gs, strict=True))}
            if len(xs) == 1 and patch_gram_supported((kh, kw), layer.strides, layer.dilation_rate):
                gram_a = patch_gram(
                    xs[0],
                    kernel_size=(kh, kw),
                    strides=layer.strides,
                    padding=layer.padding,
                    output_size=gs[0].shape[1:3],
                )
                gram_g = tf.matmul(g_flat, g_flat, transpose_b=True)
                # ⟨PSD, PSD⟩ ≥ 0; clamp the rounding error of a tiny result.
                kernel_sq = tf.maximum(tf.reduce_sum(gram_a * gram_g, axis=[1, 2]), 0)
            else:
                kernel_sq = self._patch_ghost_norms(layer, xs, g_flat, batch_size, dtype)
        else:
            per_example = None
            for x, g in zip(xs, gs, strict=True):
                pe = per_example_conv2d_kernel_gradients(
                    x,
                    g,
                    kernel_shape=kernel_shape,
                    strides=layer.strides,
                    dilation_rate=layer.dilation_rate,
                    padding=layer.padding,
                )
                per_example = pe if per_example is None else per_example + pe
            kernel_sq = _rows_sq(per_example)
            kernel_res = {"per_example": per_example}
        if not layer.use_bias:
            return (kernel_sq,), (kernel_res,)
        bias_pe = tf.reduce_sum(g_flat, axis=1)
        return (kernel_sq, _rows_sq(bias_pe)), (kernel_res, bias_pe)

    def weighted_sums(self, layer, residual, factors):
        """See :meth:`LayerRule.weighted_sums`."""
        kernel_res = residual[0]
        shape = tuple(layer.kernel.shape)
        if "per_example" in kernel_res:
            kernel_sum = _contract(factors[0], kernel_res["per_example"])
        else:
            kernel_sum = None
            for x, g in kernel_res["conv"]:
                part = tf.raw_ops.Conv2DBackpropFilter(
                    input=x,
                    filter_sizes=tf.constant(shape, tf.int32),
                    out_backprop=_scale_records(g, factors[0]),
                    strides=[1, *layer.strides, 1],
                    padding=layer.padding.upper(),
                    dilations=[1, *layer.dilation_rate, 1],
                    data_format="NHWC",
                )
                kernel_sum = part if kernel_sum is None else kernel_sum + part
        sums = [kernel_sum]
        if layer.use_bias:
            sums.append(_contract(factors[1], residual[1]))
        return tuple(sums)


register_layer_rule(keras.layers.Dense, DenseRule(), replace=True)
register_layer_rule(keras.layers.Conv2D, Conv2DRule(), replace=True)
