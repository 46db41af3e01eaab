"""Fast-path rules for the recurrent layers ``SimpleRNN``, ``LSTM`` and ``GRU``.

Why a rule, not the vectorised path. ``tf.vectorized_map`` cannot vectorise the
``tf.while_loop`` of a Keras RNN (its ``TensorListPushBack`` converter fails at run time), and a
per-record ``tf.map_fn`` loop runs B sequential forward and backward passes. A recurrent layer is
however a linear layer applied at every time step: with inputs x_t, previous hidden states
h_{t-1} and gate pre-activations

    z_t = x_t W + h_{t-1} U + b        (W: ``kernel``, U: ``recurrent_kernel``, b: ``bias``),

back-propagation through time gives, for record i, with G_{i,t} = ∂ℓ_i/∂z_{i,t} the *total*
derivative (through every later step),

    ∂ℓ_i/∂W = Σ_t x_{i,t}ᵀ G_{i,t},   ∂ℓ_i/∂U = Σ_t h_{i,t-1}ᵀ G_{i,t},   ∂ℓ_i/∂b = Σ_t G_{i,t}.

These are the per-example gradients of a Dense layer on a sequence (A_iᵀ G_i with T positions,
:mod:`~dpledger.adapters.tensorflow.layer_rules`), so the ghost norm and the book-keeping sums
apply unchanged. The rule's forward re-implements the layer (the cell's formulas of Keras 3, in
the same order of operations) as one ``tf.scan`` over time, after projecting the whole sequence
at once, Zx = x W (+ b), outside the loop; Zx is tapped, so one backward pass of the batch gives
every G_{i,t} (one forward and one backward pass in all, as for the non-private step). Where the
recurrent pre-activation is not simply added to Zx (GRU: the reset gate multiplies the recurrent
part of the candidate state), an all-zero tensor E of the shape of Zx is added to the recurrent
pre-activations inside the loop and tapped as well: ∂(Σ_i ℓ_i)/∂E gives their output gradients
without changing any value.

Masks (``Embedding(mask_zero=True)``, ``Masking``), ``go_backwards``, ``return_sequences``,
``return_state``, ``initial_state``, ``unroll`` and the ``Bidirectional`` wrapper (whose two
layers are ordinary LSTM/GRU/SimpleRNN layers) behave as in Keras: at a masked step the state is
carried over and the output repeated (or zeroed with ``zero_output_for_mask``), so that step's
G is zero. Input ``dropout=`` draws its mask like Keras (one ``(B, features)`` mask per batch,
from the cell's seed generator, the same for every step): each record's mask is drawn
independently of the data, and a record's clipped gradient depends on its own data and mask
only, so clipping bounds its sensitivity as without dropout.

Refused before anything is recorded (see :func:`refuse_unsupported_recurrent`): ``stateful=True``
(a record's state would carry into the next batch's record in the same row, mixing records), and
``recurrent_dropout`` (Keras then switches the cell to its per-gate implementation, which this
rule does not re-implement; use ``dropout=`` or a ``Dropout`` layer between recurrent layers).
Other recurrent layers (``keras.layers.RNN`` with a custom cell, ``ConvLSTM``, subclasses) have
no rule and take the vectorised path, which runs them one record at a time (correct, slower).

Every norm and sum is computed in the dtype of the variable it differentiates (float32 under
Keras's ``mixed_float16`` / ``mixed_bfloat16`` policies, whose forward runs in the compute
dtype).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from dpledger.adapters.tensorflow.registry import register_layer_rule
from dpledger.adapters.tensorflow.rule_algebra import (
    _common_unsupported,
    _concat_positions,
    _contract,
    _LinearKernelRule,
    _positions,
    _rows_sq,
)
from dpledger.errors import RecordMixingLayerError, UnsupportedLayerError

__all__ = [
    "GRURule",
    "LSTMRule",
    "SimpleRNNRule",
    "refuse_unsupported_recurrent",
]

_RULE_TYPES = (keras.layers.SimpleRNN, keras.layers.LSTM, keras.layers.GRU)


def refuse_unsupported_recurrent(layer: keras.layers.Layer) -> None:
    """Raise for a recurrent layer configuration that DP training cannot handle.

    Raises:
        RecordMixingLayerError: a stateful RNN.
        UnsupportedLayerError: ``recurrent_dropout`` > 0, or input dropout with
            ``implementation=1`` (per-gate masks) on a layer that has a rule.
    """
    if not isinstance(layer, keras.layers.RNN):
        return
    kind = type(layer).__name__
    if layer.stateful:
        raise RecordMixingLayerError(
            f"layer {layer.name!r} ({kind}) is stateful: each batch starts from the states the "
            "previous batch left in the same rows, which belong to other records, so a record's "
            "gradient depends on other records and clipping does not bound its influence. Use "
            "stateful=False (the default): every sequence starts from a zero state, or from an "
            "initial_state computed from its own record.",
            layer_name=layer.name,
            layer_type=kind,
        )
    cells = getattr(layer.cell, "cells", [layer.cell])
    for cell in cells:
        if getattr(cell, "recurrent_dropout", 0.0) > 0.0:
            raise UnsupportedLayerError(
                f"layer {layer.name!r} ({kind}) has recurrent_dropout="
                f"{cell.recurrent_dropout}, which DP per-example gradients do not support; use "
                "dropout= (input dropout, supported) or a keras.layers.Dropout layer between "
                "recurrent layers instead.",
                layer_name=layer.name,
                layer_type=kind,
            )
    if type(layer) in _RULE_TYPES and (
        getattr(layer.cell, "implementation", 2) == 1 and layer.cell.dropout > 0.0
    ):
        raise UnsupportedLayerError(
            f"layer {layer.name!r} ({kind}) combines dropout={layer.cell.dropout} with "
            "implementation=1 (one dropout mask per gate), which DP per-example gradients do "
            "not support; use implementation=2 (the default).",
            layer_name=layer.name,
            layer_type=kind,
        )


def _call_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any, bool]:
    """(sequences, initial_state, mask, training) of ``RNN.call``'s signature."""
    names = ("sequences", "initial_state", "mask", "training")
    values = dict(zip(names, args, strict=False))
    for name in names:
        if name in kwargs:
            values[name] = kwargs[name]
    mask = values.get("mask")
    if isinstance(mask, (list, tuple)):
        mask = mask[0]
    return values["sequences"], values.get("initial_state"), mask, bool(values.get("training"))


