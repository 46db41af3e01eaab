"""Layer rules for layer types of Hugging Face ``transformers`` (imported only when met).

* ``transformers.pytorch_utils.Conv1D`` (GPT-2's projections): y = x W + b with W of shape
  (d_in, d_out), i.e. ``nn.Linear`` with the weight transposed. Its per-example quantities are
  the Linear ones (ghost norms, book-keeping clipped sum, or materialised G_i) with W's gradient
  transposed.
* The RMSNorm layers of Llama-style decoders (``LlamaRMSNorm`` and every class of
  ``transformers`` whose ``forward`` has the same source: Mistral, Qwen2/3, Phi-3, ...):
  y = w ⊙ cast(x̂), x̂ = x / sqrt(mean(x²) + ε) computed in float32 and cast back to the input's
  dtype. The per-example gradient of w is Σ_t b_it ⊙ cast(x̂_it).

The types are recognised by their qualified names when the engine first meets them (a resolver,
see :func:`~dpledger.adapters.torch.registry.register_rule_resolver`), so dpledger does not
import ``transformers`` and a model without it pays nothing. An RMSNorm class whose ``forward``
differs from Llama's (Gemma's 1 + w, T5's) is left to the generic path, which is exact for any
forward.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from types import SimpleNamespace

import torch
from torch import nn

from dpledger.adapters.torch.layer_rules.linear import (
    linear_clipped_sum,
    linear_norms,
    linear_per_example,
    linear_prefers_per_example,
)
from dpledger.adapters.torch.layer_rules.normalization import _affine
from dpledger.adapters.torch.registry import LayerRule, register_rule_resolver

__all__ = [
    "conv1d_clipped_sum",
    "conv1d_norms",
    "conv1d_per_example",
    "conv1d_prefers_per_example",
    "llama_rms_norm_per_example",
]

_CONV1D = "transformers.pytorch_utils.Conv1D"
_LLAMA_RMS_NORM = ("transformers.models.llama.modeling_llama", "LlamaRMSNorm")


def _as_linear(module: nn.Module) -> SimpleNamespace:
    """The ``nn.Linear`` view of a Conv1D: in/out features and the (transposed) parameters."""
    d_in, d_out = module.weight.shape
    return SimpleNamespace(
        in_features=d_in, out_features=d_out, weight=module.weight, bias=module.bias
    )


def conv1d_norms(
    module: nn.Module, activations: tuple, backprops: torch.Tensor
) -> dict[str, torch.Tensor]:
    """‖G_i‖² and ‖β_i‖² of a Conv1D (the transpose does not change a norm)."""
    return linear_norms(_as_linear(module), activations, backprops)


def conv1d_clipped_sum(
    module: nn.Module,
    activations: tuple,
    backprops: torch.Tensor,
    factors: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Σ_i f_i G_i (shape (d_in, d_out)) and Σ_i f_i β_i of a Conv1D."""
    out = linear_clipped_sum(_as_linear(module), activations, backprops, factors)
    if "weight" in out:
        out["weight"] = out["weight"].t()
    return out


def conv1d_per_example(
    module: nn.Module, activations: tuple, backprops: torch.Tensor
) -> dict[str, torch.Tensor]:
    """G_i of shape (B, d_in, d_out) and β_i of shape (B, d_out) of a Conv1D."""
    out = linear_per_example(_as_linear(module), activations, backprops)
    if "weight" in out:
        out["weight"] = out["weight"].transpose(1, 2)
    return out


def conv1d_prefers_per_example(
    module: nn.Module, activations: tuple, backprops: torch.Tensor
) -> bool:
    """The Linear criterion (see :func:`~.linear.linear_prefers_per_example`)."""
    return linear_prefers_per_example(_as_linear(module), activations, backprops)


def llama_rms_norm_per_example(
    module: nn.Module, activations: tuple, backprops: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per-example gradient of a Llama-style RMSNorm's weight, shape (B, hidden).

    x̂ is formed in float32 as the forward forms it; the forward's cast of x̂ back to a 16-bit
    input dtype under autocast is not repeated (the engine hands samplers inputs promoted to
    at least float32), which moves g_i by at most that dtype's rounding.
    """
    x = activations[0]
    x32 = x.to(torch.float32)
    xhat = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
    return _affine(module, backprops, xhat.to(backprops.dtype), x.shape[0], (x.shape[-1],))


def _qualified(module_type: type) -> str:
    return f"{module_type.__module__}.{module_type.__qualname__}"


def _forward_source(module_type: type) -> str | None:
    try:
        return inspect.getsource(module_type.forward)
    except (OSError, TypeError):
        return None


def _is_llama_rms_norm(module_type: type) -> bool:
    if not module_type.__name__.endswith("RMSNorm"):
        return False
    module_name, class_name = _LLAMA_RMS_NORM
    try:
        llama = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError):
        return False
    if module_type is llama or module_type.forward is llama.forward:
        return True
    ours, theirs = _forward_source(module_type), _forward_source(llama)
    return ours is not None and ours == theirs


def _resolve(module_type: type[nn.Module]) -> LayerRule | None:
    """The sampler of a ``transformers`` layer type, or None for any other type."""
    if not module_type.__module__.startswith("transformers."):
        return None
    if _qualified(module_type) == _CONV1D:
        return LayerRule(
            norm_fn=conv1d_norms,
            clipped_sum_fn=conv1d_clipped_sum,
            per_example_fn=conv1d_per_example,
            prefer_per_example=conv1d_prefers_per_example,
        )
    if _is_llama_rms_norm(module_type):
        return LayerRule(per_example_fn=llama_rms_norm_per_example)
    return None


register_rule_resolver(_resolve)
