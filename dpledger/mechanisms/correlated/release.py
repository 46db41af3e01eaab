"""A correlated-noise release: the ledger event and the stream's noise, from one factorization.

:func:`release_event` computes what the ledger records about a matrix-mechanism release from the
factorization itself (C's hash, its sensitivity under the participation schema), so that the
ledger cannot drift from what was used (``docs/architecture.md``, "Soundness rules", rule 1).
:class:`CorrelatedNoiseRelease` records that event once, then hands out each step's noise.
"""

from __future__ import annotations

import secrets

import numpy as np
import numpy.typing as npt

from dpledger.errors import InvalidParameterError
from dpledger.ledger.correlated import CorrelatedReleaseEvent, check_new_release_seed
from dpledger.ledger.ledger import PrivacyLedger
from dpledger.ledger.provenance import NoiseProvenance, note_noise_provenance
from dpledger.mechanisms.clipping import rounding_clip_margin
from dpledger.mechanisms.correlated.noise import CorrelatedNoise, noise_for
from dpledger.mechanisms.correlated.rebuild import strategy_matrix
from dpledger.mechanisms.correlated.sensitivity import sensitivity
from dpledger.mechanisms.correlated.strategies import MatrixFactorization, matrix_hash
from dpledger.mechanisms.sum_query import SensitivityCheckError, clip_records
from dpledger.sampling.participation import ParticipationKind, ParticipationSchema
from dpledger.validation import check_positive_finite, check_probability

__all__ = ["CorrelatedNoiseRelease", "count_bands", "release_event"]


def count_bands(strategy: npt.ArrayLike) -> int:
    """The number of bands of a lower-triangular square C (1 + the largest t − j with
    C[t, j] ≠ 0); refuses a C that is not square and lower-triangular."""
    c = np.asarray(strategy, dtype=np.float64)
    if c.ndim != 2 or c.shape[0] != c.shape[1] or np.any(np.triu(c, 1) != 0.0):
        raise InvalidParameterError("strategy", f"shape {c.shape}", "a lower-triangular square C")
    rows, cols = np.nonzero(c)
    return int((rows - cols).max()) + 1 if rows.size else 1


def release_event(
    factorization: MatrixFactorization,
    schema: ParticipationSchema,
    *,
    l2_norm_bound: float,
    noise_stddev: float,
    sampling_probability: float | None = None,
    label: str | None = None,
) -> CorrelatedReleaseEvent:
    """The ledger event of a release of ``factorization`` under ``schema``.

    Args:
        factorization: the strategy (C) and decoder (B).
        schema: how records participate; its ``num_steps`` must be the factorization's T.
        l2_norm_bound: S, the clip bound of every record's contribution at every step.
        noise_stddev: σ, the standard deviation of every entry of Z.
        sampling_probability: q for Poisson sampling within cyclic bands (amplification,
            Choquette-Choo et al. 2023, "Amplified Banded Matrix Factorization"): needs a
            ``cyclic`` schema whose period is at least the number of bands of C. None: no
            sampling (every record takes part in every step of its pattern).
        label: what is released (informational).

    Raises:
        InvalidParameterError: T differs, the factorization's kind and parameters do not
            rebuild its C (:func:`~dpledger.mechanisms.correlated.rebuild.strategy_matrix`: the
            accountants check the recorded sensitivity on it), or amplification was asked for
            a strategy or schema it does not hold for.
    """
    if schema.num_steps != factorization.num_steps:
        raise InvalidParameterError(
            "schema", schema.num_steps, f"num_steps={factorization.num_steps} (the strategy's T)"
        )
    s = check_positive_finite("l2_norm_bound", l2_norm_bound)
    # the accountants rebuild C from the recorded kind and parameters to check the recorded
    # sensitivity (.verification): a factorization they do not rebuild is refused here, before
    # anything is recorded
    rebuilt = strategy_matrix(factorization.kind, factorization.params)
    if matrix_hash(rebuilt) != factorization.strategy_hash:
        raise InvalidParameterError(
            "factorization",
            factorization.kind,
            "a factorization whose parameters determine its C (built by tree_factorization, "
            "banded_toeplitz_factorization, blt_factorization or the optimisers)",
        )
    del rebuilt
    sens = sensitivity(factorization.strategy, schema)
    bands: int | None = None
    if sampling_probability is None:
        q, sampling = 1.0, "none"
    else:
        q, sampling = (
            check_probability("sampling_probability", sampling_probability),
            ("poisson_within_bands"),
        )
        if schema.kind is not ParticipationKind.CYCLIC:
            raise InvalidParameterError(
                "schema", schema.kind.value, "a cyclic schema for Poisson sampling within bands"
            )
        bands = count_bands(factorization.strategy)
        if bands > schema.min_separation:
            raise InvalidParameterError(
                "sampling_probability",
                q,
                f"None: C has {bands} bands, more than the period {schema.min_separation}",
            )
    return CorrelatedReleaseEvent(
        strategy=factorization.kind,
        strategy_params=factorization.params,
        strategy_hash=factorization.strategy_hash,
        num_steps=factorization.num_steps,
        participation=schema.kind.value,
        max_participations=schema.max_participations,
        min_separation=schema.min_separation,
        sampling=sampling,
        sampling_probability=q,
        bands=bands,
        l2_norm_bound=s,
        noise_stddev=noise_stddev,
        sensitivity=sens.value,
        sensitivity_exact=sens.exact,
        max_column_norm=sens.max_column_norm,
        label=label,
    )