def _time_major(t: tf.Tensor) -> tf.Tensor:
    perm = [1, 0, *range(2, t.shape.rank)]
    return tf.transpose(t, perm)


class _RecurrentRule(_LinearKernelRule):
    """Common code: the scan over time, masking, dropout, and the norms of W, U and b."""

    #: whether the recurrent pre-activation needs its own tap (E in the module docstring)
    needs_probe = False

    def unsupported_reason(self, layer: keras.layers.Layer) -> str | None:
        """See :meth:`LayerRule.unsupported_reason`."""
        return _common_unsupported(layer) or _common_unsupported(layer.cell)

    def variables(self, layer: keras.layers.Layer) -> tuple[keras.Variable, ...]:
        """(kernel, recurrent_kernel, bias) or (kernel, recurrent_kernel)."""
        cell = layer.cell
        if cell.use_bias:
            return (cell.kernel, cell.recurrent_kernel, cell.bias)
        return (cell.kernel, cell.recurrent_kernel)

    # ------------------------------------------------------------------ cell formulas
    def _projection(self, cell: Any, x: tf.Tensor) -> tf.Tensor:
        """Zx for the whole sequence (B, T, G)."""
        raise NotImplementedError

    def _step(
        self, cell: Any, zx: tf.Tensor, e: tf.Tensor | None, states: list[tf.Tensor]
    ) -> tuple[tf.Tensor, list[tf.Tensor], tuple[tf.Tensor, ...]]:
        """One time step: (output, new states, activations of U to keep)."""
        raise NotImplementedError

    def _initial_state(self, layer: Any, initial_state: Any, batch: tf.Tensor) -> list[tf.Tensor]:
        if initial_state is None:
            states = layer.get_initial_state(batch_size=batch)
        else:
            states = (
                list(initial_state) if isinstance(initial_state, (list, tuple)) else [initial_state]
            )
        return [tf.cast(tf.convert_to_tensor(s), layer.cell.compute_dtype) for s in states]

    # ------------------------------------------------------------------ rule API
    def forward(self, layer, call, args, kwargs, tap):
        """See :meth:`LayerRule.forward`."""
        sequences, initial_state, mask, training = _call_arguments(args, kwargs)
        cell = layer.cell
        x = tf.convert_to_tensor(sequences)
        batch = tf.shape(x)[0]
        states = self._initial_state(layer, initial_state, batch)
        if cell.dropout > 0.0:
            # Drawn like RNN.call does (once per batch, from the cell's seed generator), and
            # used only in training, as the cell does.
            dp_mask = cell.get_dropout_mask(x[:, 0, :])
            cell.reset_dropout_mask()
            if training and cell.dropout < 1.0:
                x = x * tf.expand_dims(tf.cast(dp_mask, x.dtype), 1)
        zx = tap(self._projection(cell, x))
        probe = tap(tf.zeros_like(zx)) if self.needs_probe else None

        elems: dict[str, tf.Tensor] = {"zx": _time_major(zx)}
        if probe is not None:
            elems["e"] = _time_major(probe)
        if mask is not None:
            elems["m"] = _time_major(tf.cast(mask, tf.bool))
        if layer.go_backwards:
            elems = {k: tf.reverse(v, [0]) for k, v in elems.items()}
        zero_output = tf.zeros([batch, cell.units], cell.compute_dtype)

        def step(carry: tuple[Any, ...], e: dict[str, tf.Tensor]) -> tuple[Any, ...]:
            prev_output, prev_states = carry[0], list(carry[1])
            output, new_states, kept = self._step(cell, e["zx"], e.get("e"), prev_states)
            if "m" in e:
                m = tf.expand_dims(e["m"], -1)
                fill = zero_output if layer.zero_output_for_mask else prev_output
                output = tf.where(m, output, fill)
                pairs = zip(new_states, prev_states, strict=True)
                new_states = [tf.where(m, s, p) for s, p in pairs]
            return output, tuple(new_states), kept

        shapes = self._kept_shapes(cell, batch)
        initializer = (zero_output, tuple(states), shapes)
        outputs, final_states, kept = tf.scan(step, elems, initializer=initializer)
        last_output = outputs[-1]
        saved_kept = [_time_major(k) for k in kept]  # (B, T, H) in processing order
        if layer.go_backwards:
            saved_kept = [tf.reverse(k, [1]) for k in saved_kept]  # align with x and Zx
        outputs = _time_major(outputs)
        states = [tf.cast(s[-1], layer.compute_dtype) for s in final_states]
        output = outputs if layer.return_sequences else last_output
        output = tf.cast(output, layer.compute_dtype)
        if layer.return_state:
            return (output, *states), {"x": x, "kept": tuple(saved_kept)}
        return output, {"x": x, "kept": tuple(saved_kept)}

    @staticmethod
    def _kept_shapes(cell: Any, batch: tf.Tensor) -> tuple[tf.Tensor, ...]:
        return (tf.zeros([batch, cell.units], cell.compute_dtype),)

    def _recurrent_pairs(
        self, cell: Any, kept: Sequence[tf.Tensor], g_in: tf.Tensor, g_probe: tf.Tensor | None
    ) -> list[tuple[tf.Tensor, tf.Tensor]]:
        """(A, G) for each column block of U, in column order."""
        return [(kept[0], g_in)]

    def _bias_per_example(self, cell: Any, g_in: tf.Tensor, g_probe: tf.Tensor | None) -> tf.Tensor:
        """∂ℓ_i/∂b for every record, the bias's shape after the batch axis."""
        return tf.reduce_sum(g_in, axis=1)

    def squared_norms(self, layer, calls, *, batch_size):
        """See :meth:`LayerRule.squared_norms`."""
        cell = layer.cell
        dtype = cell.kernel.dtype

        def positions(ts: Sequence[tf.Tensor]) -> tf.Tensor:
            return _concat_positions([_positions(t, batch_size, dtype) for t in ts])

        a_in = positions([c.saved["x"] for c in calls])
        g_in = positions([c.output_gradients[0] for c in calls])
        g_probe = positions([c.output_gradients[1] for c in calls]) if self.needs_probe else None
        kept = [
            positions([c.saved["kept"][k] for c in calls])
            for k in range(len(calls[0].saved["kept"]))
        ]
        kernel_sq, kernel_res = self._kernel_terms(a_in, g_in)
        recurrent_sq = None
        recurrent_res = []
        for a, g in self._recurrent_pairs(cell, kept, g_in, g_probe):
            sq, res = self._kernel_terms(a, g)
            recurrent_sq = sq if recurrent_sq is None else recurrent_sq + sq
            recurrent_res.append(res)
        norms = [kernel_sq, recurrent_sq]
        residual: list[Any] = [kernel_res, tuple(recurrent_res)]
        if cell.use_bias:
            bias_pe = self._bias_per_example(cell, g_in, g_probe)
            norms.append(_rows_sq(bias_pe))
            residual.append(bias_pe)
        return tuple(norms), tuple(residual)

    def weighted_sums(self, layer, residual, factors):
        """See :meth:`LayerRule.weighted_sums`."""
        kernel = self._kernel_sum(residual[0], factors[0])
        blocks = [self._kernel_sum(res, factors[1]) for res in residual[1]]
        recurrent = blocks[0] if len(blocks) == 1 else tf.concat(blocks, axis=-1)
        sums = [kernel, recurrent]
        if layer.cell.use_bias:
            sums.append(_contract(factors[2], residual[2]))
        return tuple(sums)


