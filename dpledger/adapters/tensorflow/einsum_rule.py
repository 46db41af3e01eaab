"""The fast-path rule for ``keras.layers.EinsumDense`` (the notation is that of
:mod:`~dpledger.adapters.tensorflow.layer_rules`).
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from dpledger.adapters.tensorflow.registry import register_layer_rule
from dpledger.adapters.tensorflow.rule_algebra import (
    _common_unsupported,
    _concat_positions,
    _contract,
    _first_input,
    _LinearKernelRule,
    _num_positions,
    _rows_sq,
)

__all__ = ["EinsumDenseRule"]


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
        """See :meth:`LayerRule.unsupported_reason`."""
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

    def forward(self, layer, call, args, kwargs, tap):
        """See :meth:`LayerRule.forward`."""
        x = _first_input(args, kwargs)
        return self._output(layer, keras.ops.einsum(layer.equation, x, layer.kernel), tap), x

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
        """See :meth:`LayerRule.squared_norms`."""
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
        """See :meth:`LayerRule.weighted_sums`."""
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


register_layer_rule(keras.layers.EinsumDense, EinsumDenseRule(), replace=True)
