"""Accounting for correlated-noise releases: the Gaussian mechanisms they are equivalent to.

A correlated-noise release (:class:`~dpledger.ledger.CorrelatedReleaseEvent`,
``docs/correlated-noise.md``) is not a sequence of independent DP-SGD steps. It reduces exactly to
mechanisms every accountant already analyses:

* **No amplification** (``sampling == "none"``). Two neighbouring streams differ by a matrix D
  whose rows are the record's clipped contributions on one allowed participation pattern, so the
  release C·X + Z moves by C·D with ‖C·D‖_F ≤ Δ = sens(C)·S. It is one Gaussian mechanism with
  sensitivity Δ and noise σ, μ = Δ/σ, and B·(·) is post-processing (Choquette-Choo et al. 2023,
  "Multi-Epoch Matrix Factorization Mechanisms for Private Machine Learning", section 2;
  Denisov et al. 2022). As a ledger run: one full-batch step (q = 1) with noise multiplier
  z = σ/Δ. Under replace-one the accountants use 2S, as for any step: a replaced record moves
  each contribution by at most 2S.
* **Poisson sampling within b cyclic bands** (``sampling == "poisson_within_bands"``, C with at
  most b bands). A record belongs to one of b groups and can take part only in the steps
  i, i + b, i + 2b, …; columns of C at least b apart have disjoint row supports, so its k
  participations touch disjoint blocks of rows, each a Poisson-subsampled Gaussian with
  sensitivity ‖C_j‖·S ≤ max_j ‖C_j‖·S and noise σ, composed adaptively k times
  (Choquette-Choo et al. 2023, "Amplified Banded Matrix Factorization: A unified approach to
  private training", section 4). As ledger runs: k Poisson steps with rate q and noise
  multiplier σ/(S·max_j ‖C_j‖). For dp-accounting the same mechanism is the
  ``MixtureOfGaussiansDpEvent`` with sensitivities (0, 1) and probabilities (1 − q, q)
  (Choquette-Choo et al. 2024, "Privacy Amplification for Matrix Mechanisms"), which
  :func:`dpledger.ledger.dp_event.correlated_to_dp_event` builds.

The base class (:func:`dpledger.accountants.base.as_compressed`) replaces a ledger's releases by
these runs before any accountant sees it, each release first checked against its own parameters
(:func:`dpledger.mechanisms.correlated.verification.verified_release`: the recorded
sensitivity, column norm, bands and hash recomputed from the strategy's kind and parameters; a
disagreement is refused with :class:`~dpledger.ledger.correlated.ReleaseMismatchError`), so every
accountant that supports Poisson and full-batch steps certifies them, and one that does not
refuses them with :class:`~dpledger.errors.UnsupportedSamplingError` before computing. ε after a
number of steps (``epsilon_curve``) is refused for a ledger with a release: the release is one
mechanism over its whole stream, not a sequence of steps.
"""

from __future__ import annotations

import math

import attrs

from dpledger.errors import UnsupportedLedgerError
from dpledger.ledger.correlated import CorrelatedReleaseEvent
from dpledger.ledger.ledger import PrivacyLedger
from dpledger.ledger.steps import CompressedLedger, StepRun
from dpledger.mechanisms.correlated.verification import verified_release

__all__ = ["equivalent_runs", "expand_correlated", "refuse_correlated_curve"]


def equivalent_runs(event: CorrelatedReleaseEvent) -> tuple[StepRun, ...]:
    """The ledger runs a release is equivalent to (module docstring)."""
    s, sigma = event.l2_norm_bound, event.noise_stddev
    if event.amplified:
        z = sigma / (s * event.max_column_norm)
        q = event.sampling_probability
        return (StepRun(q, _checked_multiplier(z), event.max_participations),)
    z = sigma / (s * event.sensitivity)
    return (StepRun(1.0, _checked_multiplier(z), 1),)


def _checked_multiplier(z: float) -> float:
    """z, refused if it overflowed to ∞ (which would read as "released nothing")."""
    if math.isinf(z):
        raise UnsupportedLedgerError(
            "a correlated release's noise multiplier overflows; refusing rather than treating "
            "it as a release of nothing"
        )
    return z


def expand_correlated(ledger: CompressedLedger) -> CompressedLedger:
    """``ledger`` with its correlated releases replaced by their equivalent runs (appended
    after its steps; composition is commutative), each release's recorded sensitivity checked
    against its parameters first
    (:func:`~dpledger.mechanisms.correlated.verification.verified_release`)."""
    if not ledger.correlated:
        return ledger
    runs = list(ledger.runs)
    for i, event in enumerate(ledger.correlated):
        runs.extend(equivalent_runs(verified_release(event, release=i)))
    return attrs.evolve(ledger, runs=tuple(runs), correlated=())


def refuse_correlated_curve(ledger: PrivacyLedger | CompressedLedger) -> None:
    """Raise :class:`UnsupportedLedgerError` for a ledger with a correlated release (an ε
    curve over steps does not describe a release of a whole stream)."""
    events = ledger.correlated_releases if isinstance(ledger, PrivacyLedger) else ledger.correlated
    if events:
        raise UnsupportedLedgerError(
            f"this ledger holds {len(events)} correlated-noise release(s), each one mechanism "
            "over a whole stream of steps: ask for epsilon() or delta() of the ledger instead "
            "of an ε curve over its steps"
        )
