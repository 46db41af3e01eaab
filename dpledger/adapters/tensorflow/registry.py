"""The registry of per-layer gradient rules for the fast path, keyed by Keras layer type.

A *rule* tells the fast path of
:class:`~dpledger.adapters.tensorflow.engine.PerExampleGradientEngine` how to get per-example
quantities of one layer type without materialising every per-example gradient (the "ghost norm"
of Li et al. 2022, *Large language models can be strong differentially private learners*, and
the per-layer registry functions of TensorFlow Privacy's fast gradient clipping). For a layer
with trainable variables w_1..w_m and example i of a batch:

1. :meth:`LayerRule.forward` computes the layer's output exactly as ``layer.call`` does,
   passing each tensor z whose gradient it needs through ``tap`` (typically the pre-activation
   output) and returning what it must keep (typically the layer's input, the *activations*).
2. The engine takes ∂(Σ_i ℓ_i)/∂z for every tapped z in one backward pass. When records do not
   mix, row i of that gradient is ∂ℓ_i/∂z_i, the *output gradient* of example i.
3. :meth:`LayerRule.squared_norms` turns the activations and output gradients of every
   call of the layer in the step into ‖∂ℓ_i/∂w_j‖² for each variable (shape ``(B,)`` each) and a
   *residual*: tensors from which
4. :meth:`LayerRule.weighted_sums` computes Σ_i f_ij ∂ℓ_i/∂w_j for given per-example
   factors f_·j, without another forward or backward pass (book-keeping, Bu et al. 2023).

Residuals are nested tuples/dicts of tensors, so they can leave one ``tf.function`` and enter
another (the factors may be computed anywhere in between).

Lookups use the exact type: a subclass of ``keras.layers.Dense`` with its own ``call`` is not a
``Dense`` for the fast path until it is registered. Models with layers that have trainable
variables but no rule are handled by the vectorised path, so registering is an optimisation,
never a requirement for correctness.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import keras
import tensorflow as tf

from dpledger.errors import InvalidParameterError

__all__ = [
    "LayerCall",
    "LayerRule",
    "layer_rule",
    "register_layer_rule",
    "registered_layer_types",
    "unregister_layer_rule",
]

Tap = Callable[[tf.Tensor], tf.Tensor]


@attrs.frozen
class LayerCall:
    """What the engine kept from one call of a layer in a step.

    Attributes:
        saved: the structure of tensors :meth:`LayerRule.forward` returned as ``saved``.
        output_gradients: ∂(Σ_i ℓ_i)/∂z for each tensor z the forward passed to ``tap``, in the
            order of the ``tap`` calls; each has the shape and dtype of its z.
    """

    saved: Any
    output_gradients: tuple[tf.Tensor, ...]


class LayerRule(abc.ABC):
    """How the fast path handles one layer type (see the module docstring)."""

    def unsupported_reason(self, layer: keras.layers.Layer) -> str | None:
        """Why this rule cannot handle ``layer`` as configured, or None when it can.

        The default accepts every layer. Rules refuse configurations they do not implement
        (LoRA, quantisation, grouped convolution…); the engine then uses the vectorised path.
        """
        return None

    @abc.abstractmethod
    def variables(self, layer: keras.layers.Layer) -> tuple[keras.Variable, ...]:
        """The variables of ``layer`` the rule computes per-example quantities for, in order.

        Together they must be every trainable variable of the layer (and of its sub-layers,
        which the rule's forward replaces).
        """

    @abc.abstractmethod
    def forward(
        self,
        layer: keras.layers.Layer,
        call: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        tap: Tap,
    ) -> tuple[Any, Any]:
        """The layer's output for ``layer.call(*args, **kwargs)`` and what to keep.

        Args:
            layer: the layer instance.
            call: the layer's own (unpatched) ``call``, for rules that reuse it.
            args: positional arguments of the call (already converted by ``Layer.__call__``).
            kwargs: keyword arguments of the call.
            tap: ``tap(z)`` registers z as a tensor whose output gradient the rule needs and
                returns z; it must be called on tensors whose leading axis is the batch.

        Returns:
            ``(outputs, saved)``: what ``call`` would return, and a structure of tensors for
            :meth:`squared_norms`.
        """

    @abc.abstractmethod
    def squared_norms(
        self, layer: keras.layers.Layer, calls: Sequence[LayerCall], *, batch_size: tf.Tensor
    ) -> tuple[tuple[tf.Tensor, ...], Any]:
        """Per-example squared gradient norms of each variable, and the residual.

        Args:
            layer: the layer instance.
            calls: every call of the layer in the step (more than one when it is shared).
            batch_size: B, a scalar int32 tensor.

        Returns:
            ``(norms, residual)``: ``norms[j]`` has shape ``(B,)`` and holds ‖∂ℓ_i/∂w_j‖² for
            ``w_j = variables(layer)[j]``, in that variable's dtype; ``residual`` is a nested
            tuple/dict of tensors for :meth:`weighted_sums`.
        """

    @abc.abstractmethod
    def weighted_sums(
        self, layer: keras.layers.Layer, residual: Any, factors: Sequence[tf.Tensor]
    ) -> tuple[tf.Tensor, ...]:
        """Σ_i f_ij ∂ℓ_i/∂w_j for each variable w_j, from the residual.

        Args:
            layer: the layer instance.
            residual: what :meth:`squared_norms` returned.
            factors: ``factors[j]`` has shape ``(B,)`` and the dtype of ``variables(layer)[j]``.

        Returns:
            One tensor per variable, with that variable's shape and dtype.
        """


_lock = threading.Lock()
_rules: dict[type, LayerRule] = {}


def register_layer_rule(layer_type: type, rule: LayerRule, *, replace: bool = False) -> None:
    """Register ``rule`` for layers whose type is exactly ``layer_type``.

    Args:
        layer_type: a subclass of ``keras.layers.Layer``.
        rule: the rule.
        replace: allow replacing a rule already registered for ``layer_type``.

    Raises:
        InvalidParameterError: when ``layer_type`` is not a Keras layer class, ``rule`` is not a
            :class:`LayerRule`, or a rule is already registered and ``replace`` is False.
    """
    if not (isinstance(layer_type, type) and issubclass(layer_type, keras.layers.Layer)):
        raise InvalidParameterError("layer_type", layer_type, "a subclass of keras.layers.Layer")
    if not isinstance(rule, LayerRule):
        raise InvalidParameterError("rule", rule, "a LayerRule instance")
    with _lock:
        if layer_type in _rules and not replace:
            raise InvalidParameterError(
                "layer_type",
                layer_type.__name__,
                "a layer type without a registered rule (pass replace=True to replace it)",
            )
        _rules[layer_type] = rule


def unregister_layer_rule(layer_type: type) -> LayerRule:
    """Remove and return the rule registered for ``layer_type``.

    Raises:
        InvalidParameterError: when no rule is registered for ``layer_type``.
    """
    with _lock:
        if layer_type not in _rules:
            raise InvalidParameterError(
                "layer_type", getattr(layer_type, "__name__", layer_type), "a registered type"
            )
        return _rules.pop(layer_type)


def layer_rule(layer_type: type) -> LayerRule | None:
    """The rule registered for exactly ``layer_type``, or None."""
    with _lock:
        return _rules.get(layer_type)


def registered_layer_types() -> tuple[type, ...]:
    """The layer types that have a rule, in registration order."""
    with _lock:
        return tuple(_rules)
