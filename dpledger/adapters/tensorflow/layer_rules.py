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
"""

from __future__ import annotations

import re
import string
import warnings
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from dpledger.adapters.tensorflow.conv_gradients import (
    patch_gram,
    patch_gram_supported,
    per_example_conv2d_kernel_gradients,
)
from dpledger.adapters.tensorflow.errors import RecordMixingLayerError
from dpledger.adapters.tensorflow.registry import (
    LayerGradientRule,
    register_layer_rule,
)

__all__ = [
    "Conv2DRule",
    "DenseRule",
    "EinsumDenseRule",
    "EmbeddingRule",
    "LayerNormalizationRule",
]


# --------------------------------------------------------------------------------------------
# Shared helpers


def _first_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if args:
        return args[0]
    return kwargs["inputs"]


def _common_unsupported(layer: keras.layers.Layer) -> str | None:
    if getattr(layer, "quantization_mode", None) is not None:
        return f"quantization_mode={layer.quantization_mode!r}"
    if getattr(layer, "lora_enabled", False):
        return "LoRA is enabled"
    if getattr(layer, "_remat_mode", None) is not None:
        return "rematerialisation is enabled"
    return None


def _num_positions(t: tf.Tensor, first: int, last: int) -> int | tf.Tensor:
    """The product of the axes first..last-1 of t, static when known."""
    inner = t.shape[first:last]
    if inner.is_fully_defined():
        return inner.num_elements()
    return tf.reduce_prod(tf.shape(t)[first:last])


def _positions(t: tf.Tensor, batch_size: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """(B, d1, …, dk, K) → (B, T, K) with T = d1⋯dk (T = 1 for rank 2), cast to dtype.

    The sizes are computed explicitly (no -1), so that an empty batch reshapes too.
    """
    t = tf.cast(t, dtype)
    if t.shape.rank == 2:
        return tf.expand_dims(t, 1)
    return tf.reshape(t, [batch_size, _num_positions(t, 1, -1), t.shape[-1]])


def _records(t: tf.Tensor, batch_size: tf.Tensor) -> tf.Tensor:
    """(B, d1, …, dk) → (B, d1⋯dk)."""
    if t.shape.rank == 1:
        return tf.expand_dims(t, 1)
    return tf.reshape(t, [batch_size, _num_positions(t, 1, t.shape.rank)])


def _ghost_is_cheaper(positions: int | None, k: int, c: int) -> bool:
    """Whether the ghost norm, O(T²(K + C)), beats materialising, O(T·K·C).

    Unknown T materialises, whose memory is bounded by B times the number of parameters. For
    Conv2D the comparison was checked on whole DP steps of the benchmark CNNs: building the
    patches for the ghost norm costs extra data movement, but a 4× penalty on the ghost side
    made both CNN steps slower (benchmarks/RESULTS.md), so the plain operation count decides.
    """
    if positions is None:
        return False
    return positions * (k + c) < k * c


def _outer_norms(a: tf.Tensor, g: tf.Tensor) -> tuple[tf.Tensor, bool]:
    """‖A_iᵀ G_i‖²_F for A (B, T, K), G (B, T, C); returns (norms, materialise?)."""
    t, k, c = a.shape[1], a.shape[2], g.shape[2]
    if t == 1:
        norms = tf.reduce_sum(tf.square(a), axis=[1, 2]) * tf.reduce_sum(tf.square(g), axis=[1, 2])
        return norms, False
    if _ghost_is_cheaper(t, k, c):
        gram_a = tf.matmul(a, a, transpose_b=True)
        gram_g = tf.matmul(g, g, transpose_b=True)
        # ⟨PSD, PSD⟩ ≥ 0; clamp the rounding error of a tiny result.
        norms = tf.maximum(tf.reduce_sum(gram_a * gram_g, axis=[1, 2]), 0)
        return norms, False
    return tf.zeros([0], a.dtype), True


def _scale_records(t: tf.Tensor, f: tf.Tensor) -> tf.Tensor:
    shape = tf.concat([tf.shape(f), tf.ones([t.shape.rank - 1], tf.int32)], axis=0)
    return t * tf.reshape(tf.cast(f, t.dtype), shape)


def _contract(f: tf.Tensor, per_example: tf.Tensor) -> tf.Tensor:
    """Σ_i f_i x_i over the leading axis."""
    return tf.tensordot(tf.cast(f, per_example.dtype), per_example, axes=1)


def _rows_sq(t: tf.Tensor) -> tf.Tensor:
    return tf.reduce_sum(tf.square(t), axis=list(range(1, t.shape.rank)))


def _concat_positions(parts: Sequence[tf.Tensor]) -> tf.Tensor:
    return parts[0] if len(parts) == 1 else tf.concat(list(parts), axis=1)


class _LinearKernelRule(LayerGradientRule):
    """Common code for kernels acting as A_iᵀ G_i (Dense and Dense-like EinsumDense)."""

    @staticmethod
    def _kernel_terms(a: tf.Tensor, g: tf.Tensor) -> tuple[tf.Tensor, dict[str, Any]]:
        norms, materialise = _outer_norms(a, g)
        if materialise:
            per_example = tf.matmul(a, g, transpose_a=True)  # (B, K, C)
            return _rows_sq(per_example), {"per_example": per_example}
        return norms, {"outer": (a, g)}

    @staticmethod
    def _kernel_sum(residual: dict[str, Any], f: tf.Tensor) -> tf.Tensor:
        if "per_example" in residual:
            return _contract(f, residual["per_example"])
        a, g = residual["outer"]
        k, c = a.shape[-1], g.shape[-1]
        return tf.matmul(
            tf.reshape(a, [-1, k]), tf.reshape(_scale_records(g, f), [-1, c]), transpose_a=True
        )


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
# EinsumDense

_EINSUM = re.compile(r"^([a-zA-Z.]+),([a-zA-Z]+)->([a-zA-Z.]+)$")


def _split_equation(equation: str) -> tuple[str, str, str]:
    match = _EINSUM.match(equation.replace(" ", ""))
    if match is None:
        raise ValueError(f"cannot parse einsum equation {equation!r}")
    return match.group(1), match.group(2), match.group(3)


def _expand_equation(equation: str, rank: int) -> tuple[str, str, str]:
    """(input, kernel, output) specs with ``...`` replaced by letters for an input of rank."""
    lhs, kernel, out = _split_equation(equation)
    if "..." not in lhs:
        return lhs, kernel, out
    used = set(lhs + kernel + out)
    fresh = [ch for ch in string.ascii_uppercase + string.ascii_lowercase if ch not in used]
    elided = "".join(fresh[: rank - (len(lhs) - 3)])
    return lhs.replace("...", elided), kernel, out.replace("...", elided)


def _kernel_split(equation: str) -> tuple[str, str]:
    """Kernel axes contracted with the input, and kernel axes new in the output."""
    lhs, kernel, out = _split_equation(equation)
    contracted = "".join(ch for ch in kernel if ch in lhs and ch not in out)
    new = "".join(ch for ch in kernel if ch in out and ch not in lhs)
    return contracted, new


class EinsumDenseRule(_LinearKernelRule):
    """``keras.layers.EinsumDense``: z = einsum(equation, x, W) + b, y = activation(z).

    When the equation is a Dense on flattened axes (every kernel axis is either contracted
    with the input or new in the output, and every other non-batch input axis is carried to the
    output unchanged) the kernel is handled like a Dense (ghost norm when cheaper); otherwise
    the per-example kernel gradients einsum(x_i, G_i → W) are materialised. The batch must be
    the first axis of input and output and must not be a kernel axis.
    """

    def unsupported_reason(self, layer: keras.layers.Layer) -> str | None:
        """See :meth:`LayerGradientRule.unsupported_reason`."""
        reason = _common_unsupported(layer)
        if reason is not None:
            return reason
        try:
            lhs, kernel, out = _split_equation(layer.equation)
        except ValueError as exc:
            return str(exc)
        if lhs.startswith("...") != out.startswith("...") or (
            not lhs.startswith("...") and (lhs[0] != out[0] or lhs[0] in kernel)
        ):
            return f"equation {layer.equation!r} does not keep the batch axis first"
        return None

    def variables(self, layer: keras.layers.Layer) -> tuple[keras.Variable, ...]:
        """(kernel, bias) or (kernel,)."""
        return (layer.kernel,) if layer.bias is None else (layer.kernel, layer.bias)

    def forward(self, layer, call, args, kwargs, tap):
        """See :meth:`LayerGradientRule.forward`."""
        x = _first_input(args, kwargs)
        z = keras.ops.einsum(layer.equation, x, layer.kernel)
        if layer.bias is not None:
            z = keras.ops.add(z, layer.bias)
        z = tap(z)
        return (layer.activation(z) if layer.activation is not None else z), x

    @staticmethod
    def _as_linear(
        layer: keras.layers.Layer, x: tf.Tensor, g: tf.Tensor, batch_size: tf.Tensor
    ) -> tuple[tf.Tensor, tf.Tensor] | None:
        """(A, G) of shapes (B, T, K), (B, T, C) when the equation is Dense-like, else None."""
        lhs, kernel, out = _expand_equation(layer.equation, x.shape.rank)
        contracted, new = _kernel_split(layer.equation)
        carried = "".join(ch for ch in lhs[1:] if ch not in kernel)
        if len(contracted) + len(new) != len(kernel) or sorted(out) != sorted(
            lhs[0] + carried + new
        ):
            return None
        a = tf.transpose(x, [lhs.index(ch) for ch in lhs[0] + carried + contracted])
        g = tf.transpose(g, [out.index(ch) for ch in out[0] + carried + new])
        k = 1
        for ch in contracted:
            k *= layer.kernel.shape[kernel.index(ch)]
        c = 1
        for ch in new:
            c *= layer.kernel.shape[kernel.index(ch)]
        positions = _num_positions(a, 1, 1 + len(carried))
        return tf.reshape(a, [batch_size, positions, k]), tf.reshape(g, [batch_size, positions, c])

    @staticmethod
    def _to_kernel_layout(layer: keras.layers.Layer, t: tf.Tensor) -> tf.Tensor:
        """(…, K, C) with K, C in contracted/new axis order → (…, *kernel.shape)."""
        _, kernel, _ = _split_equation(layer.equation)
        order = "".join(_kernel_split(layer.equation))
        lead = t.shape.rank - 2
        sizes = [layer.kernel.shape[kernel.index(ch)] for ch in order]
        t = tf.reshape(t, tf.concat([tf.shape(t)[:lead], sizes], axis=0))
        perm = list(range(lead)) + [lead + order.index(ch) for ch in kernel]
        return tf.transpose(t, perm)

    def squared_norms(self, layer, calls, *, batch_size):
        """See :meth:`LayerGradientRule.squared_norms`."""
        dtype = layer.kernel.dtype
        xs = [tf.cast(c.saved, dtype) for c in calls]
        gs = [tf.cast(c.output_gradients[0], dtype) for c in calls]
        linear = [self._as_linear(layer, x, g, batch_size) for x, g in zip(xs, gs, strict=True)]
        if all(pair is not None for pair in linear):
            a = _concat_positions([pair[0] for pair in linear])
            g = _concat_positions([pair[1] for pair in linear])
            kernel_sq, linear_res = self._kernel_terms(a, g)
            kernel_res: dict[str, Any] = {"linear": linear_res}
        else:
            per_example = None
            for x, g in zip(xs, gs, strict=True):
                lhs, kernel, out = _expand_equation(layer.equation, x.shape.rank)
                pe = tf.einsum(f"{lhs},{out}->{lhs[0]}{kernel}", x, g)
                per_example = pe if per_example is None else per_example + pe
            kernel_sq, kernel_res = _rows_sq(per_example), {"einsum": per_example}
        if layer.bias is None:
            return (kernel_sq,), (kernel_res,)
        bias_pe = None
        for g in gs:
            pe = _unbroadcast_per_example(g, tuple(layer.bias.shape))
            bias_pe = pe if bias_pe is None else bias_pe + pe
        return (kernel_sq, _rows_sq(bias_pe)), (kernel_res, bias_pe)

    def weighted_sums(self, layer, residual, factors):
        """See :meth:`LayerGradientRule.weighted_sums`."""
        kernel_res = residual[0]
        if "einsum" in kernel_res:
            kernel_sum = _contract(factors[0], kernel_res["einsum"])
        else:
            kernel_sum = self._to_kernel_layout(
                layer, self._kernel_sum(kernel_res["linear"], factors[0])
            )
        sums = [kernel_sum]
        if layer.bias is not None:
            sums.append(_contract(factors[1], residual[1]))
        return tuple(sums)


def _unbroadcast_per_example(g: tf.Tensor, bias_shape: Sequence[int]) -> tf.Tensor:
    """Per-example gradient of a bias broadcast-added to a (B, …) output: (B, *bias_shape)."""
    rank = g.shape.rank
    k = len(bias_shape)
    if k > rank - 1:
        raise ValueError("the bias covers the batch axis")
    lead = list(range(1, rank - k))
    if lead:
        g = tf.reduce_sum(g, axis=lead)
    keep = [1 + i for i, size in enumerate(bias_shape) if size == 1 and g.shape[1 + i] != 1]
    if keep:
        g = tf.reduce_sum(g, axis=keep, keepdims=True)
    return g


# --------------------------------------------------------------------------------------------
# Conv2D


class Conv2DRule(LayerGradientRule):
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
        """See :meth:`LayerGradientRule.unsupported_reason`."""
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
        """See :meth:`LayerGradientRule.forward`."""
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
        """See :meth:`LayerGradientRule.squared_norms`."""
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
        """See :meth:`LayerGradientRule.weighted_sums`."""
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
register_layer_rule(keras.layers.EinsumDense, EinsumDenseRule(), replace=True)
register_layer_rule(keras.layers.Conv2D, Conv2DRule(), replace=True)
register_layer_rule(keras.layers.Embedding, EmbeddingRule(), replace=True)
register_layer_rule(keras.layers.LayerNormalization, LayerNormalizationRule(), replace=True)
