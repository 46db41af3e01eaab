"""Conversion of a ledger into the equivalent ``dp_accounting`` event.

Imported lazily: dp-accounting is a core dependency, but importing it takes about two seconds, so
``import dpledger`` does not pay for it until a conversion is asked for.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from dpledger.errors import InvalidParameterError, UnsupportedSamplingError
from dpledger.ledger.correlated import CorrelatedReleaseEvent
from dpledger.ledger.steps import CompressedLedger, StepRun

if TYPE_CHECKING:
    import dp_accounting

__all__ = [
    "compressed_to_dp_event",
    "compressed_to_dp_events",
    "correlated_to_dp_event",
    "run_to_dp_event",
]

_NEIGHBOURS = ("removed", "added")
"""The two neighbouring pairs of a truncated Poisson step: the data set holding the differing
record has the recorded n records (the record removed) or n + 1 (a record added)."""


def run_to_dp_event(run: StepRun, *, neighbour: str | None = None) -> dp_accounting.DpEvent:
    """One run of identical steps as a dp-accounting event.

    A step is one Gaussian sum query with noise multiplier z_eff on the step's sample (paper
    Eq. 1). Steps that release nothing (no query, or q = 0) are ``NoOpDpEvent``; a step with
    z_eff = 0 is ``NonPrivateDpEvent`` (ε = ∞). The sample becomes:

    * Poisson (of records or of users): ``PoissonSampledDpEvent(q, GaussianDpEvent(z_eff))``,
      a bare Gaussian when q = 1;
    * fixed size without replacement: ``SampledWithoutReplacementDpEvent(n, b,
      GaussianDpEvent(z_eff / 2))``. dp-accounting analyses it under replace-one only and takes
      the noise multiplier relative to the replace-one sensitivity, which is 2S for a sum
      clipped to S; hence z_eff / 2;
    * truncated Poisson: ``TruncatedSubsampledGaussianDpEvent(N, q, max_batch_size, z_eff)``
      for one neighbouring pair, named by ``neighbour``. dp-accounting's analysis takes the size
      N of the data set that *contains* the differing record: N = n for ``"removed"`` (the
      neighbour without one of the n recorded records), N = n + 1 for ``"added"``. The run's
      guarantee is the larger of the two, which no single DpEvent expresses, and neither is
      known to be the larger for every parameter (q = 0.2, n = 50, cap 10, z = 1, T = 50:
      N = n gives ε = 28.53 and N = n + 1 gives 28.97 at δ = 1e-5), so without ``neighbour``
      such a run is refused (:func:`compressed_to_dp_events` gives both);
    * balls-in-bins and shuffle: ``UnsupportedDpEvent`` — dp-accounting has no analysis of
      them, and an event of another kind would let its accountants certify a guarantee the run
      does not have.

    Args:
        run: the run.
        neighbour: ``"removed"`` or ``"added"``: which neighbouring pair a truncated Poisson run
            is analysed for (ignored for other schemes).

    Raises:
        UnsupportedSamplingError: a truncated Poisson run that releases something, without
            ``neighbour``.
        InvalidParameterError: ``neighbour`` is not None, ``"removed"`` or ``"added"``.
    """
    import dp_accounting

    from dpledger.ledger.events import SamplingScheme

    if neighbour is not None and neighbour not in _NEIGHBOURS:
        raise InvalidParameterError("neighbour", neighbour, 'None, "removed" or "added"')
    q, z = run.sampling_probability, run.noise_multiplier
    scheme = run.scheme
    if math.isinf(z) or q == 0.0:
        step: dp_accounting.DpEvent = dp_accounting.NoOpDpEvent()
    elif scheme in (SamplingScheme.BALLS_IN_BINS, SamplingScheme.SHUFFLE):
        step = dp_accounting.UnsupportedDpEvent()
    elif z == 0.0:
        step = dp_accounting.NonPrivateDpEvent()
    elif scheme is SamplingScheme.FIXED_SIZE:
        ev = run.sampling
        assert ev is not None and ev.population_size is not None and ev.batch_size is not None
        step = dp_accounting.SampledWithoutReplacementDpEvent(
            source_dataset_size=ev.population_size,
            sample_size=ev.batch_size,
            event=dp_accounting.GaussianDpEvent(noise_multiplier=z / 2.0),
        )
    elif scheme is SamplingScheme.TRUNCATED_POISSON:
        ev = run.sampling
        assert ev is not None and ev.population_size is not None
        assert ev.max_batch_size is not None
        if neighbour is None:
            raise UnsupportedSamplingError(
                f"a truncated Poisson run ({ev.describe()}) has no single dp-accounting event: "
                "TruncatedSubsampledGaussianDpEvent takes the size of the data set holding the "
                f"differing record, n = {ev.population_size} when it is removed and n + 1 when "
                "one is added, and the guarantee is the larger of the two; use "
                "PrivacyLedger.to_dp_events() (one event per neighbouring pair, report the "
                "largest ε) or dpledger's pld accountant, which accounts both",
                accountant="dp-accounting",
                scheme=scheme.value,
            )
        step = dp_accounting.TruncatedSubsampledGaussianDpEvent(
            dataset_size=ev.population_size + _NEIGHBOURS.index(neighbour),
            sampling_probability=q,
            truncated_batch_size=ev.max_batch_size,
            noise_multiplier=z,
        )
    else:
        step = dp_accounting.GaussianDpEvent(noise_multiplier=z)
        if q < 1.0:
            step = dp_accounting.PoissonSampledDpEvent(sampling_probability=q, event=step)
    if run.count == 1:
        return step
    return dp_accounting.SelfComposedDpEvent(event=step, count=run.count)


def correlated_to_dp_event(event: CorrelatedReleaseEvent) -> dp_accounting.DpEvent:
    """A correlated-noise release as a dp-accounting event (``dpledger/accountants/correlated.py``).

    * without amplification: ``GaussianDpEvent(σ / (sens(C)·S))``, one Gaussian mechanism;
    * with Poisson sampling (rate q) within cyclic bands: ``SelfComposedDpEvent(
      MixtureOfGaussiansDpEvent(σ / (S·max_j ‖C_j‖), (0, 1), (1 − q, q)), k)``, the
      mixture-of-Gaussians reduction of Choquette-Choo et al. 2024 (arXiv:2310.15526) for a
      banded C (each participation sees one column), which dp-accounting's PLD accountant
      analyses under add/remove.

    σ = 0 gives ``NonPrivateDpEvent``.
    """
    import dp_accounting

    if event.noise_stddev == 0.0:
        return dp_accounting.NonPrivateDpEvent()
    s = event.l2_norm_bound
    if not event.amplified:
        return dp_accounting.GaussianDpEvent(
            noise_multiplier=event.noise_stddev / (s * event.sensitivity)
        )
    q = event.sampling_probability
    mixture = dp_accounting.dp_event.MixtureOfGaussiansDpEvent(
        standard_deviation=event.noise_stddev / (s * event.max_column_norm),
        sensitivities=[0.0, 1.0],
        sampling_probs=[1.0 - q, q],
    )
    if event.max_participations == 1:
        return mixture
    return dp_accounting.SelfComposedDpEvent(event=mixture, count=event.max_participations)


def compressed_to_dp_event(
    ledger: CompressedLedger, *, neighbour: str | None = None
) -> dp_accounting.DpEvent:
    """All runs of a compressed ledger, composed in order, then its correlated-noise releases
    (:func:`correlated_to_dp_event`), as one dp-accounting event.

    A ledger with truncated Poisson runs needs ``neighbour`` (:func:`run_to_dp_event`); its
    guarantee is the larger of the two events' (:func:`compressed_to_dp_events`).

    Raises:
        UnsupportedSamplingError: truncated Poisson runs without ``neighbour``.
    """
    import dp_accounting

    # the releases' recorded sensitivities are checked against their parameters first; imported
    # here because the mechanisms import the ledger
    from dpledger.mechanisms.correlated.verification import verified_release

    return dp_accounting.ComposedDpEvent(
        events=[run_to_dp_event(r, neighbour=neighbour) for r in ledger.runs]
        + [
            correlated_to_dp_event(verified_release(e, release=i))
            for i, e in enumerate(ledger.correlated)
        ]
    )


def compressed_to_dp_events(ledger: CompressedLedger) -> list[dp_accounting.DpEvent]:
    """One dp-accounting event per neighbouring pair the ledger must be analysed for; its ε(δ)
    (δ(ε)) is the largest of theirs.

    One event (:func:`compressed_to_dp_event`) unless the ledger has truncated Poisson runs that
    release something; then two, the pair with a record removed (dataset_size n) and the one
    with a record added (dataset_size n + 1), in that order (:func:`run_to_dp_event`).
    """
    from dpledger.ledger.events import SamplingScheme

    truncated = any(
        r.scheme is SamplingScheme.TRUNCATED_POISSON
        and not r.releases_nothing
        and r.noise_multiplier > 0.0
        for r in ledger.runs
    )
    if not truncated:
        return [compressed_to_dp_event(ledger)]
    return [compressed_to_dp_event(ledger, neighbour=side) for side in _NEIGHBOURS]
