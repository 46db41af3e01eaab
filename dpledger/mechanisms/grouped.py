"""Several Gaussian sum queries on one sample (McMahan & Andrew, section 3).

One sample can feed G queries — per-layer gradient groups, a metric, a count — each with its own
clipping strategy and privacy tuple (S_g, σ̃_g). :class:`GroupedSumQuery` runs them together on
the same sample and records one sum-query event per group, so the ledger's step carries the G
tuples and accountants see the step as one Gaussian query with z_eff of paper Eq. 1.

A grouped call is all or nothing: every group's inputs are validated and sensitivity-checked
before any noise is drawn or any event recorded. The two stages are also available separately:
:meth:`GroupedSumQuery.prepare` validates and checks (nothing is drawn or recorded, so a caller
can run it before recording the step's sampling event), and :meth:`PreparedRelease.commit` (or
:meth:`~dpledger.mechanisms.SampledStep.commit`) draws the noise and records the events. The norms
of every group's sums are computed in one backend call and the noise of every array in one draw
(see the batched operations of :mod:`~dpledger.mechanisms.backend`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dpledger.errors import InvalidParameterError, LedgerStateError
from dpledger.ledger import PrivacyLedger
from dpledger.mechanisms.allocation import effective_noise_multiplier
from dpledger.mechanisms.backend import (
    Array,
    ArrayBackend,
    add_noise_to_all,
    array_norms,
    resolve_backend,
)
from dpledger.mechanisms.sum_query import (
    GaussianSumQuery,
    as_members,
    check_ledger,
    record_releases,
)

__all__ = ["GroupedSumQuery", "PreparedRelease"]


class GroupedSumQuery:
    """The G Gaussian sum queries computed on one sample.

    Example:
        >>> group = GroupedSumQuery([
        ...     GaussianSumQuery(l2_norm_bound=0.9, noise_stddev=1.0, label="kernel"),
        ...     GaussianSumQuery(l2_norm_bound=0.3, noise_stddev=0.5, label="bias"),
        ... ])
        >>> round(group.effective_noise_multiplier, 6)  # (0.9² + 0.6²)^(-1/2)
        0.9245

    Args:
        queries: the queries, one per group (:class:`GaussianSumQuery` or
            :class:`ScaledGaussianSumQuery`); labels that are not None must be distinct.

    Raises:
        InvalidParameterError: an empty list, an element that is not a query, or a repeated label.
    """

    def __init__(self, queries: Sequence[GaussianSumQuery]) -> None:
        if isinstance(queries, (str, bytes)) or not isinstance(queries, Sequence):
            raise InvalidParameterError("queries", queries, "a sequence of GaussianSumQuery")
        if len(queries) == 0:
            raise InvalidParameterError("queries", queries, "at least one query (group)")
        seen: set[str] = set()
        for g, q in enumerate(queries):
            if not isinstance(q, GaussianSumQuery):
                raise InvalidParameterError(f"queries[{g}]", q, "a GaussianSumQuery")
            if q.label is not None:
                if q.label in seen:
                    raise InvalidParameterError(
                        f"queries[{g}].label", q.label, "a label no other group uses"
                    )
                seen.add(q.label)
        self._queries = tuple(queries)

    @property
    def queries(self) -> tuple[GaussianSumQuery, ...]:
        """The queries, in the order their events are recorded."""
        return self._queries

    @property
    def labels(self) -> tuple[str | None, ...]:
        """The queries' labels."""
        return tuple(q.label for q in self._queries)

    @property
    def effective_noise_multiplier(self) -> float:
        """z_eff = (Σ_g (S_g/σ̃_g)²)^(-1/2) of a step running these queries (paper Eq. 1)."""
        return effective_noise_multiplier(
            l2_norm_bounds=[q.l2_norm_bound for q in self._queries],
            noise_stddevs=[q.noise_stddev for q in self._queries],
        )

    def __len__(self) -> int:
        return len(self._queries)

    def _check_count(self, name: str, values: Any) -> list[Any]:
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise InvalidParameterError(name, values, "a sequence with one entry per group")
        if len(values) != len(self._queries):
            raise InvalidParameterError(
                name, f"{len(values)} entries", f"one per group ({len(self._queries)})"
            )
        return list(values)

    def run(
        self,
        records: Sequence[Array | Sequence[Array]],
        *,
        ledger: PrivacyLedger,
        generator: Any,
        backend: ArrayBackend | None = None,
    ) -> list[list[Array]]:
        """Run every group's query on its records arrays; one event per group.

        Args:
            records: for each group, its records arrays (all with the same leading dimension
                |R|, the sample size, across groups too).
            ledger: the ledger, with the sample's step open.
            generator: the backend's random generator (noise is drawn group by group, in order).
            backend: the array backend (default NumPy).

        Returns:
            For each group, its noised sums.
        """
        be = resolve_backend(backend)
        per_group = self._check_count("records", records)
        prepared = [q._prepare_run(r, be) for q, r in zip(self._queries, per_group, strict=True)]
        counts = [p.num_records for p in prepared]
        if len(set(counts)) != 1:
            raise InvalidParameterError(
                "records",
                f"groups with {counts} records",
                "the same sample, so the same number of records, in every group",
            )
        return self._commit(prepared, ledger, generator)

    def release(
        self,
        clipped_sums: Sequence[Array | Sequence[Array]],
        *,
        num_records: int,
        ledger: PrivacyLedger,
        generator: Any,
        backend: ArrayBackend | None = None,
    ) -> list[list[Array]]:
        """Stage (c) for every group: noise the clipped sums and record one event per group."""
        prepared = self.prepare(clipped_sums, num_records=num_records, backend=backend)
        return prepared.commit(ledger=ledger, generator=generator)

    def prepare(
        self,
        clipped_sums: Sequence[Array | Sequence[Array]],
        *,
        num_records: int,
        backend: ArrayBackend | None = None,
    ) -> PreparedRelease:
        """Validate every group's clipped sums and run the sensitivity checks; nothing is drawn
        or recorded (see :meth:`PreparedRelease.commit`).

        The norms of all groups' sums are computed in one backend call (one read-back from a
        device). The arrays must not be modified before the release is committed.

        Raises:
            SensitivityCheckError: a group's clipped sum is longer than |R|·S_g allows.
            InvalidParameterError: bad arguments, or a clipped sum that is not finite.
        """
        be = resolve_backend(backend)
        per_group = [
            as_members(s, parameter=f"clipped_sums[{g}]")
            for g, s in enumerate(self._check_count("clipped_sums", clipped_sums))
        ]
        norms = array_norms(be, [a for group in per_group for a in group])
        prepared = []
        start = 0
        for q, sums in zip(self._queries, per_group, strict=True):
            stop = start + len(sums)
            prepared.append(q._prepare(sums, num_records, be, norms[start:stop]))
            start = stop
        return PreparedRelease(prepared)

    def _commit(self, prepared: list[Any], ledger: PrivacyLedger, generator: Any) -> list:
        return PreparedRelease(prepared).commit(ledger=ledger, generator=generator)

    def __repr__(self) -> str:
        return f"GroupedSumQuery({list(self._queries)!r})"


