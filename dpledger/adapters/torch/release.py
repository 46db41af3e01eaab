"""The noisy release of :class:`~dpledger.adapters.torch.optimizer.DPOptimizer`'s step.

:class:`NoisyRelease` turns the step's accumulated clipped sums into the gradients the wrapped
optimizer applies, in this order:

1. the step is tied to the sampler's draw (:meth:`NoisyRelease._claim_draw`): a batch the
   sampler did not draw is refused before anything is recorded;
2. under ``torch.distributed`` the counts, then the sums are added up over the ranks;
3. on rank 0, :meth:`NoisyRelease.release`: validation and the sensitivity check of every group
   (one read-back of the sums' norms) *before* the sampling event is recorded, so that a refused
   step leaves the ledger unchanged; then the sampling event, the noise
   (:meth:`NoisyRelease.add_noise`, float64, from the optimizer's generator) with one sum-query
   event (S_g, σ̃_g) per group, and the fixed-denominator average; the averages are broadcast
   to the other ranks;
4. ``p.grad`` is set and the wrapped optimizer steps; the bias metrics, if asked for, follow.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from dpledger.adapters.torch.backend import TorchBackend
from dpledger.adapters.torch.distributed import broadcast_tensors, reduce_tensors, sum_counts
from dpledger.adapters.torch.sharding import local_gradient
from dpledger.errors import InvalidParameterError, NoiseStreamEndError, SamplerMismatchError
from dpledger.ledger import SamplingEvent
from dpledger.mechanisms import ScaledGaussianSumQuery
from dpledger.mechanisms.backend import add_noise_to_all
from dpledger.mechanisms.gradient_queries import GradientQueries
from dpledger.mechanisms.step import SampledStep, open_step

__all__ = ["NoisyRelease", "OptimizerNoiseBackend"]


class OptimizerNoiseBackend(TorchBackend):
    """The torch backend of an optimizer's sum queries: its noise is the optimizer's
    :meth:`NoisyRelease.add_noise`, called with the σ̃ the queries record.

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


