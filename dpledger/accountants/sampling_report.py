"""What a ledger's sampling means for its ε, in words a reviewer can act on.

For a ledger with shuffled batches no accountant certifies an amplified ε (see
:mod:`dpledger.accountants.sampling_reduction`), yet the number people report for such runs is
the Poisson ε of the same q = b/n. :func:`shuffle_gap` puts the two side by side: the Poisson ε
the run would have if its batches had been Poisson-sampled, and the certified *lower* bound of
Chua et al. on the ε the shuffled run actually has (:mod:`dpledger.accountants.shuffle_bound`).
When the lower bound exceeds the Poisson ε, reporting the Poisson ε is provably wrong.
"""

from __future__ import annotations

import attrs

from dpledger.accountants.display import format_rounded
from dpledger.accountants.shuffle_bound import shuffle_epsilon_lower_bound
from dpledger.ledger.events import SamplingScheme
from dpledger.ledger.steps import CompressedLedger, EpochSegment, StepRun

__all__ = ["ShuffleGap", "shuffle_gap"]


@attrs.frozen
class ShuffleGap:
    """The Poisson ε a shuffled run would be reported with, and the ε it provably exceeds.

    Attributes:
        sampling: the shuffle event, e.g. ``shuffle(b=256, n=60000)``.
        steps: the shuffled steps of the ledger.
        epochs: their epochs.
        noise_multiplier: the smallest z_eff among them (the lower bound takes every epoch at
            that noise only when all are equal; see :func:`shuffle_gap`).
        delta: δ.
        poisson_epsilon: the ε of the same number of steps Poisson-sampled with q = b/n at
            that z, under add/remove (PLD accountant): the number commonly reported.
        lower_bound: Chua et al.'s certified lower bound on the shuffled run's ε, under
            ``relation``; None when the run's noise varies between steps (the bound needs one z).
        relation: ``"replace_one"`` for a replace-one ledger; ``"add_remove"`` otherwise, in the
            zero-out form Chua et al. analyse (the record replaced by one whose clipped
            gradient is zero).
    """

    sampling: str
    steps: int
    epochs: int
    noise_multiplier: float
    delta: float
    poisson_epsilon: float
    lower_bound: float | None
    relation: str

    def describe(self) -> str:
        """One paragraph for the CLI."""
        text = (
            f"shuffled batches, {self.sampling}: {self.steps} steps in {self.epochs} epochs. "
            f"Had they been Poisson-sampled with q = b/n, ε would be {self.poisson_epsilon:.4g} "
            "(pld, add/remove)"
        )
        if self.lower_bound is None:
            return text + "; no lower bound for a noise that varies between steps."
        relation = "replace-one" if self.relation == "replace_one" else "add/remove as zero-out"
        verdict = (
            "so the Poisson ε is NOT a valid guarantee for this run"
            if self.lower_bound > self.poisson_epsilon
            else "which does not rule out the Poisson ε"
        )
        shown = format_rounded(self.lower_bound, "down", digits=4)
        return (
            f"{text}; this run's ε is at least {shown} (Chua et al. lower bound, "
            f"{relation}), {verdict}."
        )


def shuffle_gap(ledger: CompressedLedger, *, delta: float) -> ShuffleGap | None:
    """The shuffle gap of a ledger whose shuffled steps share one shuffle event, else None.

    Args:
        ledger: the compressed ledger.
        delta: δ in (0, 1).
    """
    from dpledger.accountants.pld import PldAccountant

    segments = [
        item
        for item in ledger.epoch_view()
        if isinstance(item, EpochSegment) and item.sampling.scheme is SamplingScheme.SHUFFLE
    ]
    events = {seg.sampling for seg in segments}
    if len(events) != 1:
        return None
    event = events.pop()
    steps = sum(seg.steps for seg in segments)
    epochs = sum(seg.epochs for seg in segments)
    zs = {
        r.noise_multiplier
        for r in ledger.runs
        if r.sampling is not None and r.sampling.scheme is SamplingScheme.SHUFFLE
    }
    z = min(zs)
    if not 0.0 < z < float("inf"):
        return None
    poisson = CompressedLedger(runs=(StepRun(event.sampling_probability, z, steps),))
    poisson_eps = PldAccountant().epsilon(poisson, delta=delta).epsilon
    relation = ledger.neighboring.value
    lower = None
    if len(zs) == 1:
        batches = event.batches_per_epoch
        assert batches is not None
        lower = shuffle_epsilon_lower_bound(
            batches_per_epoch=batches,
            epochs=epochs,
            noise_multiplier=z,
            delta=delta,
            neighboring=relation,
        )
    return ShuffleGap(
        sampling=event.describe(),
        steps=steps,
        epochs=epochs,
        noise_multiplier=z,
        delta=delta,
        poisson_epsilon=poisson_eps,
        lower_bound=lower,
        relation=relation,
    )
