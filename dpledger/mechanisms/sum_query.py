"""Gaussian sum queries over a group of arrays: separate clipping and joint scaled clipping.

McMahan & Andrew, section 2. Each record i contributes a group of arrays v_i = (v_i1, …, v_ik)
(for example the per-example gradients of a layer's kernel and bias). A Gaussian sum query

1. computes each record's group norm,
2. turns the norms into per-record clip factors f_i (a :class:`ClippingStrategy`),
3. sums f_i·v_ij over the sample R for every array j, and
4. adds Gaussian noise and records one sum-query event (S_g, σ̃_g, label) in the ledger.

:class:`GaussianSumQuery` (separate clipping) treats the group as one concatenated vector:
‖v_i‖ = (Σ_j ‖v_ij‖²)^(1/2), clipped to S_g, with N(0, σ̃_g² I) added to every array's sum.

:class:`ScaledGaussianSumQuery` (joint scaled clipping) takes scales α_1..α_k, clips the scaled
record s(v_i) = (v_i1/α_1, …, v_ik/α_k), whose norm is (Σ_j ‖v_ij‖²/α_j²)^(1/2), to S_g, sums,
adds N(0, σ̃_g² I) and rescales block j by α_j. Block j of the output is therefore
Σ_i f_i·v_ij + N(0, (α_j σ̃_g)² I): a post-processing of one Gaussian sum query with privacy
tuple (S_g, σ̃_g). With every α_j = 1 it is exactly :class:`GaussianSumQuery`.

The stages are exposed separately for callers that never materialise per-record arrays (the
"ghost norm" fast path of the framework adapters): :meth:`~GaussianSumQuery.group_norms` from
per-record (squared) norms of each array, :meth:`~GaussianSumQuery.clip_factors`, and
:meth:`~GaussianSumQuery.release` of sums the caller computed itself. :meth:`~GaussianSumQuery.run`
does all stages on materialised records arrays and gives bit-identical results.

Order of operations in a release (so a rejected call leaves the ledger unchanged and nothing is
released without its event): validate everything, run the sensitivity check (‖clipped sum‖ ≤
|R|·S_g, with an allowance for rounding), draw the noise, append the sum-query event, write it
to the ledger's file (write-ahead: before any parameter can change) and only then return the
noised sums. The checks are in :mod:`dpledger.mechanisms.sum_query_checks`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from dpledger.errors import InvalidParameterError
from dpledger.ledger import PrivacyLedger
from dpledger.mechanisms.backend import (
    Array,
    ArrayBackend,
    add_noise_to_all,
    array_norms,
    resolve_backend,
)
from dpledger.mechanisms.clipping import (
    ClippingStrategy,
    FlatClipping,
    check_clip_margin,
    check_record_norms,
)
from dpledger.mechanisms.sum_query_checks import (
    SensitivityCheckError,
    _bound,
    _clipping,
    _flag,
    _label,
    _num_records,
    _scales,
    _stddev,
    as_members,
    check_ledger,
    check_sensitivity,
    num_records_of,
)
from dpledger.validation import check_non_negative_finite

__all__ = [
    "GaussianSumQuery",
    "ScaledGaussianSumQuery",
    "SensitivityCheckError",
    "clip_records",
]

logger = logging.getLogger(__name__)


def _combine(member_norms: list[np.ndarray], scales: np.ndarray | None) -> np.ndarray:
    """(Σ_j (n_j/α_j)²)^(1/2) per record, without overflow: m·‖n/(α m)‖ with m the largest term."""
    if len(member_norms) == 1 and scales is None:
        return member_norms[0].copy()
    terms = np.stack(member_norms)
    if scales is not None:
        terms = terms / scales[:, None]
    largest = terms.max(axis=0)
    out = np.zeros_like(largest)
    pos = largest > 0.0
    if pos.any():
        with np.errstate(over="ignore", invalid="ignore"):
            ratios = terms[:, pos] / largest[pos]
            out[pos] = largest[pos] * np.sqrt(np.sum(ratios * ratios, axis=0))
    out[np.isnan(largest)] = math.nan
    return out


@attrs.frozen(slots=True)
class _Prepared:
    """A validated, sensitivity-checked release waiting for its noise and its event."""

    query: GaussianSumQuery
    sums: list[Array]
    num_records: int
    stddevs: list[float]
    backend: ArrayBackend


@attrs.frozen(kw_only=True)
class GaussianSumQuery:
    """A Gaussian sum query with separate clipping: the group is one concatenated vector.

    Privacy tuple (S_g, σ̃_g) = (``l2_norm_bound``, ``noise_stddev``); every call to
    :meth:`release` (or :meth:`run`) appends exactly one sum-query event with these values.

    Example:
        >>> ledger = PrivacyLedger()
        >>> ledger.record_sample(sampling_probability=0.1, population_size=1000)
        >>> query = GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=1.1, label="dense")
        >>> kernel_grads, bias_grads = np.ones((5, 3, 2)), np.ones((5, 2))
        >>> noised = query.run([kernel_grads, bias_grads], ledger=ledger,
        ...                    generator=np.random.default_rng(0))
        >>> [a.shape for a in noised]
        [(3, 2), (2,)]

    Attributes:
        l2_norm_bound: S_g > 0, the bound every record's contribution is clipped to.
        noise_stddev: σ̃_g ≥ 0, the noise standard deviation per coordinate of the *sum*
            (σ̃_g = 0 is allowed and recorded, and makes the step non-private).
        clipping: the clipping strategy, an instance or ``"flat"`` (default), ``"global"``,
            ``"automatic"``.
        label: the name recorded with the event (a layer, a metric, …).
        check_sensitivity: run the sensitivity sanity check in :meth:`release` (default True).
    """

    l2_norm_bound: float = attrs.field(converter=_bound)
    noise_stddev: float = attrs.field(converter=_stddev)
    clipping: ClippingStrategy = attrs.field(
        default=attrs.Factory(FlatClipping), converter=_clipping
    )
    label: str | None = attrs.field(default=None, validator=_label)
    check_sensitivity: bool = attrs.field(default=True, validator=_flag)

    def __attrs_post_init__(self) -> None:
        if self.noise_stddev == 0.0:
            logger.warning(
                "sum query %r has noise_stddev=0: its steps are not private (epsilon = inf)",
                self.label,
            )

    @classmethod
    def from_noise_multiplier(
        cls, *, l2_norm_bound: float, noise_multiplier: float, **kwargs: Any
    ) -> GaussianSumQuery:
        """The query with σ̃_g = z·S_g for a noise multiplier z ≥ 0 (other fields as keywords)."""
        bound = _bound(l2_norm_bound)
        z = check_non_negative_finite("noise_multiplier", noise_multiplier)
        return cls(l2_norm_bound=bound, noise_stddev=z * bound, **kwargs)

    @property
    def noise_multiplier(self) -> float:
        """z = σ̃_g / S_g."""
        return self.noise_stddev / self.l2_norm_bound

    def _scale_vector(self, num_members: int, parameter: str) -> np.ndarray | None:
        return None

    # ------------------------------------------------------------------ stage (a): norms
    def group_norms(
        self,
        *,
        norms: Sequence[Any] | None = None,
        squared_norms: Sequence[Any] | None = None,
        backend: ArrayBackend | None = None,
    ) -> np.ndarray:
        """Per-record group norms from per-record norms (or squared norms) of each array.

        Separate clipping: ‖v_i‖ = (Σ_j n_ij²)^(1/2); joint scaled clipping:
        ‖s(v_i)‖ = (Σ_j n_ij²/α_j²)^(1/2), where n_ij is the norm of record i's slice of array j.

        Args:
            norms: one vector of per-record L2 norms per array of the group (computed without
                overflow from them, so norms up to the float64 maximum are handled).
            squared_norms: alternatively one vector of per-record *squared* norms per array (as
                "ghost norm" computations produce them); these must be finite.
            backend: converts backend vectors (e.g. tensors on a GPU) to the host; NumPy arrays
                and sequences need none.

        Returns:
            A float64 NumPy vector with the group norm of each record.

        Raises:
            InvalidParameterError: neither or both inputs given, an empty group, vectors of
                different lengths, a count that does not match the scales, or a norm that is
                negative, NaN or infinite (naming the array and the record).
        """
        if (norms is None) == (squared_norms is None):
            raise InvalidParameterError(
                "norms", "both or neither", "exactly one of norms= and squared_norms="
            )
        squared = norms is None
        name = "squared_norms" if squared else "norms"
        members = as_members(squared_norms if squared else norms, parameter=name)
        be = None if backend is None else resolve_backend(backend)
        vectors = []
        for j, v in enumerate(members):
            host = v if be is None or isinstance(v, np.ndarray) else be.to_host(v)
            vectors.append(check_record_norms(f"{name}[{j}]", host))
        return self._group_norms(vectors, squared=squared, name=name)

    def _group_norms(self, vectors: list[np.ndarray], *, squared: bool, name: str) -> np.ndarray:
        lengths = {v.shape[0] for v in vectors}
        if len(lengths) != 1:
            raise InvalidParameterError(
                name,
                f"vectors of lengths {[v.shape[0] for v in vectors]}",
                "one entry per record in every vector (the same number of records)",
            )
        scales = self._scale_vector(len(vectors), name)
        if squared:
            with np.errstate(over="ignore"):  # an overflow gives inf, rejected below
                total = vectors[0] / scales[0] ** 2 if scales is not None else vectors[0].copy()
                for j in range(1, len(vectors)):
                    total += vectors[j] / scales[j] ** 2 if scales is not None else vectors[j]
                out = np.sqrt(total)
        else:
            out = _combine(vectors, scales)
        bad = ~np.isfinite(out)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InvalidParameterError(
                name,
                f"record {i} with group norm {float(out[i])!r}",
                "per-record norms whose group norm is finite (this one overflows float64)",
            )
        return out

    def record_norms(
        self, records: Array | Sequence[Array], *, backend: ArrayBackend | None = None
    ) -> np.ndarray:
        """Stage (a) on materialised records arrays: the group norm of every record.

        Raises:
            InvalidParameterError: an empty group, arrays with different numbers of records, or
                a record whose norm is NaN or infinite (naming ``records[j][i]``).
        """
        be = resolve_backend(backend)
        members = as_members(records)
        self._num_records_of(members, be)
        vectors = [
            check_record_norms(f"records[{j}]", be.record_norms(x)) for j, x in enumerate(members)
        ]
        return self._group_norms(vectors, squared=False, name="records")

    _num_records_of = staticmethod(num_records_of)

    # ------------------------------------------------------------------ stage (b): factors
    def clip_factors(self, norms: Any, *, margin: float = 0.0) -> np.ndarray:
        """Stage (b): per-record clip factors f_i from the group norms, for this strategy.

        Flat: min(1, S/‖v_i‖); global: 1{‖v_i‖ ≤ S}; automatic: S/(‖v_i‖ + γ). For joint
        scaled clipping the norms are those of the scaled records and the contribution of
        block j is α_j·f_i·v_ij/α_j = f_i·v_ij, so the same factor multiplies every array.

        A caller that applies the factors itself must, like :meth:`ArrayBackend.weighted_sum`,
        convert them to the array's dtype and treat a result below that dtype's smallest normal
        number as 0.

        Args:
            norms: the per-record group norms (stage (a)).
            margin: ρ in [0, 0.5): clip to S·(1 − ρ) while the query still records S, so that
                rounding in a low-precision computation of the norms or of Σ_i f_i·v_i cannot
                push a contribution above S (see
                :func:`~dpledger.mechanisms.clipping.rounding_clip_margin`).

        Raises:
            InvalidParameterError: a norm that is NaN, infinite or negative (never summed), or
                a margin outside [0, 0.5).
        """
        rho = check_clip_margin("margin", margin) or 0.0
        return self.clipping.factors(norms, l2_norm_bound=self.l2_norm_bound * (1.0 - rho))

    def clipped_sums(
        self,
        records: Array | Sequence[Array],
        factors: Any,
        *,
        backend: ArrayBackend | None = None,
    ) -> list[Array]:
        """Σ_i f_i·v_ij for every array j of the group (the book-keeping step)."""
        be = resolve_backend(backend)
        members = as_members(records)
        count = self._num_records_of(members, be)
        f = np.asarray(factors, dtype=np.float64)
        if f.shape != (count,):
            raise InvalidParameterError(
                "factors",
                f"a vector of shape {f.shape}",
                f"one factor per record, shape ({count},)",
            )
        return [be.weighted_sum(x, f) for x in members]

    def clip(
        self, records: Array | Sequence[Array], *, backend: ArrayBackend | None = None
    ) -> list[Array]:
        """The clipped records arrays (f_i·v_ij)_i, for callers that need them materialised."""
        be = resolve_backend(backend)
        members = as_members(records)
        factors = self.clip_factors(self.record_norms(members, backend=be))
        return [be.scale_records(x, factors) for x in members]

    # ------------------------------------------------------------------ stage (c): release
    def _prepare(
        self,
        clipped_sums: Any,
        num_records: Any,
        backend: ArrayBackend | None,
        norms: np.ndarray | None = None,
    ) -> _Prepared:
        """Validate and sensitivity-check a release; ``norms`` are the sums' norms when the
        caller (a grouped release) computed them with the backend for several queries at once."""
        be = resolve_backend(backend)
        sums = as_members(clipped_sums, parameter="clipped_sums")
        count = _num_records(num_records)
        scales = self._scale_vector(len(sums), "clipped_sums")
        if norms is None:
            norms = array_norms(be, sums)
        eps = 0.0
        size = 0
        for j, s in enumerate(sums):
            if not math.isfinite(norms[j]):
                raise InvalidParameterError(
                    f"clipped_sums[{j}]", f"an array of norm {norms[j]!r}", "a finite clipped sum"
                )
            eps = max(eps, be.float_info(s)[0])
            size += math.prod(be.shape(s))
        if self.check_sensitivity:
            total = float(_combine([norms[j : j + 1] for j in range(len(sums))], scales)[0])
            check_sensitivity(
                total, num_records=count, bound=self.l2_norm_bound, eps=eps, size=size
            )
        if scales is None:
            stddevs = [self.noise_stddev] * len(sums)
        else:
            stddevs = [float(a) * self.noise_stddev for a in scales]
        return _Prepared(self, sums, count, stddevs, be)

    def release(
        self,
        clipped_sums: Array | Sequence[Array],
        *,
        num_records: int,
        ledger: PrivacyLedger,
        generator: Any,
        backend: ArrayBackend | None = None,
    ) -> list[Array]:
        """Stage (c): add the Gaussian noise to clipped sums and record the sum-query event.

        Runs the sensitivity check (unless ``check_sensitivity`` is False), draws
        N(0, σ̃_g² I) for every array (N(0, (α_j σ̃_g)² I) for block j under joint clipping),
        appends one event (S_g, σ̃_g, label) to ``ledger``, flushes it and returns the noised sums.

        Args:
            clipped_sums: Σ_i f_i·v_ij for each array j of the group (one array, or a sequence).
            num_records: |R|, the number of records in the sample the sums are over.
            ledger: the ledger, with the sample's step open.
            generator: the backend's random generator (``numpy.random.Generator`` for NumPy).
            backend: the array backend (default NumPy).

        Returns:
            The noised sums, one per array, in the order given.

        Raises:
            SensitivityCheckError: the clipped sum is longer than |R|·S_g allows.
            InvalidParameterError: bad arguments, or a clipped sum that is not finite.
            LedgerStateError: no step is open in the ledger.
        """
        prepared = self._prepare(clipped_sums, num_records, backend)
        check_ledger(ledger)
        noised = _draw(prepared, generator)
        record_releases([prepared], ledger)
        return noised

    def run(
        self,
        records: Array | Sequence[Array],
        *,
        ledger: PrivacyLedger,
        generator: Any,
        backend: ArrayBackend | None = None,
    ) -> list[Array]:
        """Stages (a)–(c) on materialised records arrays: clip, sum, noise, record, write.

        Args:
            records: the group's records arrays (one array, or a sequence with the same
                leading dimension |R|).
            ledger: the ledger, with the sample's step open.
            generator: the backend's random generator.
            backend: the array backend (default NumPy).

        Returns:
            The noised sums Σ_i f_i·v_ij + noise, one per array.
        """
        prepared = self._prepare_run(records, backend)
        check_ledger(ledger)
        noised = _draw(prepared, generator)
        record_releases([prepared], ledger)
        return noised

    def _prepare_run(self, records: Any, backend: ArrayBackend | None) -> _Prepared:
        be = resolve_backend(backend)
        members = as_members(records)
        count = self._num_records_of(members, be)
        self._scale_vector(len(members), "records")
        factors = self.clip_factors(self.record_norms(members, backend=be))
        sums = [be.weighted_sum(x, factors) for x in members]
        return self._prepare(sums, count, be)


def _draw(prepared: _Prepared, generator: Any) -> list[Array]:
    return add_noise_to_all(
        prepared.backend, prepared.sums, stddevs=prepared.stddevs, generator=generator
    )


def record_releases(prepared: Sequence[_Prepared], ledger: PrivacyLedger) -> None:
    """One sum-query event per release, written in one write before the sums return (WAL)."""
    for p in prepared:
        q, sigma = p.query, p.query.noise_stddev
        s = getattr(p.backend, "recorded_bound", lambda _, s=q.l2_norm_bound: s)(p)  # S+γ√d
        ledger.record_sum_query(l2_norm_bound=s, noise_stddev=sigma, label=q.label)
        logger.debug("released sum query %r: S=%r, noise_stddev=%r", q.label, s, sigma)
    ledger.flush()


@attrs.frozen(kw_only=True)
class ScaledGaussianSumQuery(GaussianSumQuery):
    """A Gaussian sum query with joint scaled clipping (McMahan & Andrew, section 2).

    Record i's arrays are scaled by 1/α_j, the scaled record is clipped to S_g as a whole, the
    clipped records are summed, N(0, σ̃_g² I) is added and block j is rescaled by α_j. Block j
    of the result is Σ_i f_i·v_ij + N(0, (α_j σ̃_g)² I), where f_i is the factor of the scaled
    record; the privacy tuple recorded is (S_g, σ̃_g).

    Example (the paper's): ‖v_1‖ ≤ 1 and ‖v_2‖ ≤ 100 with one of them zero for every record,
    noise tolerances 0.01 and 1: ``ScaledGaussianSumQuery(l2_norm_bound=1, noise_stddev=0.01,
    scales=(1, 100))`` clips nothing and adds noise of standard deviation 0.01 and 1.

    Attributes:
        scales: α_1..α_k > 0, one per array of the group, in the order the arrays are given.
    """

    scales: tuple[float, ...] = attrs.field(converter=_scales)

    def _scale_vector(self, num_members: int, parameter: str) -> np.ndarray | None:
        if num_members != len(self.scales):
            raise InvalidParameterError(
                parameter,
                f"a group of {num_members} arrays",
                f"one array per scale: {len(self.scales)} arrays for scales={self.scales}",
            )
        return np.asarray(self.scales, dtype=np.float64)


def clip_records(
    records: Array | Sequence[Array],
    *,
    l2_norm_bound: float,
    clipping: ClippingStrategy | str = "flat",
    backend: ArrayBackend | None = None,
) -> list[Array]:
    """Clip each record of a group of arrays (one concatenated vector per record) to L2 norm S.

    The norm of record i is the norm of the concatenation of its slices of every array,
    ‖v_i‖ = (Σ_j ‖v_ij‖²)^(1/2); each array's slice is multiplied by the same factor f_i.

    Args:
        records: one records array, or a sequence of records arrays with the same leading
            dimension B.
        l2_norm_bound: S > 0.
        clipping: the strategy (an instance or its name).
        backend: the array backend (default NumPy).

    Returns:
        The clipped records arrays, in the order given.
    """
    members = _as_members(records)
    # Only the query's clipping stages are used; nothing is released, so the noise is moot.
    query = GaussianSumQuery(l2_norm_bound=l2_norm_bound, noise_stddev=1.0, clipping=clipping)
    return query.clip(members, backend=resolve_backend(backend))


def _as_members(records: Array | Sequence[Array]) -> list[Array]:
    if isinstance(records, (list, tuple)):
        return list(records)
    return [records]