class SimpleRNNRule(_RecurrentRule):
    """``keras.layers.SimpleRNN``: h_t = activation(x_t W + b + h_{t-1} U)."""

    def _projection(self, cell, x):
        z = keras.ops.matmul(x, cell.kernel)
        if cell.bias is not None:
            z = keras.ops.add(z, cell.bias)
        return z

    def _step(self, cell, zx, e, states):
        h_prev = states[0]
        output = zx + keras.ops.matmul(h_prev, cell.recurrent_kernel)
        if cell.activation is not None:
            output = cell.activation(output)
        return output, [output], (h_prev,)


class LSTMRule(_RecurrentRule):
    """``keras.layers.LSTM``: z_t = x_t W + h_{t-1} U + b split into the gates i, f, c̃, o;
    c_t = σ(f)·c_{t-1} + σ(i)·tanh(c̃), h_t = σ(o)·tanh(c_t) (with the layer's activations)."""

    def _projection(self, cell, x):
        return keras.ops.matmul(x, cell.kernel)

    def _step(self, cell, zx, e, states):
        h_prev, c_prev = states[0], states[1]
        z = keras.ops.add(zx, keras.ops.matmul(h_prev, cell.recurrent_kernel))
        if cell.use_bias:
            z = keras.ops.add(z, cell.bias)
        z0, z1, z2, z3 = keras.ops.split(z, 4, axis=1)
        i = cell.recurrent_activation(z0)
        f = cell.recurrent_activation(z1)
        c = f * c_prev + i * cell.activation(z2)
        o = cell.recurrent_activation(z3)
        h = o * cell.activation(c)
        return h, [h, c], (h_prev,)