class CorrelatedNoiseRelease:
    """Records a correlated-noise release in a ledger, then gives each step's noise.

    The event is recorded on construction, before any noise is handed out. Each step, either
    :meth:`release` the records (clipped, summed, checked and noised here), or add
    :meth:`next_noise` to the step's sum of contributions clipped to S; either records the
    step (``stream_step``) before its noise is handed out.

    The batches must follow ``schema`` (e.g. the draws of :class:`dpledger.sampling.CyclicScheme`,
    whose groups are assigned independently, as the analysis under add/remove needs). There is
    no resumption: a stream's noise is a function of its seed, so a second release in a ledger
    that already holds one must draw its seed afresh (``seed=None``); the adapters' checkpoints
    are the way to continue a stream.

    Args:
        ledger: where the release is recorded.
        factorization: the factorization A = B·C (as :func:`release_event`).
        schema: how often and how far apart a record may participate (as
            :func:`release_event`).
        l2_norm_bound: S, the clip bound of each record's contribution (as
            :func:`release_event`).
        noise_stddev: σ, the standard deviation of the Gaussian entries of Z (as
            :func:`release_event`).
        sampling_probability: q for Poisson sampling within bands, or None (as
            :func:`release_event`).
        label: the release's label in the ledger (as :func:`release_event`).
        dim: d, the number of coordinates of a step's sum.
        seed: the noise generator's seed; None (the default) draws one from the operating
            system's entropy. A given seed is refused when the ledger already holds a release
            (:class:`~dpledger.ledger.correlated.NoiseSeedReuseError`).
    """

    def __init__(
        self,
        ledger: PrivacyLedger,
        factorization: MatrixFactorization,
        schema: ParticipationSchema,
        *,
        l2_norm_bound: float,
        noise_stddev: float,
        dim: int,
        seed: int | None = None,
        sampling_probability: float | None = None,
        label: str | None = None,
    ) -> None:
        self.event = release_event(
            factorization,
            schema,
            l2_norm_bound=l2_norm_bound,
            noise_stddev=noise_stddev,
            sampling_probability=sampling_probability,
            label=label,
        )
        self.noise: CorrelatedNoise = noise_for(
            factorization,
            dim=dim,
            noise_stddev=self.event.noise_stddev,
            seed=secrets.randbits(63) if seed is None else seed,
        )
        if not isinstance(ledger, PrivacyLedger):
            raise InvalidParameterError("ledger", ledger, "a PrivacyLedger")
        self.index = len(ledger.correlated_releases)
        check_new_release_seed(self.index, fresh_seed=seed is None)
        self._ledger = ledger
        note_noise_provenance(
            ledger,
            NoiseProvenance(
                entry_point="numpy.CorrelatedNoiseRelease",
                generator="numpy.random.Generator(PCG64)",
                seeding="os_entropy" if seed is None else "caller_seed",
                state_location="the process's memory (the stream's generator and buffers)",
            ),
        )
        ledger.record_correlated_release(self.event)

    def _record_step(self) -> None:
        if self.noise.step < self.noise.num_steps:  # the generator refuses step T + 1 itself
            self._ledger.record_stream_step(release=self.index, step=self.noise.step)

    def next_noise(self) -> npt.NDArray[np.float64]:
        """The noise of the next step (float64, shape (d,)), recorded as a stream step first."""
        self._record_step()
        return self.noise.next()

    def release(self, records: npt.ArrayLike) -> npt.NDArray[np.float64]:
        """One step: clip each record (row) to S, sum, check the sum, add the step's noise.

        The sum of n records clipped to S has L2 norm at most n·S (triangle inequality); a
        sum beyond it (with the float64 rounding margin of
        :func:`~dpledger.mechanisms.clipping.rounding_clip_margin`) is refused with
        :class:`~dpledger.mechanisms.sum_query.SensitivityCheckError` before the step's noise is
        drawn, so nothing is released for it.

        Args:
            records: shape (n, d), one contribution per record, in float64.

        Returns:
            The noisy sum, float64 of shape (d,).
        """
        x = np.asarray(records, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != self.noise.dim or not np.all(np.isfinite(x)):
            raise InvalidParameterError(
                "records",
                f"an array of shape {x.shape}",
                f"a finite (n, {self.noise.dim}) array",
            )
        s = self.event.l2_norm_bound
        margin = rounding_clip_margin(float(np.finfo(np.float64).eps))
        (clipped,) = clip_records(x, l2_norm_bound=s * (1.0 - margin))
        total = np.asarray(clipped, dtype=np.float64).sum(axis=0)
        norm = float(np.linalg.norm(total))
        limit = x.shape[0] * s
        if norm > limit:
            raise SensitivityCheckError(norm=norm, limit=limit, num_records=x.shape[0], bound=s)
        return np.asarray(total + self.next_noise(), dtype=np.float64)