class NoisyRelease:
    """The release of :class:`~dpledger.adapters.torch.optimizer.DPOptimizer` (a base class
    of it): the override points :meth:`release` and :meth:`add_noise`, and the step's end."""

    # ------------------------------------------------------------------ override points
    def release(
        self, sums: list[torch.Tensor], *, num_records: int, event: SamplingEvent
    ) -> list[torch.Tensor]:
        """The whole noisy release of one step: clipped sums in, averaged noisy gradients out
        (an override point).

        The default, on rank 0: each group's sums are validated and sensitivity-checked against
        |R|·S_g (one read-back of their norms), then ``event`` is recorded, then every group's
        noise is drawn by :meth:`add_noise` and one sum-query event (S_g, σ̃_g, label) per group
        is recorded, then each noisy sum is divided by the event's fixed denominator
        (:attr:`~dpledger.adapters.torch.optimizer.DPOptimizer.denominator`). Under
        ``torch.distributed`` the other ranks receive rank 0's averages (a broadcast).

        Contract: the ledger holds, once this returns, the sampling event and one sum-query
        event per group whose S_g and σ̃_g are the bound every record's contribution was held
        to and the standard deviation the noise was drawn with; a step refused here (a failed
        sensitivity check, a non-finite sum) raises *before* ``event`` is recorded and leaves
        the ledger unchanged. An override that records anything else makes the ledger's ε wrong.

        Args:
            sums: the step's clipped sums, one per trainable parameter (in the order of the
                model's named parameters), summed over the ranks under ``torch.distributed``.
            num_records: |R|, the records (users with user-level sampling) in the sums.
            event: the sampling event of the draw the step claimed.

        Returns:
            The averaged noisy gradients, one per parameter in the order of ``sums``; the
            optimizer writes them to ``p.grad`` (in the parameter's dtype).
        """
        if self._rank == 0:
            averaged = self._release_on_rank_zero(sums, num_records, event)
        else:
            averaged = [torch.empty_like(s) for s in sums]
        if self._distributed:
            averaged = broadcast_tensors(averaged, process_group=self._group)
        return averaged

    def add_noise(
        self, sums: list[torch.Tensor], *, stddevs: list[float], generator: torch.Generator
    ) -> list[torch.Tensor]:
        """sums_j + N(0, σ̃_j² I) for every array of the step's groups (an override point).

        Called by :meth:`release` through the sum queries, after the sampling event was
        recorded and just before the sum-query events are: ``stddevs`` are the σ̃_g the ledger
        records for those events, whatever this method draws. The default draws the standard
        normals of all arrays in one float64 call on the parameters' device from ``generator``
        (the optimizer's seedable noise generator).

        Contract: return new tensors (``sums`` must not be modified), each ``sums[j]`` plus
        Gaussian noise of standard deviation exactly ``stddevs[j]`` per coordinate, drawn from
        ``generator``. An override that draws less noise than ``stddevs`` says releases more
        than the ledger records: exactly the kind of bug a privacy audit must catch
        (:class:`~dpledger.audit.torch_audit.UndernoisedDPOptimizer` plants one this way).

        Args:
            sums: the arrays to noise: the clipped sums, one flat array per group under
                separate clipping, one per parameter in joint scaled groups.
            stddevs: σ̃ of each array's group, as recorded.
            generator: the noise generator.

        Returns:
            The noisy arrays, in the order of ``sums``.
        """
        return add_noise_to_all(self._noise_source, sums, stddevs=stddevs, generator=generator)

    # ------------------------------------------------------------------ the step's release
    def _claim_draw(self) -> tuple[str | None, SamplingEvent]:
        """Tie this step to the sampler's draw (see :mod:`~dpledger.adapters.torch.sampler_base`),
        before anything is released or recorded; the step is dropped when refused.

        In one process a mismatch raises :class:`~dpledger.errors.SamplerMismatchError` here.
        Under torch.distributed it is returned instead (the message, or None): every rank must
        learn of any rank's refusal through the step's count collective and raise together,
        or the others would wait in the step's collectives for ever. The event to record is
        returned with it.
        """
        if self._stream is not None:  # a correlated-noise stream: the draw of its next step
            (query,) = self._queries.queries
            try:
                self._stream.check_open()
                self._stream.check_values(
                    l2_norm_bound=query.l2_norm_bound, noise_stddev=query.noise_stddev
                )
                self._sampler.claim_step(self._acc_count, step=self._stream.step)
            except (NoiseStreamEndError, InvalidParameterError, SamplerMismatchError):
                self._reset()
                raise
            return None, self._event
        if self._sampler is None:
            return None, self._event
        if self._claimed_event is not None:
            return None, self._claimed_event
        try:
            event = self._sampler.claim_draw(self._acc_count)
        except SamplerMismatchError as exc:
            if not self._distributed:
                self._reset()
                raise
            return str(exc), self._event
        return None, event

    def _release_and_update(self) -> None:
        """Release the step's accumulated sums, write ``p.grad`` and step the wrapped optimizer."""
        assert self._acc is not None
        problem, event = self._claim_draw()
        names = self._names
        sums = [self._acc[n] for n in names]
        count = self._acc_count
        unclipped = None
        if self._acc_unclipped is not None:
            unclipped = [self._acc_unclipped[n] for n in names]
        clipped = self._acc_clipped
        if self._acc_bad is not None:
            self._poison_sums(sums, self._acc_bad)
        if self._distributed:
            sums, unclipped, count, clipped = self._reduce_over_ranks(
                sums, unclipped, count, clipped, problem
            )
        averaged = self.release(sums, num_records=count, event=event)
        for n, avg in zip(names, averaged, strict=True):
            p = self._params[n]
            p.grad = local_gradient(p, avg)  # this rank's shard under FSDP2
        self._opt.step()
        if self._bias_callback is not None and self._rank == 0 and count > 0:
            self._report_bias(sums, unclipped, count, clipped)
        self._reset()
        self._steps_taken += 1

    @staticmethod
    def _poison_sums(sums: list[torch.Tensor], bad: torch.Tensor) -> None:
        """Make the sums NaN when a record's norm was not finite.

        A record whose norm is not finite makes the clipped sum NaN (on the device, no
        synchronisation), which the sensitivity check refuses before anything is recorded;
        adding 0 leaves every other sum as it is.
        """
        first = next((s for s in sums if s.numel() > 0), None)
        if first is not None:
            poison = torch.where(bad > 0, math.nan, 0.0)
            first.view(-1)[:1].add_(poison.to(first.dtype))

    def _reduce_over_ranks(
        self,
        sums: list[torch.Tensor],
        unclipped: list[torch.Tensor] | None,
        count: int,
        clipped: int,
        problem: str | None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, int, int]:
        """The counts and the sums (with the unclipped sums of the bias metrics) over the ranks.

        Counts first, on every rank: a rank whose records were not its sampler's draw stops
        every rank before the gradients are reduced or anything is recorded.
        """
        count, clipped, refused = sum_counts(
            [count, clipped, 0 if problem is None else 1],
            device=self._device,
            process_group=self._group,
        )
        if refused:
            self._reset()
            raise SamplerMismatchError(
                problem
                or f"{refused} other rank(s) stepped on records their sampler did not draw; "
                "no rank released or recorded anything for this step"
            )
        reduced = reduce_tensors(sums + (unclipped or []), process_group=self._group)
        sums = reduced[: len(self._names)]
        if unclipped is not None:
            unclipped = reduced[len(self._names) :]
        return sums, unclipped, count, clipped

    def _release_on_rank_zero(
        self, sums: list[torch.Tensor], count: int, event: SamplingEvent
    ) -> list[torch.Tensor]:
        """:meth:`release` on the rank that holds the ledger."""
        assert self._ledger is not None
        queries = self._queries
        by_name = dict(zip(self._names, sums, strict=True))
        grouped_sums = self._grouped_sums(queries, by_name)
        if self._stream is not None:
            return self._release_correlated(queries, by_name, grouped_sums, count)
        # Validation and the sensitivity check of every group (one read-back of the sums'
        # norms) come before the sampling event: a refused step records nothing.
        try:
            prepared = queries.grouped.prepare(
                grouped_sums, num_records=count, backend=self._backend
            )
        except InvalidParameterError:
            self._refuse_non_finite_records()
            raise
        step = self._open_ledger_step(event)
        try:
            noised = step.commit(prepared)
            averaged_groups = step.average([t for group in noised for t in group])
        finally:
            step.end()
        return self._ungroup(queries, by_name, grouped_sums, averaged_groups)

    def _release_correlated(
        self,
        queries: GradientQueries,
        by_name: dict[str, torch.Tensor],
        grouped_sums: list[list[torch.Tensor]],
        count: int,
    ) -> list[torch.Tensor]:
        """The release of one step of a correlated-noise stream (one group, one vector).

        The sensitivity check of the clipped sum (against |R|·S, as for independent noise)
        comes first; the stream's release is recorded on its first step, after the check and
        before any noise is added; then w_t (float64) is added to the sum in float64 and the
        result, in the sum's dtype, divided by the fixed denominator.
        """
        assert self._stream is not None and self._ledger is not None
        try:
            queries.grouped.prepare(grouped_sums, num_records=count, backend=self._backend)
        except InvalidParameterError:
            self._refuse_non_finite_records()
            raise
        (query,) = queries.queries
        ((flat,),) = grouped_sums
        self._stream.record(
            self._ledger,
            l2_norm_bound=query.l2_norm_bound,
            noise_stddev=query.noise_stddev,
            dim=flat.numel(),
            label=query.label,
        )
        t = flat.detach()
        step = self._stream.step
        noisy = self._stream.next_noise(t).add_(t)
        self._sampler.step_released(step)
        noisy = noisy if t.dtype == torch.float64 else noisy.to(t.dtype)
        averaged = noisy * (1.0 / self._denominator)
        return self._ungroup(queries, by_name, grouped_sums, [averaged])

    @staticmethod
    def _grouped_sums(
        queries: GradientQueries, by_name: dict[str, torch.Tensor]
    ) -> list[list[torch.Tensor]]:
        """Each group's arrays to release.

        A group under separate clipping is one concatenated vector (McMahan & Andrew, section
        2): its members' sums are released as one flat array — the same norm, the same i.i.d.
        noise per coordinate — in a few large operations instead of several small ones per
        parameter. Joint scaled groups keep one array per scale.
        """
        grouped_sums = []
        for query, members in zip(queries.queries, queries.members, strict=True):
            parts = [by_name[n] for n in members]
            if len(parts) > 1 and not isinstance(query, ScaledGaussianSumQuery):
                parts = [torch.cat([t.reshape(-1) for t in parts])]
            grouped_sums.append(parts)
        return grouped_sums

    def _open_ledger_step(self, event: SamplingEvent) -> SampledStep:
        """Record the step's sampling event and open the step its queries are recorded in."""
        if event.is_classic:  # Poisson or full batch: the ledger's fast path
            return open_step(
                self._ledger,
                sampling_probability=self._q,
                population_size=self._n,
                generator=self._generator,
                backend=self._backend,
            )
        return open_step(
            self._ledger, event=event, generator=self._generator, backend=self._backend
        )

    def _ungroup(
        self,
        queries: GradientQueries,
        by_name: dict[str, torch.Tensor],
        grouped_sums: list[list[torch.Tensor]],
        averaged_groups: list[torch.Tensor],
    ) -> list[torch.Tensor]:
        """The released group arrays split back into one tensor per parameter."""
        by_name_avg: dict[str, torch.Tensor] = {}
        released = iter(averaged_groups)
        for members, parts in zip(queries.members, grouped_sums, strict=True):
            if len(parts) == len(members):
                for n in members:
                    by_name_avg[n] = next(released)
            else:
                flat = next(released)
                pieces = flat.split([by_name[n].numel() for n in members])
                for n, piece in zip(members, pieces, strict=True):
                    by_name_avg[n] = piece.view(by_name[n].shape)
        return [by_name_avg[n] for n in self._names]

    def _refuse_non_finite_records(self) -> None:
        """After a refused release: name records whose norm was not finite, if there were any
        (the cause of a NaN sum); the step is dropped."""
        bad = 0 if self._acc_bad is None else int(self._acc_bad)
        if bad > 0:
            self._reset()
            raise InvalidParameterError(
                "per-example gradients",
                f"{bad} record(s) with a NaN, infinite or negative squared norm",
                "finite per-example gradients (a record with a NaN or infinite norm is never "
                "clipped or summed): nothing was released or recorded for this step",
            )

    def _report_bias(
        self,
        sums: list[torch.Tensor],
        unclipped: list[torch.Tensor] | None,
        count: int,
        clipped: int,
    ) -> None:
        from dpledger.diagnostics.bias import clipping_bias_from_sums

        assert unclipped is not None and self._bias_callback is not None
        norms = None
        if not self._distributed and self._acc_norms:
            norms = np.concatenate(self._acc_norms)  # other ranks' norms stay on their ranks
        metrics = clipping_bias_from_sums(
            unclipped_sum=[self._backend.to_host(t).ravel() for t in unclipped],
            clipped_sum=[self._backend.to_host(t).ravel() for t in sums],
            num_examples=count,
            per_example_norms=norms,
            num_clipped=clipped,
            denominator=self._denominator,
        )
        self._bias_callback(self._steps_taken, metrics)