class GRURule(_RecurrentRule):
    """``keras.layers.GRU`` (``reset_after`` True or False).

    With x_t W + b_in = [x_z, x_r, x_h] and the recurrent part [r_z, r_r, r_h] (h_{t-1} U + b_rec
    when ``reset_after``; h_{t-1} U_zr and (r ⊙ h_{t-1}) U_h otherwise): z = σ(x_z + r_z),
    r = σ(x_r + r_r), h̃ = tanh(x_h + r ⊙ r_h) (``reset_after``) or tanh(x_h + r_h), and
    h_t = z ⊙ h_{t-1} + (1 − z) ⊙ h̃. The recurrent part has its own tap (the zero probe E).
    """

    needs_probe = True

    def _projection(self, cell, x):
        z = keras.ops.matmul(x, cell.kernel)
        if cell.use_bias:
            z = keras.ops.add(z, cell.bias if not cell.reset_after else cell.bias[0])
        return z

    @staticmethod
    def _kept_shapes(cell, batch):
        zeros = tf.zeros([batch, cell.units], cell.compute_dtype)
        return (zeros,) if cell.reset_after else (zeros, zeros)

    def _step(self, cell, zx, e, states):
        units = cell.units
        h_prev = states[0]
        x_z, x_r, x_h = zx[:, :units], zx[:, units : 2 * units], zx[:, 2 * units :]
        if cell.reset_after:
            inner = keras.ops.matmul(h_prev, cell.recurrent_kernel)
            if cell.use_bias:
                inner = inner + cell.bias[1]
            inner = inner + e
        else:
            inner = keras.ops.matmul(h_prev, cell.recurrent_kernel[:, : 2 * units])
            inner = inner + e[:, : 2 * units]
        z = cell.recurrent_activation(x_z + inner[:, :units])
        r = cell.recurrent_activation(x_r + inner[:, units : 2 * units])
        if cell.reset_after:
            recurrent_h = r * inner[:, 2 * units :]
            kept: tuple[tf.Tensor, ...] = (h_prev,)
        else:
            reset_h = r * h_prev
            recurrent_h = keras.ops.matmul(reset_h, cell.recurrent_kernel[:, 2 * units :])
            recurrent_h = recurrent_h + e[:, 2 * units :]
            kept = (h_prev, reset_h)
        hh = cell.activation(x_h + recurrent_h)
        h = z * h_prev + (1 - z) * hh
        return h, [h], kept

    def _recurrent_pairs(self, cell, kept, g_in, g_probe):
        assert g_probe is not None
        if cell.reset_after:  # one block: h_{t-1} U + b_rec
            return [(kept[0], g_probe)]
        units = cell.units
        return [(kept[0], g_probe[..., : 2 * units]), (kept[1], g_probe[..., 2 * units :])]

    def _bias_per_example(self, cell, g_in, g_probe):
        b_in = tf.reduce_sum(g_in, axis=1)
        if not cell.reset_after:  # bias (3H,): the input bias only
            return b_in
        assert g_probe is not None
        return tf.stack([b_in, tf.reduce_sum(g_probe, axis=1)], axis=1)  # bias (2, 3H)


register_layer_rule(keras.layers.SimpleRNN, SimpleRNNRule(), replace=True)
register_layer_rule(keras.layers.LSTM, LSTMRule(), replace=True)
register_layer_rule(keras.layers.GRU, GRURule(), replace=True)
