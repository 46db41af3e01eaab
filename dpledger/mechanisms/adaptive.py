"""Adaptive clipping: a clip norm that tracks a target quantile of the records' norms.

Andrew, Thakkar, McMahan & Ramaswamy, "Differentially private learning with adaptive clipping"
(NeurIPS 2021). Each step uses the current bound C_t for the main sum query and, on the same
sample, releases a noised count of the records it left unclipped,

    b̄_t = (Σ_{i∈R} (1{‖v_i‖ ≤ C_t} − ½) + N(0, σ_b²)) / m + ½,     m = q·n (expected |R|),

then moves the bound geometrically towards the target unclipped fraction γ:

    C_{t+1} = C_t · exp(−η (b̄_t − γ)).

The count is centred (each record contributes ±½, as in the paper and TensorFlow Privacy's
quantile estimator), so its L2 sensitivity under add/remove is ½ rather than 1: it is a Gaussian
sum query with privacy tuple (½, σ_b), recorded in the ledger like any other query of the step.
b̄_t is clamped to [0, 1] before the update (post-processing). With the main query noised at
σ̃ = z_Δ·C_t, where

    z_Δ = (z⁻² − (2σ_b)⁻²)^(-1/2)     (the paper's Theorem 1; needs σ_b > z/2),

the step's z_eff of paper Eq. 1 is exactly the requested z, so adaptive clipping costs no more
privacy than a fixed clip at noise multiplier z.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from dpledger.errors import InvalidParameterError
from dpledger.ledger import PrivacyLedger
from dpledger.mechanisms.backend import Array, ArrayBackend, resolve_backend
from dpledger.mechanisms.clipping import ClippingStrategy, check_record_norms
from dpledger.mechanisms.grouped import GroupedSumQuery
from dpledger.mechanisms.sum_query import GaussianSumQuery, as_members
from dpledger.validation import check_positive_finite, check_probability

__all__ = ["AdaptiveClipping", "adaptive_noise_multiplier"]

COUNT_SENSITIVITY = 0.5
"""L2 sensitivity of the centred count Σ (b_i − ½) under add/remove-one."""


def adaptive_noise_multiplier(*, noise_multiplier: float, count_noise_stddev: float) -> float:
    """z_Δ = (z⁻² − (2σ_b)⁻²)^(-1/2): the main query's noise multiplier for a step total z.

    Args:
        noise_multiplier: z > 0, the noise multiplier the whole step should have (Eq. 1).
        count_noise_stddev: σ_b, the count query's noise standard deviation; must exceed z/2.

    Raises:
        InvalidParameterError: z ≤ 0, or σ_b ≤ z/2 (the count alone would exceed the budget).
    """
    z = check_positive_finite("noise_multiplier", noise_multiplier)
    sigma_b = check_positive_finite("count_noise_stddev", count_noise_stddev)
    # z_Δ = z / √(1 − r²) with r = z / (σ_b / sensitivity): the same value as
    # (z⁻² − (σ_b/sensitivity)⁻²)^(-1/2), without overflowing z⁻² for tiny z
    ratio = z / (sigma_b / COUNT_SENSITIVITY)
    if not ratio < 1.0:
        raise InvalidParameterError(
            "count_noise_stddev",
            count_noise_stddev,
            f"a value > noise_multiplier/2 = {z / 2!r}, so the count query leaves budget for "
            "the main query",
        )
    z_main = z / math.sqrt((1.0 - ratio) * (1.0 + ratio))
    if not math.isfinite(z_main):
        raise InvalidParameterError(
            "noise_multiplier",
            noise_multiplier,
            f"a value whose main-query noise multiplier z/√(1 − (2z/σ_b)²) is finite "
            f"(count_noise_stddev={count_noise_stddev!r} leaves almost no budget)",
        )
    return z_main


class AdaptiveClipping:
    """A clip norm adapted each step towards a target unclipped quantile (Andrew et al. 2021).

    Use :attr:`query` (the main query at the current bound) for stages (a) and (b), then
    :meth:`release` (or :meth:`run` on materialised records), which releases the main query and
    the unclipped count in the same step and updates the bound.

    Args:
        initial_l2_norm_bound: C_0 > 0.
        target_unclipped_quantile: γ in [0, 1], the fraction of records to leave unclipped
            (0.5: the median norm).
        learning_rate: η > 0 of the geometric update (the paper uses 0.2).
        noise_multiplier: z > 0 of the whole step (main query and count, paper Eq. 1).
        count_noise_stddev: σ_b > z/2, noise on the count (the paper suggests about m/20).
        expected_batch_size: m = q·n > 0, the denominator of the unclipped fraction.
        clipping: the main query's strategy (default flat).
        label: label of the main query's events.
        count_label: label of the count query's events (must differ from ``label``).
        check_sensitivity: run the sensitivity check on both queries.
    """

    def __init__(
        self,
        *,
        initial_l2_norm_bound: float,
        target_unclipped_quantile: float,
        noise_multiplier: float,
        count_noise_stddev: float,
        expected_batch_size: float,
        learning_rate: float = 0.2,
        clipping: ClippingStrategy | str = "flat",
        label: str | None = None,
        count_label: str = "unclipped_count",
        check_sensitivity: bool = True,
    ) -> None:
        self._bound = check_positive_finite("initial_l2_norm_bound", initial_l2_norm_bound)
        self.target_unclipped_quantile = check_probability(
            "target_unclipped_quantile", target_unclipped_quantile
        )
        self.learning_rate = check_positive_finite("learning_rate", learning_rate)
        self.noise_multiplier = check_positive_finite("noise_multiplier", noise_multiplier)
        self.count_noise_stddev = check_positive_finite("count_noise_stddev", count_noise_stddev)
        self.main_noise_multiplier = adaptive_noise_multiplier(
            noise_multiplier=noise_multiplier, count_noise_stddev=count_noise_stddev
        )
        self.expected_batch_size = check_positive_finite("expected_batch_size", expected_batch_size)
        if not isinstance(count_label, str):
            raise InvalidParameterError("count_label", count_label, "a string")
        if label == count_label:
            raise InvalidParameterError("count_label", count_label, f"a label other than {label!r}")
        self._clipping = ClippingStrategy.parse(clipping)
        self._label = label
        self._check = check_sensitivity
        self._count_query = GaussianSumQuery(
            l2_norm_bound=COUNT_SENSITIVITY,
            noise_stddev=self.count_noise_stddev,
            label=count_label,
            check_sensitivity=check_sensitivity,
        )
        self._query = self._main_query()

    def _main_query(self) -> GaussianSumQuery:
        return GaussianSumQuery(
            l2_norm_bound=self._bound,
            noise_stddev=self.main_noise_multiplier * self._bound,
            clipping=self._clipping,
            label=self._label,
            check_sensitivity=self._check,
        )

    @property
    def l2_norm_bound(self) -> float:
        """C_t, the bound the next step clips to."""
        return self._bound

    @property
    def query(self) -> GaussianSumQuery:
        """The main sum query at the current bound: (C_t, z_Δ·C_t)."""
        return self._query

    @property
    def count_query(self) -> GaussianSumQuery:
        """The centred unclipped-count query: (½, σ_b)."""
        return self._count_query

    @property
    def effective_noise_multiplier(self) -> float:
        """z_eff of a step with the main and the count query (equals ``noise_multiplier``)."""
        return GroupedSumQuery([self._query, self._count_query]).effective_noise_multiplier

    def unclipped_count(self, norms: Any) -> int:
        """The number of records with norm ≤ C_t (those the current bound leaves unclipped)."""
        v = check_record_norms("norms", norms)
        return int(np.count_nonzero(v <= self._bound))

    def _count_sum(self, norms: Any) -> tuple[np.ndarray, int]:
        v = check_record_norms("norms", norms)
        unclipped = int(np.count_nonzero(v <= self._bound))
        return np.asarray(unclipped - COUNT_SENSITIVITY * v.size), v.size

    def _fraction(self, noised_centred_count: float) -> float:
        fraction = noised_centred_count / self.expected_batch_size + COUNT_SENSITIVITY
        return min(1.0, max(0.0, fraction))

    def release_count(
        self,
        norms: Any,
        *,
        ledger: PrivacyLedger,
        generator: Any,
        backend: ArrayBackend | None = None,
        like: Array | None = None,
    ) -> float:
        """Release the noised unclipped fraction b̄_t (one sum-query event); no update.

        Args:
            norms: the group norms of the step's records (stage (a) of :attr:`query`).
            ledger: the ledger, with the sample's step open.
            generator: the backend's random generator.
            backend: the array backend (default NumPy).
            like: an array whose dtype and device the count is computed in (default float64).

        Returns:
            b̄_t clamped to [0, 1].
        """
        be = resolve_backend(backend)
        total, count = self._count_sum(norms)
        noised = self._count_query.release(
            [be.from_host(total, like=like)],
            num_records=count,
            ledger=ledger,
            generator=generator,
            backend=be,
        )
        return self._fraction(float(be.to_host(noised[0])))

    def update(self, unclipped_fraction: float) -> float:
        """C_{t+1} = C_t·exp(−η(b̄_t − γ)); returns the new bound.

        Raises:
            InvalidParameterError: a fraction outside [0, 1].
        """
        b = check_probability("unclipped_fraction", unclipped_fraction)
        new = self._bound * math.exp(-self.learning_rate * (b - self.target_unclipped_quantile))
        if not (new > 0.0 and math.isfinite(new)):  # pragma: no cover - needs ~700 steps at η=1
            raise InvalidParameterError(
                "unclipped_fraction", unclipped_fraction, "a value keeping the bound finite > 0"
            )
        self._bound = new
        self._query = self._main_query()
        return new

    def release(
        self,
        clipped_sums: Array | Sequence[Array],
        *,
        norms: Any,
        ledger: PrivacyLedger,
        generator: Any,
        backend: ArrayBackend | None = None,
    ) -> list[Array]:
        """Release the main query's sums and the unclipped count together, then update C.

        Both events are recorded in the current step (main query first), or neither if an
        argument is rejected.

        Args:
            clipped_sums: Σ_i f_i·v_ij per array, with factors from :attr:`query`.
            norms: the records' group norms the factors were computed from (|R| = len(norms)).
            ledger: the ledger, with the sample's step open.
            generator: the backend's random generator.
            backend: the array backend (default NumPy).

        Returns:
            The main query's noised sums.
        """
        be = resolve_backend(backend)
        sums = as_members(clipped_sums, parameter="clipped_sums")
        total, count = self._count_sum(norms)
        both = GroupedSumQuery([self._query, self._count_query])
        noised, noised_count = both.release(
            [sums, [be.from_host(total, like=sums[0])]],
            num_records=count,
            ledger=ledger,
            generator=generator,
            backend=be,
        )
        self.update(self._fraction(float(be.to_host(noised_count[0]))))
        return noised

    def run(
        self,
        records: Array | Sequence[Array],
        *,
        ledger: PrivacyLedger,
        generator: Any,
        backend: ArrayBackend | None = None,
    ) -> list[Array]:
        """Clip materialised records to C_t, release the sums and the count, update C."""
        be = resolve_backend(backend)
        members = as_members(records)
        norms = self._query.record_norms(members, backend=be)
        factors = self._query.clip_factors(norms)
        sums = self._query.clipped_sums(members, factors, backend=be)
        return self.release(sums, norms=norms, ledger=ledger, generator=generator, backend=be)

    def __repr__(self) -> str:
        return (
            f"AdaptiveClipping(l2_norm_bound={self._bound!r}, "
            f"target_unclipped_quantile={self.target_unclipped_quantile!r}, "
            f"noise_multiplier={self.noise_multiplier!r})"
        )
