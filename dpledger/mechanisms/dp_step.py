"""The DP step, written once for every framework (docs/architecture.md, "Soundness rules").

One DP-SGD step on a sample R of n records (Abadi et al. 2016; McMahan & Andrew, sections 1–3),
over the groups and sum queries of a model's gradient
(:class:`~dpledger.mechanisms.gradient_queries.GradientQueries`):

1. **claim the draw** (:meth:`DPStep.claim`): the sampling event of the sampler's draw the batch
   is (Poisson (q, n), fixed-size, shuffled, balls-in-bins, …; a batch the sampler did not draw
   is refused by the sampler before anything is recorded);
2. **clip factors** (:meth:`DPStep.clip_factors`, :meth:`DPStep.factors_of_norms`): each
   record's group norms ‖v_i‖_g and factors f_ig in float64 by the group's query and clipping
   strategy, for the bound S_g·(1 − ρ_g) (the clip margin ρ_g absorbs the rounding of
   low-precision norms and sums; S_g is what is recorded). An adapter that forms the factors on
   its device takes the layout from :meth:`DPStep.factor_layout` (the same formula);
3. **sensitivity check** (:meth:`DPStep.noise`): every group's clipped sum must be within
   |R|·S_g, checked (with its validation) before anything is recorded, so a refused step leaves
   the ledger unchanged;
4. **record** the sampling event, then **noise**: N(0, σ̃_g² I) drawn through the array backend
   (one draw over all groups where the backend batches), and one sum-query event
   (S_g, σ̃_g, label) per group written to the ledger's file before the noisy sums are returned
   (write-ahead, :func:`~dpledger.mechanisms.sum_query.record_releases`);
5. **average** (:meth:`DPStep.average`) by the event's fixed denominator: q·n for Poisson and
   truncated Poisson, b for fixed-size and shuffled batches, n / k for balls-in-bins.

The arrays are the adapter's own (``torch.Tensor`` on the parameters' device, through its
:class:`~dpledger.mechanisms.backend.ArrayBackend`), or summaries of sums that stay on a device
(:class:`~dpledger.mechanisms.backend.SummaryBackend`: the Keras graph carries out the
:class:`~dpledger.mechanisms.backend.NoiseOrder` values this step returns). What an adapter
keeps is what needs its framework: the per-example norms and the clipped sums (its engine),
concatenating a group's arrays, the distributed reduction, writing the gradients.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dpledger.errors import InvalidParameterError
from dpledger.ledger import PrivacyLedger, SamplingEvent
from dpledger.mechanisms.averaging import fixed_denominator_average
from dpledger.mechanisms.backend import Array, ArrayBackend
from dpledger.mechanisms.clipping import check_clip_margin
from dpledger.mechanisms.gradient_queries import GradientQueries
from dpledger.mechanisms.step import StepEvents, open_step
from dpledger.mechanisms.sum_query import ScaledGaussianSumQuery
from dpledger.validation import check_non_negative_finite, check_positive_finite

__all__ = ["DPStep"]

_CACHED_QUERIES = 16
"""How many (bound, z) variants of the queries :meth:`DPStep.set_values` keeps built."""


class DPStep:
    """The sequence of one DP step over a model's gradient queries (see the module docstring).

    Thread-safe where a framework calls it from its own threads (TensorFlow's host callbacks):
    the queries and margins change together, under a lock.

    Args:
        queries: the groups and their sum queries.
        ledger: the ledger the steps are recorded in (None on a process that records nothing,
            such as a rank other than 0 under distributed training).
        events: the sampling event of every step, from the sampler (None when every claim
            names its sampler or event).
        margins: ρ in [0, 0.5), one for every group or one for all: the factors clip to
            S_g·(1 − ρ_g) while S_g is recorded.

    Raises:
        InvalidParameterError: a margin outside [0, 0.5), or one per group of another count.
    """

    def __init__(
        self,
        queries: GradientQueries,
        *,
        ledger: PrivacyLedger | None,
        events: StepEvents | None = None,
        margins: float | Sequence[float] = 0.0,
    ) -> None:
        self.ledger = ledger
        self.events = events
        self._lock = threading.Lock()
        self._next_position = 0
        self._cache: dict[tuple[float | None, float | None], GradientQueries] = {}
        self._queries = queries
        self._margins = self._check_margins(queries, margins)
        self._cache[(queries.l2_norm_bound, queries.noise_multiplier)] = queries

    # ------------------------------------------------------------------ the queries
    @property
    def queries(self) -> GradientQueries:
        """The groups and their sum queries (S_g, σ̃_g) of the next step."""
        return self._queries

    @property
    def margins(self) -> tuple[float, ...]:
        """ρ_g of every group."""
        return self._margins

    @staticmethod
    def _check_margins(
        queries: GradientQueries, margins: float | Sequence[float]
    ) -> tuple[float, ...]:
        count = len(queries.queries)
        if isinstance(margins, (int, float)):
            margins = (float(margins),) * count
        values = tuple(check_clip_margin("clip_margin", m) or 0.0 for m in margins)
        if len(values) != count:
            raise InvalidParameterError(
                "margins", f"{len(values)} margins", f"one margin or {count}, one per group"
            )
        return values

    def set_queries(
        self, queries: GradientQueries, *, margins: float | Sequence[float] | None = None
    ) -> None:
        """Use ``queries`` (over the same parameters, in as many groups) from the next step on.

        Raises:
            InvalidParameterError: queries over another number of parameters or groups, or a
                bad margin.
        """
        old = self._queries
        if len(queries.group_of) != len(old.group_of):
            raise InvalidParameterError(
                "queries",
                f"queries over {len(queries.group_of)} variables",
                f"queries over the {len(old.group_of)} trainable variables",
            )
        if len(queries.queries) != len(old.queries):
            raise InvalidParameterError(
                "queries", "a different number of groups", "the same groups as before"
            )
        checked = self._margins if margins is None else self._check_margins(queries, margins)
        with self._lock:
            self._queries, self._margins = queries, checked

    def set_values(self, *, l2_norm_bound: float, noise_multiplier: float) -> None:
        """The same groups with total bound C and noise multiplier z from the next step on
        (the ledger records each step's); the last few variants stay built.

        Raises:
            InvalidParameterError: C not finite and > 0, or z not finite and ≥ 0.
        """
        key = (
            check_positive_finite("l2_norm_bound", l2_norm_bound),
            check_non_negative_finite("noise_multiplier", noise_multiplier),
        )
        queries = self._cache.get(key)
        if queries is None:
            queries = self._queries.with_values(
                l2_norm_bound=l2_norm_bound, noise_multiplier=noise_multiplier
            )
            if len(self._cache) >= _CACHED_QUERIES:
                self._cache.pop(next(iter(self._cache)))
            self._cache[(queries.l2_norm_bound, queries.noise_multiplier)] = queries
        with self._lock:
            self._queries = queries

    # ------------------------------------------------------------------ 1. claim the draw
    def claim(
        self, num_records: int, *, sampler: Any = None, position: int | None = None
    ) -> SamplingEvent:
        """The sampling event of this step's draw.

        Args:
            num_records: the records the step's batch holds.
            sampler: a recorded sampler with ``claim_draw(num_records)`` (it refuses a batch it
                did not draw, raising :class:`~dpledger.errors.SamplerMismatchError`); None for
                the events of :attr:`events`.
            position: the step's 0-based position in its epoch (its event by
                :meth:`~dpledger.mechanisms.step.StepEvents.at`); None or negative counts the
                claimed steps.
        """
        if sampler is not None:
            event: SamplingEvent = sampler.claim_draw(num_records)
            return event
        if self.events is None:
            raise InvalidParameterError("sampler", None, "a sampler, or the step's events")
        with self._lock:
            at = self._next_position if position is None or position < 0 else int(position)
            self._next_position = at + 1
        return self.events.at(at)

    # ------------------------------------------------------------------ 2. clip factors
    def clip_factors(self, squared_norms: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Every group's factors f_ig (float64, shape (B,)) from each parameter's per-example
        squared norms (in the order of the queries' parameters).

        Raises:
            InvalidParameterError: a NaN, infinite or negative squared norm.
        """
        vectors = [np.asarray(s, dtype=np.float64) for s in squared_norms]
        with self._lock:
            queries, margins = self._queries, self._margins
        out = []
        for query, members, margin in zip(queries.queries, queries.positions, margins, strict=True):
            norms = query.group_norms(squared_norms=[vectors[j] for j in members])
            out.append(query.clip_factors(norms, margin=margin))
        return out

    def factors_of_norms(self, norms: np.ndarray) -> np.ndarray:
        """Every group's factors (G, B) from the records' group norms (G, B), by each group's
        own clipping strategy; a non-finite norm gets factor 0 (the step is refused at the
        sensitivity check)."""
        norms = np.where(np.isfinite(norms), norms, 0.0)
        queries, margins = self._queries, self._margins
        return np.stack(
            [
                query.clip_factors(norms[g], margin=margins[g])
                for g, query in enumerate(queries.queries)
            ]
        )

    def factor_layout(
        self, names: Sequence[str], queries: GradientQueries | None = None
    ) -> tuple[np.ndarray, np.ndarray, bool]:
        """What an adapter needs to form the factors on its device.

        Returns:
            ``(weights, bounds, mixed)``: the (G, P) float64 matrix that sums the per-parameter
            squared norms of ``names`` into each group's squared (scaled) norm (weights
            1/α_j² in joint scaled groups), the (G, 1) bounds S_g·(1 − ρ_g), and whether the
            groups' clipping strategies differ (then the factors are formed on the host by
            :meth:`factors_of_norms`).
        """
        queries = self._queries if queries is None else queries
        column = {n: i for i, n in enumerate(names)}
        weights = np.zeros((len(queries.queries), len(names)), dtype=np.float64)
        for g, (query, members) in enumerate(zip(queries.queries, queries.members, strict=True)):
            scales = query.scales if isinstance(query, ScaledGaussianSumQuery) else None
            for j, n in enumerate(members):
                weights[g, column[n]] = 1.0 if scales is None else 1.0 / scales[j] ** 2
        pairs = zip(queries.queries, self._margins, strict=True)
        bounds = np.array([[q.l2_norm_bound * (1.0 - m)] for q, m in pairs], dtype=np.float64)
        mixed = len({q.clipping for q in queries.queries}) > 1
        return weights, bounds, mixed

    # ------------------------------------------------------------------ 3.–4. check, record, noise
    def noise(
        self,
        grouped_sums: Sequence[Sequence[Array]],
        *,
        num_records: int,
        event: SamplingEvent,
        backend: ArrayBackend,
        generator: Any = None,
        bad_records: Callable[[], int] | None = None,
    ) -> list[list[Array]]:
        """Check every group's clipped sums, record the step, and noise them.

        The validation and sensitivity check of every group (one read-back of the sums'
        norms) come first; then ``event``, then the noise and one sum-query event per group,
        written to the ledger's file before the noisy sums are returned.

        Args:
            grouped_sums: each group's clipped sums (one array under separate clipping, one per
                parameter in a joint scaled group), in the order of the queries.
            num_records: |R|, the records (or users) in the sums.
            event: the claimed draw's sampling event.
            backend: the arrays' backend (its noise is the step's noise).
            generator: the backend's noise generator.
            bad_records: the number of records whose norm was not finite, read only when the
                check refuses the step (to name the cause).

        Returns:
            The noisy sums, per group.

        Raises:
            SensitivityCheckError: a group's clipped sum is longer than |R|·S_g allows.
            InvalidParameterError: a clipped sum that is not finite (naming the records whose
                norm was not finite, if any).
        """
        if self.ledger is None:
            raise InvalidParameterError("ledger", None, "the ledger the step is recorded in")
        with self._lock:
            queries = self._queries
        try:
            prepared = queries.grouped.prepare(
                grouped_sums, num_records=num_records, backend=backend
            )
        except InvalidParameterError:
            bad = 0 if bad_records is None else bad_records()
            if bad > 0:
                raise InvalidParameterError(
                    "per-example gradients",
                    f"{bad} record(s) with a NaN, infinite or negative squared norm",
                    "finite per-example gradients (a record with a NaN or infinite norm is "
                    "never clipped or summed): nothing was released or recorded for this step",
                ) from None
            raise
        if event.is_classic:  # Poisson or full batch: the ledger's fast path
            step = open_step(
                self.ledger,
                sampling_probability=event.sampling_probability,
                population_size=event.population_size,
                generator=generator,
                backend=backend,
            )
        else:
            step = open_step(self.ledger, event=event, generator=generator, backend=backend)
        try:
            return step.commit(prepared)
        finally:
            step.end()

    # ------------------------------------------------------------------ 5. average
    @staticmethod
    def average(arrays: Sequence[Array], *, event: SamplingEvent, backend: Any) -> list[Array]:
        """Every noisy sum divided by ``event``'s fixed denominator (q·n for Poisson)."""
        if event.is_classic:
            return fixed_denominator_average(
                arrays,
                sampling_probability=event.sampling_probability,
                population_size=event.population_size,
                backend=backend,
            )
        return fixed_denominator_average(
            arrays, denominator=event.average_denominator, backend=backend
        )

    def release(
        self,
        grouped_sums: Sequence[Sequence[Array]],
        *,
        num_records: int,
        event: SamplingEvent,
        backend: ArrayBackend,
        generator: Any = None,
        bad_records: Callable[[], int] | None = None,
    ) -> list[Array]:
        """:meth:`noise`, then :meth:`average`: the averaged noisy arrays, all groups' in
        order."""
        noised = self.noise(
            grouped_sums,
            num_records=num_records,
            event=event,
            backend=backend,
            generator=generator,
            bad_records=bad_records,
        )
        return self.average([a for group in noised for a in group], event=event, backend=backend)

    def __repr__(self) -> str:
        return f"DPStep({self._queries!r})"
