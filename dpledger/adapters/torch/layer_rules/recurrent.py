"""Per-example gradient norms and clipped sums for ``nn.RNN``, ``nn.GRU`` and ``nn.LSTM``.

In layer l and direction d of a recurrent module, every step t computes two affine maps, the gate
pre-activations

    gi_t = W_ih x_t + b_ih,       gh_t = W_hh h_{t-1} + b_hh,

and a cell that combines them with torch's equations and gate order (``RNN``:
h_t = tanh(gi_t + gh_t) or relu; ``LSTM``: gates i, f, g, o of gi_t + gh_t,
c_t = f ⊙ c_{t-1} + i ⊙ g, h_t = o ⊙ tanh(c_t); ``GRU``: r, z from gi_t + gh_t and
n = tanh(gi_n + r ⊙ gh_n), h_t = (1 - z) ⊙ n + z ⊙ h_{t-1}). Given the gradients of example i's
loss with respect to the gate pre-activations, ∂gi_it and ∂gh_it, each pair (W_ih, b_ih) and
(W_hh, b_hh) is a linear layer applied at T positions, with inputs x_it (resp. h_i,t-1) and output
gradients ∂gi_it (resp. ∂gh_it):

    ∇W_ih = Σ_t ∂gi_it x_itᵀ,     ∇b_ih = Σ_t ∂gi_it,
    ∇W_hh = Σ_t ∂gh_it h_i,t-1ᵀ,  ∇b_hh = Σ_t ∂gh_it,

so the ghost norms, book-keeping clipped sums and per-example gradients of
:mod:`~dpledger.adapters.torch.layer_rules.linear` apply unchanged.

The fused kernels do not expose the pre-activations, so the sampler recomputes the module's
forward on the whole batch from its stored inputs, layer by layer and direction by direction: it
computes gi = x W_ihᵀ + b_ih + z for all steps at once (z a zero tensor) and runs torch's own
kernel for the layer on the input gi with W_ih = I and b_ih = 0, whose gate pre-activations are
then exactly gi_t + gh_t. Differentiating the recomputed (output, h_n[, c_n]) against the output
gradients the engine captured gives ∂L/∂z = ∂gi; the hidden states h_{t-1} are the layer's
outputs. For ``RNN`` and ``LSTM`` the gates see gi_t + gh_t, so ∂gh_t = ∂gi_t; for ``GRU`` the r and
z parts are equal and ∂gh_n = r ⊙ ∂gi_n, with r recomputed from gi and h_{t-1}. Examples do not
interact in a recurrent layer, so row i of each is example i's. This costs about one more forward
and backward of the layer (the input projection becomes a (G·H)×(G·H) product), in float32 at
least whatever the autocast precision of the step, with the step's own matmul precision settings
(cuDNN's TF32 on recent GPUs); the result is cached for the step, so norms and clipped sum share
one recomputation. The recomputation reads the module's current parameters: the engine must be
queried before the optimizer changes them (the usual order: backward, norms and clipped sum,
optimizer step).

Supported: every mode (tanh and relu ``RNN``, ``GRU``, ``LSTM``), one or several layers, one or two
directions, ``batch_first`` either way, with or without biases, with or without an initial state,
any subset of the parameters trainable, an initial state computed by other layers (an encoder's
h_n). The model's own inputs keep their records along dimension 0 (a time-major layer inside a
model that transposes is fine). Refused with
:class:`~dpledger.errors.UnsupportedLayerError`:

* ``PackedSequence`` inputs (pad the batch instead, and mask the loss);
* inputs without a batch dimension;
* ``LSTM(proj_size > 0)``;
* ``dropout > 0`` between layers in training mode: its masks are drawn inside the fused kernel and
  cannot be reproduced by the recomputation. Use single-layer modules with ``nn.Dropout``
  between them, which is equivalent.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import NamedTuple

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from dpledger.adapters.torch.layer_rules.linear import (
    affine_bias_clipped_sum,
    affine_bias_norms,
    affine_weight_clipped_sum,
    affine_weight_norms,
    affine_weight_per_example,
    keeping_per_example_is_cheaper,
)
from dpledger.adapters.torch.layer_rules.step_cache import cached_per_step
from dpledger.adapters.torch.registry import register_layer_rule
from dpledger.errors import UnsupportedLayerError

__all__ = [
    "recurrent_check",
    "recurrent_clipped_sum",
    "recurrent_norms",
    "recurrent_output_record_dims",
    "recurrent_per_example",
    "recurrent_prefers_per_example",
]

_GATES = {"RNN_TANH": 1, "RNN_RELU": 1, "GRU": 3, "LSTM": 4}


class _Affine(NamedTuple):
    """One affine map of a layer and direction: its parameter names, inputs and gradients."""

    weight: str
    bias: str | None
    inputs: torch.Tensor  # (B, T, d_in)
    grads: torch.Tensor  # (B, T, gates * hidden)


def recurrent_check(module: nn.RNNBase, activations: tuple | None) -> None:
    """Refuse what the recomputation cannot reproduce (see the module docstring).

    Args:
        module: the recurrent layer.
        activations: its positional forward arguments, or None to check its configuration only.

    Raises:
        UnsupportedLayerError: a projection, inter-layer dropout in training mode, a
            ``PackedSequence`` or an input without a batch dimension.
    """
    if module.mode not in _GATES:
        raise UnsupportedLayerError(f"unknown recurrent mode {module.mode!r}")
    if getattr(module, "proj_size", 0) > 0:
        raise UnsupportedLayerError(
            f"proj_size={module.proj_size} (LSTM with projections) is not supported by the "
            "recurrent layer rule; use proj_size=0 and an nn.Linear after the LSTM"
        )
    if module.training and module.dropout > 0 and module.num_layers > 1:
        raise UnsupportedLayerError(
            f"dropout={module.dropout} between the {module.num_layers} layers in training mode: "
            "its masks are drawn inside the fused kernel and the per-example gradients cannot "
            "reproduce them. Stack single-layer modules with nn.Dropout between them (the same "
            "model), or set dropout=0"
        )
    if activations is None:
        return
    x = activations[0] if activations else None
    if isinstance(x, PackedSequence):
        raise UnsupportedLayerError(
            "PackedSequence inputs are not supported; pass the padded batch (records along the "
            "batch dimension) and leave the padded positions out of the loss"
        )
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise UnsupportedLayerError(
            f"the input has shape {shape}; per-example gradients need a batched input "
            "(B, T, features) with batch_first=True or (T, B, features)"
        )


def recurrent_output_record_dims(module: nn.RNNBase, activations: tuple) -> tuple[int, ...]:
    """Records along dim 0 (``batch_first``) or 1 of the output, along dim 1 of h_n and c_n."""
    out = 0 if module.batch_first else 1
    return (out, 1, 1) if module.mode == "LSTM" else (out, 1)


_KERNELS = {"RNN_TANH": "rnn_tanh", "RNN_RELU": "rnn_relu", "GRU": "gru", "LSTM": "lstm"}


def _run_layer(
    mode: str,
    gi: torch.Tensor,
    w_hh: torch.Tensor,
    b_hh: torch.Tensor | None,
    h0: torch.Tensor,
    c0: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One direction of one layer, given its input pre-activations gi of shape (B, T, G·H).

    torch's own (fused) kernel runs the layer with the input x' = gi, W_ih = I and b_ih = 0, so
    its gate pre-activations are exactly gi + W_hh h_{t-1} + b_hh, and the gradient it returns
    for its input is ∂L/∂gi. Returns the outputs (B, T, H), h_T (B, H) and c_T (LSTM).
    """
    width = gi.shape[2]
    eye = torch.eye(width, dtype=gi.dtype, device=gi.device)
    weights = [eye, w_hh] if b_hh is None else [eye, w_hh, torch.zeros_like(b_hh), b_hh]
    kernel = getattr(torch._VF, _KERNELS[mode])
    hx = h0.unsqueeze(0)
    with warnings.catch_warnings():
        # cuDNN asks for the weights in one contiguous buffer; these are small and fresh
        warnings.filterwarnings("ignore", message="RNN module weights are not part")
        if mode == "LSTM":
            assert c0 is not None
            out, h_n, c_n = kernel(
                gi, (hx, c0.unsqueeze(0)), weights, b_hh is not None, 1, 0.0, True, False, True
            )
            return out, h_n[0], c_n[0]
        out, h_n = kernel(gi, hx, weights, b_hh is not None, 1, 0.0, True, False, True)
    return out, h_n[0], None


