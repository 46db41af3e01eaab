"""One recomputation per step for layer rules that rebuild a layer's internals.

The recurrent and attention samplers recompute a layer's forward on the whole batch to get the
gradients of values the layer does not expose (gate pre-activations; projected queries, keys and
values). The engine asks for the norms and then for the clipped sum of the same step, so the
recomputation is cached: keyed by the first output gradient the engine captured (held weakly, so
that the entry goes when the engine drops the step's gradients) and stamped with the identities
of the inputs and gradients and the versions of the module's parameters, so that a changed input
or an optimizer update in between is never served a stale result.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

__all__ = ["cached_per_step"]

T = TypeVar("T")

_CACHE: dict[int, tuple[weakref.ref, tuple, Any]] = {}


def cached_per_step(
    module: nn.Module,
    inputs: Sequence[torch.Tensor | None],
    backprops: Sequence[torch.Tensor | None],
    compute: Callable[[nn.Module, tuple, tuple], T],
    activations: tuple,
) -> T:
    """``compute(module, activations, backprops)``, computed once per step.

    Args:
        module: the layer.
        inputs: the stored tensors the result depends on (None entries are ignored).
        backprops: the output gradients the engine passes (a tuple, one entry per output).
        compute: the recomputation.
        activations: the layer's forward arguments, passed to ``compute``.

    Returns:
        The cached or freshly computed result.
    """
    key = next(g for g in backprops if g is not None)
    stamp = (
        id(module),
        tuple(id(t) for t in inputs if t is not None),
        tuple(id(g) for g in backprops),
        tuple(p._version for p in module.parameters()),
    )
    hit = _CACHE.get(id(key))
    if hit is not None and hit[0]() is key and hit[1] == stamp:
        return hit[2]
    result = compute(module, activations, tuple(backprops))
    ident = id(key)
    # the callback holds the cache itself: at interpreter exit the module global may be gone
    _CACHE[ident] = (
        weakref.ref(key, lambda _, cache=_CACHE: cache.pop(ident, None)),
        stamp,
        result,
    )
    return result