class PreparedRelease:
    """The validated, sensitivity-checked release of a :class:`GroupedSumQuery`, waiting for
    its noise and its events (from :meth:`GroupedSumQuery.prepare`). Committed at most once."""

    def __init__(self, prepared: list[Any]) -> None:
        self._prepared = prepared
        self._committed = False

    @property
    def num_records(self) -> int:
        """|R|, the sample size the sums were checked against."""
        return self._prepared[0].num_records

    def commit(self, *, ledger: PrivacyLedger, generator: Any) -> list[list[Array]]:
        """Draw the noise of every group (one draw for all arrays where the backend batches),
        append one sum-query event per group to ``ledger``, write the step's events to the
        ledger's file (write-ahead) and return the noised sums, per group.

        Raises:
            LedgerStateError: no step is open in the ledger, or the release was committed.
        """
        if self._committed:
            raise LedgerStateError(
                "this release was committed already: a second commit would draw new noise for "
                "sums that were released"
            )
        check_ledger(ledger)
        prepared = self._prepared
        be = prepared[0].backend
        arrays = [a for p in prepared for a in p.sums]
        stddevs = [sd for p in prepared for sd in p.stddevs]
        flat = add_noise_to_all(be, arrays, stddevs=stddevs, generator=generator)
        self._committed = True
        record_releases(prepared, ledger)  # every group's event, written before the sums return
        out = []
        start = 0
        for p in prepared:
            out.append(flat[start : start + len(p.sums)])
            start += len(p.sums)
        return out