def _terms(module: nn.RNNBase, activations: tuple, backprops: tuple) -> list[_Affine]:
    """Recompute the forward and return every affine map's inputs and output gradients."""
    mode = module.mode
    x = activations[0]
    hx = activations[1] if len(activations) > 1 else None
    h0, c0 = (hx if hx is not None else (None, None)) if mode == "LSTM" else (hx, None)
    dtype = torch.promote_types(x.dtype, torch.float32)
    for t in (*backprops, *module.parameters()):
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    x = x.detach().to(dtype)
    if not module.batch_first:
        x = x.transpose(0, 1)
    batch, steps, _ = x.shape
    hidden, layers = module.hidden_size, module.num_layers
    directions = 2 if module.bidirectional else 1
    width = _GATES[mode] * hidden

    def initial(state: torch.Tensor | None, k: int) -> torch.Tensor:
        if state is None:
            return x.new_zeros(batch, hidden)
        return state[k].detach().to(dtype).contiguous()

    def param(name: str) -> torch.Tensor | None:
        p = getattr(module, name, None)
        return None if p is None else p.detach().to(dtype)

    # per layer and direction: suffix, layer input, W_hh and b_hh, the probe z, the run's outputs,
    # its initial state and (GRU) its gi (time in processing order: reversed for the reverse
    # direction, in the run's outputs and gi)
    records: list[tuple] = []
    finals_h: list[torch.Tensor] = []
    finals_c: list[torch.Tensor] = []
    with torch.enable_grad():
        layer_in = x
        for layer in range(layers):
            outs = []
            for d in range(directions):
                sfx = f"_l{layer}" + ("_reverse" if d else "")
                w_hh, b_hh = param(f"weight_hh{sfx}"), param(f"bias_hh{sfx}")
                z = x.new_zeros(batch, steps, width, requires_grad=True)
                gi = F.linear(layer_in, param(f"weight_ih{sfx}"), param(f"bias_ih{sfx}")) + z
                k = layer * directions + d
                h_start = initial(h0, k)
                c_start = initial(c0, k) if mode == "LSTM" else None
                run, h_end, c_end = _run_layer(
                    mode, gi.flip(1) if d else gi, w_hh, b_hh, h_start, c_start
                )
                outs.append(run.flip(1) if d else run)
                finals_h.append(h_end)
                if c_end is not None:
                    finals_c.append(c_end)
                gi_run = (gi.flip(1) if d else gi).detach() if mode == "GRU" else None
                records.append(
                    (sfx, layer_in.detach(), w_hh, b_hh, z, run.detach(), h_start, gi_run)
                )
            layer_in = torch.cat(outs, 2) if directions == 2 else outs[0]
        results = [layer_in, torch.stack(finals_h, 1)]
        if mode == "LSTM":
            results.append(torch.stack(finals_c, 1))
        pairs = [(r, g.to(dtype)) for r, g in zip(results, backprops, strict=True) if g is not None]
        grads = torch.autograd.grad(
            [r for r, _ in pairs],
            [rec[4] for rec in records],
            [g for _, g in pairs],
            allow_unused=True,
        )
    return _affine_terms(module, records, grads)


