"""Conversion of a ledger into the equivalent ``dp_accounting`` event.

Imported lazily: dp-accounting is a core dependency, but importing it takes about two seconds, so
``import dpledger`` does not pay for it until a conversion is asked for.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from dpledger.ledger.steps import CompressedLedger, StepRun

if TYPE_CHECKING:
    import dp_accounting

__all__ = ["compressed_to_dp_event", "run_to_dp_event"]


def run_to_dp_event(run: StepRun) -> dp_accounting.DpEvent:
    """One run of identical steps as a dp-accounting event.

    A step is one Gaussian sum query with noise multiplier z_eff on a Poisson sample with
    probability q (paper Eq. 1). Steps that release nothing (no query, or q = 0) are
    ``NoOpDpEvent``; a step with z_eff = 0 is ``NonPrivateDpEvent`` (ε = ∞).
    """
    import dp_accounting

    q, z = run.sampling_probability, run.noise_multiplier
    if math.isinf(z) or q == 0.0:
        step: dp_accounting.DpEvent = dp_accounting.NoOpDpEvent()
    elif z == 0.0:
        step = dp_accounting.NonPrivateDpEvent()
    else:
        step = dp_accounting.GaussianDpEvent(noise_multiplier=z)
        if q < 1.0:
            step = dp_accounting.PoissonSampledDpEvent(sampling_probability=q, event=step)
    if run.count == 1:
        return step
    return dp_accounting.SelfComposedDpEvent(event=step, count=run.count)


def compressed_to_dp_event(ledger: CompressedLedger) -> dp_accounting.DpEvent:
    """All runs of a compressed ledger, composed in order, as one dp-accounting event."""
    import dp_accounting

    return dp_accounting.ComposedDpEvent(events=[run_to_dp_event(r) for r in ledger.runs])
