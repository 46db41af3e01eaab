"""The torch half of :class:`~dpledger.adapters.torch.optimizer.DPOptimizer`'s release.

The release's sequence (sensitivity check → record → noise → average) is the core's
(:meth:`~dpledger.mechanisms.dp_step.DPStep.release`); what needs torch is here: the step's
noise through the optimizer's :meth:`~dpledger.adapters.torch.optimizer.DPOptimizer.add_noise`
(:class:`OptimizerNoiseBackend`), a group's arrays concatenated into the one vector its query
releases and split back (:func:`grouped_sums`, :func:`ungroup`), and the NaN that marks a step
with a record whose norm was not finite (:func:`poison_sums`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dpledger.adapters.torch.backend import TorchBackend
from dpledger.mechanisms import ScaledGaussianSumQuery
from dpledger.mechanisms.gradient_queries import GradientQueries

__all__ = ["OptimizerNoiseBackend", "grouped_sums", "poison_sums", "ungroup"]


class OptimizerNoiseBackend(TorchBackend):
    """The torch backend of an optimizer's sum queries: its noise is the optimizer's
    ``add_noise``, called with the σ̃ the queries record.

    Args:
        add_noise: ``add_noise(sums, stddevs=..., generator=...)``, the optimizer's method.
    """

    def __init__(self, add_noise: Any) -> None:
        self._add_noise = add_noise

    def add_gaussian_noise(self, x: Any, *, stddev: float, generator: Any) -> Any:
        """x + N(0, σ̃² I) by the optimizer's ``add_noise``."""
        return self._add_noise([x], stddevs=[stddev], generator=generator)[0]

    def add_gaussian_noise_many(
        self, xs: list[Any], *, stddevs: list[float], generator: Any
    ) -> list[Any]:
        """x_j + N(0, σ̃_j² I) for every tensor, by the optimizer's ``add_noise``."""
        return self._add_noise(list(xs), stddevs=list(stddevs), generator=generator)


def grouped_sums(
    queries: GradientQueries, by_name: dict[str, torch.Tensor]
) -> list[list[torch.Tensor]]:
    """Each group's arrays to release.

    A group under separate clipping is one concatenated vector (McMahan & Andrew, section 2):
    its members' sums are released as one flat array — the same norm, the same i.i.d. noise per
    coordinate — in a few large operations instead of several small ones per parameter. Joint
    scaled groups keep one array per scale.
    """
    out = []
    for query, members in zip(queries.queries, queries.members, strict=True):
        parts = [by_name[n] for n in members]
        if len(parts) > 1 and not isinstance(query, ScaledGaussianSumQuery):
            parts = [torch.cat([t.reshape(-1) for t in parts])]
        out.append(parts)
    return out


def ungroup(
    queries: GradientQueries,
    by_name: dict[str, torch.Tensor],
    grouped: list[list[torch.Tensor]],
    released: list[torch.Tensor],
    names: tuple[str, ...],
) -> list[torch.Tensor]:
    """The released group arrays split back into one tensor per parameter, in ``names``'
    order."""
    by_name_out: dict[str, torch.Tensor] = {}
    arrays = iter(released)
    for members, parts in zip(queries.members, grouped, strict=True):
        if len(parts) == len(members):
            for n in members:
                by_name_out[n] = next(arrays)
        else:
            flat = next(arrays)
            pieces = flat.split([by_name[n].numel() for n in members])
            for n, piece in zip(members, pieces, strict=True):
                by_name_out[n] = piece.view(by_name[n].shape)
    return [by_name_out[n] for n in names]


def poison_sums(sums: list[torch.Tensor], bad: torch.Tensor) -> None:
    """Make the sums NaN when a record's norm was not finite.

    A record whose norm is not finite makes the clipped sum NaN (on the device, no
    synchronisation), which the sensitivity check refuses before anything is recorded; adding 0
    leaves every other sum as it is.
    """
    first = next((s for s in sums if s.numel() > 0), None)
    if first is not None:
        poison = torch.where(bad > 0, math.nan, 0.0)
        first.view(-1)[:1].add_(poison.to(first.dtype))
