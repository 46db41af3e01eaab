"""The algebra the fast-path layer rules share: the positions and records of activations and
output gradients, ghost norms ‖A_iᵀ G_i‖²_F = ⟨A_i A_iᵀ, G_i G_iᵀ⟩_F or materialised per-example
gradients (whichever is cheaper for the static shapes), the contraction Σ_i f_i (·)_i with the
clip factors, and the kernel of a linear map A_iᵀ G_i (Dense, Dense-like EinsumDense, the
recurrent layers' input kernels). The notation is that of
:mod:`~dpledger.adapters.tensorflow.layer_rules`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from dpledger.adapters.tensorflow.registry import LayerRule

__all__: list[str] = []  # shared by the rule modules of this adapter, not public


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


class _LinearKernelRule(LayerRule):
    """Common code for kernels acting as A_iᵀ G_i (Dense and Dense-like EinsumDense)."""

    def variables(self, layer: keras.layers.Layer) -> tuple[keras.Variable, ...]:
        """(kernel, bias) or (kernel,)."""
        return (layer.kernel,) if layer.bias is None else (layer.kernel, layer.bias)

    @staticmethod
    def _output(layer: keras.layers.Layer, z: tf.Tensor, tap: Any) -> tf.Tensor:
        """activation(z + b), with z + b tapped."""
        if layer.bias is not None:
            z = keras.ops.add(z, layer.bias)
        z = tap(z)
        return layer.activation(z) if layer.activation is not None else z

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
