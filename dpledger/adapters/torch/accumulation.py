"""Per-example clipping into the step's accumulated clipped sums.

:class:`ClippedSumAccumulation` is the part of
:class:`~dpledger.adapters.torch.optimizer.DPOptimizer` between the backward and the release:
it clips the pending batch's per-example gradients per group (factors in float64 on the
parameters' device, :meth:`ClippedSumAccumulation.clip` forming the clipped sums), adds them to
the sums of the step being assembled (several chunks with virtual batches), and, with a
:class:`~dpledger.adapters.torch.UserPoissonBatchSampler`, first sums the gradients of each
user's records. Nothing here releases or records anything: an error drops the step for free.

The state it keeps on the optimizer (set up by ``DPOptimizer.__init__``): ``_acc`` (the clipped
sums per parameter name, None between steps), ``_acc_count`` (records, or users, in them),
``_acc_bad`` (records with a non-finite norm, on the device), ``_claimed_event`` (user-level:
the draw claimed at the step), and for the bias metrics ``_acc_unclipped``, ``_acc_norms`` and
``_acc_clipped``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dpledger.adapters.torch.factors import expand_factors, strategy_factors
from dpledger.adapters.torch.functional_gradients import clipped_sum_of, squared_norms_of
from dpledger.adapters.torch.user_level import UserBatch, UserPoissonBatchSampler
from dpledger.errors import EngineStateError, InvalidParameterError, SamplerMismatchError
from dpledger.mechanisms import ScaledGaussianSumQuery
from dpledger.mechanisms.gradient_queries import GradientQueries

__all__ = ["ClippedSumAccumulation", "MaterialisedGradients", "refuse_virtual_batches"]

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


class ClippedSumAccumulation:
    """Clipping and accumulation of :class:`~dpledger.adapters.torch.optimizer.DPOptimizer`
    (a base class of it; see the module docstring for the state it keeps)."""

    # ------------------------------------------------------------------ clipping
    def clip(
        self, source: Any, factors: dict[tuple[str, ...], torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The clipped sums Σ_i f_ig·g_ig of a batch, per parameter (an override point).

        Called once per batch (once per chunk with virtual batches) after the clip factors
        were computed from the records' group norms with the chosen clipping strategy, on the
        parameters' device in float64, and before the sums are added to the step's. The
        default forms the sums on the device without materialising g_i where the engine can
        (book-keeping).

        Contract: the result holds, for every trainable parameter name, a tensor of the
        parameter's shape, and record i's contribution to group g, Σ_{p in g} f_ig·g_ip, has L2
        norm at most S_g (the clip bound ``queries`` gives the group). The ledger records S_g
        as the sensitivity of each group's sum-query event whatever this method does: the
        release's sensitivity check only bounds the whole sum by |R|·S_g, so an override that
        lets one record contribute more than S_g makes the recorded ε wrong.

        Args:
            source: the batch's per-example gradients: the
                :class:`~dpledger.adapters.torch.engine.PerExampleGradientEngine` (hook path) or
                a :class:`MaterialisedGradients` (functional path, user-level vectors), with
                ``squared_norms()``, ``clipped_sum(factors)`` and ``batch_size``.
            factors: ``{group's parameter names: factors of shape (B,)}``, float64 on the
                parameters' device; zero for a record with a non-finite norm.

        Returns:
            ``{parameter name: Σ_i f_ig·g_ip}`` in at least float32, on the parameters' device.
        """
        return source.clipped_sum(factors)

    def _source(self) -> Any:
        if self._engine is not None:
            return self._engine
        assert self._functional is not None
        return self._functional

    def _absorb(self) -> None:
        """Clip the pending batch's per-example gradients and add them to the step's sums."""
        if self._user_level:
            self._absorb_users()
            return
        source = self._source()
        batch = source.batch_size
        self._clip_and_add(source, batch)
        self._acc_count += batch
        self._discard_pending()

    def _absorb_users(self) -> None:
        """User-level: claim the batch's draw, sum (or average) the per-example gradients of
        each user, clip each user's vector as one and add the clipped sum to the step's sums."""
        assert isinstance(self._sampler, UserPoissonBatchSampler)
        if self._final_chunk is not None or self._acc is not None:
            refuse_virtual_batches()
        source = self._source()
        batch = source.batch_size
        try:
            event, users = self._sampler.claim_users(batch)
        except SamplerMismatchError:
            self._discard_pending()
            self._reset()
            raise
        per_user = MaterialisedGradients(self._user_gradients(source, users), self._names)
        self._clip_and_add(per_user, users.num_users)
        self._acc_count = users.num_users  # the sum query's sample: users, not records
        self._claimed_event = event
        self._discard_pending()

    def _user_gradients(self, source: Any, users: UserBatch) -> dict[str, torch.Tensor]:
        """G_u = Σ_{i of u} g_i (or its mean) for each user of the batch, ``{name: (U, ...)}``,
        from the materialised per-example gradients, in at least float32."""
        if isinstance(source, MaterialisedGradients):
            grads = source.grads
        else:
            grads = source.per_example_gradients()
        index = users.user_index.to(self._device)
        counts = None
        if self._user_gradient == "mean":
            counts = torch.bincount(index, minlength=users.num_users)
        out = {}
        with torch.no_grad():
            for n in self._names:
                g = grads[n]
                g = g.to(torch.promote_types(g.dtype, torch.float32))
                total = g.new_zeros((users.num_users, *g.shape[1:])).index_add_(0, index, g)
                if counts is not None:
                    total /= counts.to(total.dtype).view(-1, *([1] * (total.dim() - 1)))
                out[n] = total
        return out

    def _clip_and_add(self, source: Any, batch: int) -> None:
        """Clip the ``batch`` vectors of ``source`` per group and add their sum to the step's.

        The group norms and clip factors stay on the parameters' device, in float64: no copy to
        the host and no synchronisation. A record whose group norm is not finite (or whose
        squared norm is negative) is counted on the device; the release
        (:meth:`~dpledger.adapters.torch.release.NoisyRelease.release`) refuses a step with such
        a record before anything is recorded.
        """
        squared = source.squared_norms()
        queries = self._queries
        reduce, bounds, host_rows = self._layout(queries)
        stacked = torch.stack([squared[n] for n in self._names]).to(torch.float64)
        norms = (reduce @ stacked).sqrt_()  # (G, B): each group's (scaled) record norms
        bad = (~torch.isfinite(norms)).sum() + (stacked < 0).sum()
        self._acc_bad = bad if self._acc_bad is None else self._acc_bad + bad
        factors = strategy_factors(queries.queries[0].clipping, norms, bounds=bounds)
        if factors is None or host_rows:  # a strategy without a device formula: on the host
            factors = self._host_factors(queries, norms, bad)
        factors = torch.where(factors < self._tiny, torch.zeros_like(factors), factors)
        mapping = {members: factors[g] for g, members in enumerate(queries.members)}
        with torch.no_grad():
            sums = self.clip(source, mapping)
            if self._acc is None:
                self._acc = {n: sums[n] for n in self._names}
            else:
                torch._foreach_add_(
                    [self._acc[n] for n in self._names], [sums[n] for n in self._names]
                )
            if self._bias_callback is not None:  # not private; host copies are fine here
                total = stacked.sum(0).cpu().numpy()
                host_norms = norms.cpu().numpy()
                self._absorb_metrics(source, total, factors.cpu().numpy(), list(host_norms), batch)

    def _host_factors(
        self, queries: GradientQueries, norms: torch.Tensor, bad: torch.Tensor
    ) -> torch.Tensor:
        """Factors of strategies with no device formula, by the queries on the host."""
        host = norms.cpu().numpy()
        if int(bad) > 0:
            host = np.where(np.isfinite(host), host, 0.0)  # the step is refused at release
        factors = np.stack(
            [
                query.clip_factors(host[g], margin=self._clip_margin)
                for g, query in enumerate(queries.queries)
            ]
        )
        return torch.from_numpy(factors).to(self._device)

    def _layout(self, queries: GradientQueries) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """A weight matrix summing the per-parameter squared norms of each group into one row
        (with weights 1/α_j² for joint scaled groups), the groups' clip bounds S_g·(1 − ρ) as a
        column, and whether the groups' strategies differ (then factors come from the host).
        Cached per set of queries."""
        cached = self._layouts.get(id(queries))
        if cached is not None and cached[0] is queries:
            return cached[1], cached[2], cached[3]
        reduce = torch.zeros(len(queries.queries), len(self._names), dtype=torch.float64)
        for g, (query, members) in enumerate(zip(queries.queries, queries.members, strict=True)):
            scales = query.scales if isinstance(query, ScaledGaussianSumQuery) else None
            for j, n in enumerate(members):
                reduce[g, self._index_of[n]] = 1.0 if scales is None else 1.0 / scales[j] ** 2
        rho = self._clip_margin or 0.0
        bounds = torch.tensor(
            [[q.l2_norm_bound * (1.0 - rho)] for q in queries.queries], dtype=torch.float64
        )
        mixed = len({q.clipping for q in queries.queries}) > 1
        reduce, bounds = reduce.to(self._device), bounds.to(self._device)
        self._layouts = {id(queries): (queries, reduce, bounds, mixed)}
        return reduce, bounds, mixed

    def _absorb_metrics(
        self,
        source: Any,
        total_squared: np.ndarray,
        factors: np.ndarray,
        group_norms: list[np.ndarray],
        batch: int,
    ) -> None:
        ones = torch.ones(batch, dtype=torch.float64, device=self._device)
        unclipped = source.clipped_sum(ones)
        if self._acc_unclipped is None:
            self._acc_unclipped = {n: unclipped[n] for n in self._names}
        else:
            for n in self._names:
                self._acc_unclipped[n].add_(unclipped[n])
        self._acc_norms.append(np.sqrt(total_squared))
        clipped = np.zeros(batch, dtype=bool)
        for g, norms in enumerate(group_norms):
            clipped |= (factors[g] < 1.0 - _CLIPPED_TOLERANCE) & (norms > 0.0)
        self._acc_clipped += int(clipped.sum())

    def _reset(self) -> None:
        self._acc = None
        self._acc_count = 0
        self._acc_unclipped = None
        self._acc_norms = []
        self._acc_clipped = 0
        self._acc_bad = None
        self._claimed_event = None

    # ------------------------------------------------------------------ virtual batches
    def virtual_step(self) -> None:
        """Accumulate this chunk's clipped sum into the open logical step (no release)."""
        if self._user_level:
            refuse_virtual_batches()
        self._check_foreign_gradients()
        if not self._pending():
            raise EngineStateError(
                "virtual_step() without a backward since the last step: run the chunk's "
                "forward and loss.backward() first"
            )
        self._absorb_or_drop()

    def _absorb_or_drop(self) -> None:
        """:meth:`_absorb`; on any error (out of memory, a module's own error) drop the step.

        Nothing has been released or recorded at this point, so dropping is free of privacy
        cost: the batch's stored activations, per-example results and the chunks of an open
        virtual step are let go (the memory a retry at a smaller batch needs), the batch's draw
        is discarded as by ``zero_grad()``, and the error is raised with a note saying so.
        """
        try:
            self._run_deferred_probe()  # a compiled forward's probe, before anything is used
            self._absorb()
        except BaseException as exc:
            self._discard_pending()
            self._reset()
            if self._sampler is not None and not self._user_level:
                self._sampler.discard_draw()
            exc.add_note(
                "dpledger: this step was dropped before anything was released or recorded; "
                "its stored activations and per-example gradients were freed, and the next "
                "batch can be stepped (a retry at a smaller batch size works in this process)"
            )
            raise
