"""Per-example factors f_i as the engines accept them.

Clipping strategies reduce to per-example factors (flat clipping f_i = min(1, C/‖g_i‖), global
clipping f_i = 1{‖g_i‖ ≤ C}, automatic clipping f_i = C/(‖g_i‖ + γ), one factor per group for
per-layer clipping), and the engines form Σ_i f_i g_i from them. A caller passes either one
tensor of shape (B,) used for every parameter, or a mapping from parameter names (or tuples of
names, for a group of parameters clipped together) to tensors of shape (B,) that covers every
trainable parameter exactly once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from dpledger.errors import InvalidParameterError
from dpledger.mechanisms.clipping import (
    AutomaticClipping,
    ClippingStrategy,
    FlatClipping,
    GlobalClipping,
)

__all__ = ["expand_factors", "strategy_factors"]


def _check_vector(name: str, value: object, batch_size: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != (batch_size,):
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise InvalidParameterError(
            name, shape, f"a torch.Tensor of shape ({batch_size},), one factor per example"
        )
    if value.is_complex() or not value.is_floating_point():
        raise InvalidParameterError(name, value.dtype, "a floating-point tensor")
    return value


def expand_factors(
    factors: torch.Tensor | Mapping[str | tuple[str, ...], torch.Tensor],
    *,
    names: Sequence[str],
    batch_size: int,
) -> dict[str, torch.Tensor]:
    """Return ``{name: f}`` for every name in ``names``, each f of shape (batch_size,).

    Args:
        factors: one tensor of shape (B,) for every parameter, or a mapping whose keys are
            parameter names or tuples of parameter names (a group sharing one factor tensor);
            every name must be covered exactly once.
        names: the trainable parameter names.
        batch_size: B.

    Raises:
        InvalidParameterError: a tensor of the wrong shape or dtype, a mapping that misses a
            trainable parameter, names one twice, or names one the engine does not know.
    """
    if isinstance(factors, torch.Tensor):
        f = _check_vector("factors", factors, batch_size)
        return dict.fromkeys(names, f)
    if not isinstance(factors, Mapping):
        raise InvalidParameterError(
            "factors", type(factors).__name__, "a tensor of shape (B,) or a mapping name -> tensor"
        )
    known = set(names)
    out: dict[str, torch.Tensor] = {}
    for key, value in factors.items():
        group = key if isinstance(key, tuple) else (key,)
        f = _check_vector(f"factors[{key!r}]", value, batch_size)
        for n in group:
            if n not in known:
                raise InvalidParameterError(
                    "factors", f"<mapping with unknown name {n!r}>", f"names among {list(names)}"
                )
            if n in out:
                raise InvalidParameterError(
                    "factors", f"<mapping that names {n!r} twice>", "each parameter once"
                )
            out[n] = f
    missing = [n for n in names if n not in out]
    if missing:
        raise InvalidParameterError(
            "factors", f"<mapping without {missing}>", "a factor tensor for every parameter"
        )
    return {n: out[n] for n in names}


def strategy_factors(
    strategy: ClippingStrategy, norms: torch.Tensor, *, bounds: torch.Tensor
) -> torch.Tensor | None:
    """The built-in clipping strategies' factors on the device, in the norms' dtype (float64).

    The same formulas as :meth:`~dpledger.mechanisms.ClippingStrategy.factors` on the host, for
    norms (G, B) and bounds (G, 1): flat min(1, S/‖v_i‖) (S/‖v_i‖ where ‖v_i‖ > S, else 1),
    global 1{‖v_i‖ ≤ S}, automatic S/(‖v_i‖ + γ). None for any other strategy (its factors are
    computed on the host). The norms must be validated by the caller (finite, ≥ 0).
    """
    kind = type(strategy)
    if kind is FlatClipping:
        return torch.where(norms > bounds, bounds / norms, torch.ones_like(norms))
    if kind is GlobalClipping:
        return (norms <= bounds).to(norms.dtype)
    if kind is AutomaticClipping:
        return bounds / (norms + strategy.stability)
    return None
