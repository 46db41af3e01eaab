"""Ledger reductions shared by the accountants that analyse the epoch-based sampling schemes.

Balls-in-bins and shuffled batches put every record into exactly one batch of each epoch. With
the allocation (or permutation) of the other records coupled between two neighbouring data sets,
an epoch's outputs differ in one step only, where one Gaussian sum query saw the differing
record: under add/remove (balls-in-bins) the sum moves by at most S, under replace-one (the
differing record takes the replaced record's batch; shuffle and balls-in-bins) by at most 2S.
Given the coupling, the epoch's steps are an adaptive composition in which only that step
depends on the differing record, so the epoch is at most as revealing as one Gaussian mechanism
with the epoch's smallest noise multiplier; mixing over the coupling (joint convexity of the
hockey-stick and of exp((α − 1)·D_α)) keeps that bound. This is the "deterministic batches"
analysis: valid for adaptive DP-SGD, with no credit for the randomness of the allocation. It is
an upper bound; Chua et al. (2024, 2025) show that the true ε of a shuffled run can lie far
above the Poisson ε of the same q, and well below this bound.
"""

from __future__ import annotations

from dpledger.ledger.steps import CompressedLedger, EpochSegment, StepRun

__all__ = ["NO_AMPLIFICATION_NOTE", "has_epochs", "reduce_epochs"]

NO_AMPLIFICATION_NOTE = (
    "balls-in-bins or shuffled steps are accounted without amplification: each epoch as one "
    "Gaussian mechanism (each record is in one batch per epoch), a valid upper bound (the "
    "random_allocation accountant certifies balls-in-bins steps with amplification)"
)


def has_epochs(ledger: CompressedLedger) -> bool:
    """True when the ledger has steps of an epoch-based scheme (balls-in-bins, shuffle)."""
    return any(r.sampling is not None and r.sampling.scheme.is_epoch_based for r in ledger.runs)


def reduce_epochs(ledger: CompressedLedger) -> CompressedLedger:
    """The ledger with every epoch of an epoch-based scheme replaced by one full-batch step.

    Each :class:`~dpledger.ledger.steps.EpochSegment` becomes a run of ``epochs`` full-batch
    steps (q = 1) with the segment's smallest z_eff; the accountant then applies the ledger's
    relation to them as to any full-batch step (sensitivity S under add/remove, 2S under
    replace-one). See the module docstring for why this is a valid upper bound. Runs of other
    schemes are kept in place.
    """
    runs: list[StepRun] = []
    for item in ledger.epoch_view():
        if isinstance(item, EpochSegment):
            runs.append(StepRun(1.0, item.noise_multiplier, item.epochs))
        else:
            runs.append(item)
    return CompressedLedger(neighboring=ledger.neighboring, runs=tuple(runs))