def _affine_terms(
    module: nn.RNNBase, records: list[tuple], grads: tuple[torch.Tensor | None, ...]
) -> list[_Affine]:
    """The W_ih and W_hh maps of each layer and direction, from the recomputed forward's
    records and the gradients of its gate pre-activations gi (None: no gradient reached)."""
    hidden = module.hidden_size
    out = []
    for (sfx, inputs, w_hh, b_hh, z, run, h_start, gi_run), gi_grad in zip(
        records, grads, strict=True
    ):
        gi_grad = torch.zeros_like(z) if gi_grad is None else gi_grad
        # W_hh's inputs h_{t-1} and gradients, both in processing order
        prev = torch.cat([h_start.unsqueeze(1), run[:, :-1]], 1)
        gh_grad = gi_grad.flip(1) if sfx.endswith("_reverse") else gi_grad
        if gi_run is not None:  # GRU: n = tanh(gi_n + r ⊙ gh_n), so ∂gh_n = r ⊙ ∂gi_n
            gh_r = F.linear(prev, w_hh[:hidden], None if b_hh is None else b_hh[:hidden])
            r = torch.sigmoid(gi_run[..., :hidden] + gh_r)
            gh_grad = torch.cat([gh_grad[..., : 2 * hidden], r * gh_grad[..., 2 * hidden :]], 2)
        bias = module.bias
        out.append(_Affine(f"weight_ih{sfx}", f"bias_ih{sfx}" if bias else None, inputs, gi_grad))
        out.append(_Affine(f"weight_hh{sfx}", f"bias_hh{sfx}" if bias else None, prev, gh_grad))
    return out


