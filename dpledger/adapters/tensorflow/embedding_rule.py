"""The fast-path rule for ``keras.layers.Embedding`` (the notation is that of
:mod:`~dpledger.adapters.tensorflow.layer_rules`): the per-example gradient of the table adds
the output gradients of equal ids, so the norm is computed over the distinct (record, id) pairs.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from dpledger.adapters.tensorflow.registry import LayerRule, register_layer_rule
from dpledger.adapters.tensorflow.rule_algebra import (
    _common_unsupported,
    _concat_positions,
    _first_input,
    _positions,
    _records,
    _rows_sq,
    _scale_records,
)

__all__ = ["EmbeddingRule"]


class EmbeddingRule(LayerRule):
    """``keras.layers.Embedding``: y = E[ids].

    ∂ℓ_i/∂E adds the output gradients of the positions of record i that hold the same id, so
    ‖∂ℓ_i/∂E‖² = Σ_v ‖Σ_{t: id_{i,t} = v} G_{i,t}‖², computed over the distinct (i, v) pairs.
    The clipped sum scatters the rescaled output gradients into a dense table.
    """

    def unsupported_reason(self, layer: keras.layers.Layer) -> str | None:
        """See :meth:`LayerRule.unsupported_reason`."""
        return _common_unsupported(layer)

    def variables(self, layer: keras.layers.Layer) -> tuple[keras.Variable, ...]:
        """(embeddings,)."""
        return (layer.embeddings,)

    def forward(self, layer, call, args, kwargs, tap):
        """See :meth:`LayerRule.forward`."""
        ids = _first_input(args, kwargs)
        if ids.dtype not in ("int32", "int64", tf.int32, tf.int64):
            ids = keras.ops.cast(ids, "int32")
        out = keras.ops.take(layer.embeddings, ids, axis=0)
        out = tap(keras.ops.cast(out, layer.compute_dtype))
        return out, ids

    def squared_norms(self, layer, calls, *, batch_size):
        """See :meth:`LayerRule.squared_norms`."""
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
        """See :meth:`LayerRule.weighted_sums`."""
        ids, g = residual[0]
        dim = layer.embeddings.shape[-1]
        scaled = _scale_records(g, factors[0])
        table = tf.math.unsorted_segment_sum(
            tf.reshape(scaled, [-1, dim]), tf.reshape(ids, [-1]), layer.embeddings.shape[0]
        )
        return (table,)


register_layer_rule(keras.layers.Embedding, EmbeddingRule(), replace=True)
