"""What :class:`~dpledger.adapters.torch.optimizer.DPOptimizer` needs of torch between the
backward and the release: the clip factors on the device, user-level sums and bias sums.

The step's sequence is the core's (:class:`~dpledger.mechanisms.dp_step.DPStep`); this module
holds its torch half. :class:`DeviceFactors` forms every group's factors f_ig on the parameters'
device in float64 from the per-parameter squared norms, with the layout (group weights, bounds
S_g·(1 − ρ)) of :meth:`~dpledger.mechanisms.dp_step.DPStep.factor_layout`: no copy to the host
and no synchronisation. :func:`user_gradients` sums (or averages) each user's per-example
gradients for user-level DP. :class:`BiasSums` keeps the unclipped sums, norms and clipped counts
of the bias metrics (not private). Nothing here releases or records anything.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dpledger.adapters.torch.factors import expand_factors, strategy_factors
from dpledger.adapters.torch.functional_gradients import clipped_sum_of, squared_norms_of
from dpledger.adapters.torch.user_level import UserBatch
from dpledger.errors import InvalidParameterError
from dpledger.mechanisms.dp_step import DPStep
from dpledger.mechanisms.gradient_queries import GradientQueries

__all__ = [
    "BiasSums",
    "DeviceFactors",
    "MaterialisedGradients",
    "refuse_virtual_batches",
    "user_gradients",
]

_CLIPPED_TOLERANCE = 1e-9


class MaterialisedGradients:
    """Per-example gradients computed functionally, with the engine's interface."""

    def __init__(self, grads: dict[str, torch.Tensor], names: tuple[str, ...]) -> None:
        self.grads = grads
        self.names = names
        self.batch_size = next(iter(grads.values())).shape[0]

    def squared_norms(self) -> dict[str, torch.Tensor]:
        return squared_norms_of(self.grads)

    def clipped_sum(self, factors: Any) -> dict[str, torch.Tensor]:
        return clipped_sum_of(
            self.grads, expand_factors(factors, names=self.names, batch_size=self.batch_size)
        )


def refuse_virtual_batches() -> None:
    """Refuse virtual batches with user-level sampling."""
    raise InvalidParameterError(
        "sampler",
        "UserPoissonBatchSampler",
        "a record-level sampler for virtual batches: with user-level sampling a user's records "
        "split over chunks would be clipped chunk by chunk, not as one vector; step on the "
        "whole batch",
    )


def user_gradients(
    source: Any, users: UserBatch, *, names: tuple[str, ...], device: Any, mean: bool
) -> MaterialisedGradients:
    """G_u = Σ_{i of u} g_i (or its mean) for each user of the batch, from the materialised
    per-example gradients of ``source``, in at least float32."""
    if isinstance(source, MaterialisedGradients):
        grads = source.grads
    else:
        grads = source.per_example_gradients()
    index = users.user_index.to(device)
    counts = torch.bincount(index, minlength=users.num_users) if mean else None
    out = {}
    with torch.no_grad():
        for n in names:
            g = grads[n]
            g = g.to(torch.promote_types(g.dtype, torch.float32))
            total = g.new_zeros((users.num_users, *g.shape[1:])).index_add_(0, index, g)
            if counts is not None:
                total /= counts.to(total.dtype).view(-1, *([1] * (total.dim() - 1)))
            out[n] = total
    return MaterialisedGradients(out, names)


class DeviceFactors:
    """Every group's clip factors on the parameters' device (see the module docstring).

    Args:
        step: the core step (its queries and margins).
        names: the trainable parameters' names.
        device: the parameters' device.
        tiny: the largest smallest-normal of the parameters' dtypes: a smaller factor is 0.
    """

    def __init__(self, step: DPStep, *, names: tuple[str, ...], device: Any, tiny: float) -> None:
        self._step = step
        self._names = names
        self._device = device
        self._tiny = tiny
        self._layouts: dict[int, tuple[GradientQueries, torch.Tensor, torch.Tensor, bool]] = {}

    def _layout(self, queries: GradientQueries) -> tuple[torch.Tensor, torch.Tensor, bool]:
        cached = self._layouts.get(id(queries))
        if cached is not None and cached[0] is queries:
            return cached[1], cached[2], cached[3]
        weights, bounds, mixed = self._step.factor_layout(self._names, queries)
        reduce = torch.from_numpy(weights).to(self._device)
        column = torch.from_numpy(bounds).to(self._device)
        self._layouts = {id(queries): (queries, reduce, column, mixed)}
        return reduce, column, mixed

    def __call__(
        self, squared: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(factors (G, B), norms (G, B), stacked squared norms (P, B), bad)`` in float64 on
        the device; ``bad`` counts the records whose norm is not finite (or whose squared norm
        is negative), whose factors are 0 (the release refuses such a step)."""
        queries = self._step.queries
        reduce, bounds, host_rows = self._layout(queries)
        stacked = torch.stack([squared[n] for n in self._names]).to(torch.float64)
        norms = (reduce @ stacked).sqrt_()  # (G, B): each group's (scaled) record norms
        bad = (~torch.isfinite(norms)).sum() + (stacked < 0).sum()
        factors = strategy_factors(queries.queries[0].clipping, norms, bounds=bounds)
        if factors is None or host_rows:  # a strategy without a device formula: on the host
            host = self._step.factors_of_norms(norms.cpu().numpy())
            factors = torch.from_numpy(host).to(self._device)
        factors = torch.where(factors < self._tiny, torch.zeros_like(factors), factors)
        return factors, norms, stacked, bad


class BiasSums:
    """The unclipped sums, per-example norms and clipped counts of one step's bias metrics
    (not private; host copies are fine here)."""

    def __init__(self) -> None:
        self.unclipped: dict[str, torch.Tensor] | None = None
        self.norms: list[np.ndarray] = []
        self.clipped = 0

    def zeros(self, params: dict[str, torch.Tensor]) -> None:
        """The sums of an empty step."""
        self.unclipped = {n: torch.zeros_like(p) for n, p in params.items()}

    def add(
        self,
        source: Any,
        *,
        names: tuple[str, ...],
        stacked: torch.Tensor,
        norms: torch.Tensor,
        factors: torch.Tensor,
    ) -> None:
        """Add a batch: its unclipped sum, its records' norms and how many were clipped."""
        batch = source.batch_size
        ones = torch.ones(batch, dtype=torch.float64, device=stacked.device)
        unclipped = source.clipped_sum(ones)
        if self.unclipped is None:
            self.unclipped = {n: unclipped[n] for n in names}
        else:
            for n in names:
                self.unclipped[n].add_(unclipped[n])
        self.norms.append(np.sqrt(stacked.sum(0).cpu().numpy()))
        host_factors, host_norms = factors.cpu().numpy(), norms.cpu().numpy()
        clipped = np.zeros(batch, dtype=bool)
        for g, group_norms in enumerate(host_norms):
            clipped |= (host_factors[g] < 1.0 - _CLIPPED_TOLERANCE) & (group_norms > 0.0)
        self.clipped += int(clipped.sum())