def _cached_terms(module: nn.RNNBase, activations: tuple, backprops: tuple) -> list[_Affine]:
    leaves = [activations[0]]
    if len(activations) > 1 and activations[1] is not None:
        hx = activations[1]
        leaves.extend(hx if isinstance(hx, tuple) else (hx,))
    return cached_per_step(module, leaves, backprops, _terms, activations)


def _trainable(module: nn.Module, name: str | None) -> bool:
    return name is not None and getattr(module, name).requires_grad


def recurrent_norms(
    module: nn.RNNBase, activations: tuple, backprops: tuple
) -> dict[str, torch.Tensor]:
    """‖g_i‖² of every trainable weight and bias (ghost norms of each affine map)."""
    out: dict[str, torch.Tensor] = {}
    for term in _cached_terms(module, activations, backprops):
        if _trainable(module, term.weight):
            out[term.weight] = affine_weight_norms(term.inputs, term.grads)
        if _trainable(module, term.bias):
            out[term.bias] = affine_bias_norms(term.grads)
    return out


def recurrent_clipped_sum(
    module: nn.RNNBase,
    activations: tuple,
    backprops: tuple,
    factors: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Σ_i f_i g_i of every weight and bias named in ``factors`` (book-keeping)."""
    out: dict[str, torch.Tensor] = {}
    for term in _cached_terms(module, activations, backprops):
        if term.weight in factors:
            out[term.weight] = affine_weight_clipped_sum(
                term.inputs, term.grads, factors[term.weight]
            )
        if term.bias is not None and term.bias in factors:
            out[term.bias] = affine_bias_clipped_sum(term.grads, factors[term.bias])
    return out


def recurrent_per_example(
    module: nn.RNNBase, activations: tuple, backprops: tuple
) -> dict[str, torch.Tensor]:
    """The per-example gradients g_i of every trainable weight and bias, shape (B, *shape)."""
    out: dict[str, torch.Tensor] = {}
    for term in _cached_terms(module, activations, backprops):
        if _trainable(module, term.weight):
            out[term.weight] = affine_weight_per_example(term.inputs, term.grads)
        if _trainable(module, term.bias):
            out[term.bias] = term.grads.sum(1)
    return out


def recurrent_prefers_per_example(module: nn.RNNBase, activations: tuple, backprops: tuple) -> bool:
    """Keep the per-example gradients when every affine map would (the Linear criterion)."""
    x = activations[0]
    steps = x.shape[1 if module.batch_first else 0]
    width = _GATES[module.mode] * module.hidden_size
    directions = 2 if module.bidirectional else 1
    sizes = [module.input_size] + [directions * module.hidden_size] * (module.num_layers - 1)
    return all(
        keeping_per_example_is_cheaper(steps, d_in, width) for d_in in (*sizes, module.hidden_size)
    )


for _module_type in (nn.RNN, nn.GRU, nn.LSTM):
    register_layer_rule(
        _module_type,
        norm_fn=recurrent_norms,
        clipped_sum_fn=recurrent_clipped_sum,
        per_example_fn=recurrent_per_example,
        prefer_per_example=recurrent_prefers_per_example,
        output_record_dims=recurrent_output_record_dims,
        check_fn=recurrent_check,
    )
