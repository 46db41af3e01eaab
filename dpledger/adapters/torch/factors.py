"""Per-example factors f_i as the engines accept them.

Clipping strategies reduce to per-example factors (flat clipping f_i = min(1, C/‖g_i‖), global
clipping f_i = 1{‖g_i‖ ≤ C}, automatic clipping f_i = C/(‖g_i‖ + γ), one factor per group for
per-layer clipping), and the engines form Σ_i f_i g_i from them. A caller passes either one
tensor of shape (B,) used for every parameter, or a mapping from parameter name to a tensor of
shape (B,) that covers every trainable parameter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from dpledger.errors import InvalidParameterError

__all__ = ["expand_factors"]


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
    factors: torch.Tensor | Mapping[str, torch.Tensor],
    *,
    names: Sequence[str],
    batch_size: int,
) -> dict[str, torch.Tensor]:
    """Return ``{name: f}`` for every name in ``names``, each f of shape (batch_size,).

    Raises:
        InvalidParameterError: a tensor of the wrong shape or dtype, a mapping that misses a
            trainable parameter or names one the engine does not know.
    """
    if isinstance(factors, torch.Tensor):
        f = _check_vector("factors", factors, batch_size)
        return dict.fromkeys(names, f)
    if not isinstance(factors, Mapping):
        raise InvalidParameterError(
            "factors", type(factors).__name__, "a tensor of shape (B,) or a mapping name -> tensor"
        )
    missing = [n for n in names if n not in factors]
    if missing:
        raise InvalidParameterError(
            "factors", f"<mapping without {missing}>", "a factor tensor for every parameter"
        )
    known = set(names)
    unknown = [k for k in factors if k not in known]
    if unknown:
        raise InvalidParameterError(
            "factors", f"<mapping with unknown names {unknown}>", f"names among {list(names)}"
        )
    return {n: _check_vector(f"factors[{n!r}]", factors[n], batch_size) for n in names}
