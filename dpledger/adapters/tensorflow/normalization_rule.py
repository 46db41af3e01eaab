"""The fast-path rule for ``keras.layers.LayerNormalization`` (the notation is that of
:mod:`~dpledger.adapters.tensorflow.layer_rules`): ∂ℓ_i/∂γ = Σ G_i ⊙ x̂_i and ∂ℓ_i/∂β = Σ G_i over
the non-parameter axes, with x̂ the normalised input.
"""

from __future__ import annotations

import warnings

import keras
import tensorflow as tf

from dpledger.adapters.tensorflow.registry import LayerRule, register_layer_rule
from dpledger.adapters.tensorflow.rule_algebra import (
    _common_unsupported,
    _contract,
    _first_input,
    _rows_sq,
)
from dpledger.errors import RecordMixingLayerError

__all__ = ["LayerNormalizationRule"]


class LayerNormalizationRule(LayerRule):
    """``keras.layers.LayerNormalization``: y = γ ⊙ x̂ + β over ``layer.axis``.

    The forward is Keras's own; x̂ is recomputed from the saved input for the norms with Keras's
    ``ops.layer_normalization`` without γ and β (x̂ = (x − mean)/√(var + ε), or x/√(var + ε)
    with Keras's ``rms_scaling``). Per-example γ and β gradients are materialised: they
    have the size of the normalised axes only.
    """

    def unsupported_reason(self, layer: keras.layers.Layer) -> str | None:
        """See :meth:`LayerRule.unsupported_reason`."""
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
        """See :meth:`LayerRule.forward`."""
        x = _first_input(args, kwargs)
        self._axes(layer, len(x.shape))
        out = tap(call(*args, **kwargs))
        return out, x

    def squared_norms(self, layer, calls, *, batch_size):
        """See :meth:`LayerRule.squared_norms`."""
        variables = self.variables(layer)
        dtype = variables[0].dtype
        per_example: list[tf.Tensor | None] = [None] * len(variables)
        for c in calls:
            x = c.saved
            rank = x.shape.rank
            axes = self._axes(layer, rank)
            with warnings.catch_warnings():  # rms_scaling's warning, already shown by Keras
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
        """See :meth:`LayerRule.weighted_sums`."""
        return tuple(_contract(f, pe) for f, pe in zip(factors, residual, strict=True))


register_layer_rule(keras.layers.LayerNormalization, LayerNormalizationRule(), replace=True)
