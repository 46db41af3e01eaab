"""What a ledger's sampling means for its ε, in words a reviewer can act on.

For a ledger with shuffled batches no accountant certifies an amplified ε (see
:mod:`dpledger.accountants.sampling_reduction`), yet the number people report for such runs is
the Poisson ε of the same q = b/n. :func:`shuffle_gap` puts the two side by side: the Poisson ε
the run would have if its batches had been Poisson-sampled, and the certified *lower* bound of
Chua et al. on the ε the shuffled run actually has (:mod:`dpledger.accountants.shuffle_bound`).
When the lower bound exceeds the Poisson ε, reporting the Poisson ε is provably wrong.

Like with like. The two numbers are only comparable under one neighbouring relation: an ε under
replace-one (sensitivity 2S) is larger than one under add/remove, so a replace-one lower bound
above an add/remove Poisson ε proves nothing (at b = 1000, n = 10,000, z = 5, one epoch,
δ = 1e-5 the replace-one lower bound is 0.317, the replace-one Poisson ε 0.442 and the
add/remove one 0.231). Each number is therefore a :class:`RelationEpsilon`, which carries its
:class:`GapRelation` and refuses to be compared with an ε under another relation
(:class:`~dpledger.errors.RelationMismatchError`). The relation is the ledger's:

* replace-one ledger: both numbers under replace-one;
* add/remove ledger: both under *zero-out* (one record's clipped gradient replaced by zero).
  Chua et al.'s lower bound is stated for that pair (it keeps the batch sizes), and for Poisson
  sampling the zero-out ε *is* the add/remove ε: a record whose gradient is zero changes no
  sampled sum, so the zero-out pair is the add/remove pair (dp-accounting documents the same
  for its ``REPLACE_SPECIAL`` relation). The verdict is then one about zero-out neighbours.

The Poisson ε is the PRV accountant's certified upper bound under that relation (for
replace-one, the pair of mixtures with means ±1; see :mod:`dpledger.accountants.prv`), so a
lower bound above it is above the Poisson ε itself.
"""

from __future__ import annotations

import enum

import attrs

from dpledger.accountants.display import format_rounded
from dpledger.accountants.shuffle_bound import shuffle_epsilon_lower_bound
from dpledger.errors import RelationMismatchError
from dpledger.ledger.events import NeighboringRelation, SamplingScheme
from dpledger.ledger.steps import CompressedLedger, EpochSegment, StepRun
from dpledger.validation import check_enum

__all__ = ["GapRelation", "RelationEpsilon", "ShuffleGap", "shuffle_gap"]


class GapRelation(str, enum.Enum):
    """The neighbouring relation both numbers of a shuffle gap are stated under.

    ZERO_OUT: one record's clipped gradient replaced by zero. Chua et al.'s lower bound for an
        add/remove ledger is stated under it; under Poisson sampling its ε equals the
        add/remove ε (see the module docstring).
    REPLACE_ONE: one record replaced by another (sensitivity 2S).
    """

    ZERO_OUT = "zero_out"
    REPLACE_ONE = "replace_one"

    @classmethod
    def of_ledger(cls, relation: NeighboringRelation) -> GapRelation:
        """The relation a ledger with neighbouring ``relation`` is compared under."""
        if relation is NeighboringRelation.REPLACE_ONE:
            return cls.REPLACE_ONE
        return cls.ZERO_OUT

    @property
    def label(self) -> str:
        """The relation in words: ``"replace-one"`` or ``"zero-out"``."""
        return self.value.replace("_", "-")

    @property
    def bound_relation(self) -> NeighboringRelation:
        """The ``neighboring`` argument that states a bound under this relation (for the Poisson
        ε and :func:`~dpledger.accountants.shuffle_bound.shuffle_epsilon_lower_bound`, whose
        ``"add_remove"`` is the zero-out form)."""
        if self is GapRelation.REPLACE_ONE:
            return NeighboringRelation.REPLACE_ONE
        return NeighboringRelation.ADD_REMOVE


@attrs.frozen
class RelationEpsilon:
    """An ε stated under one neighbouring relation.

    Attributes:
        epsilon: ε.
        relation: the relation it is stated under.
    """

    epsilon: float
    relation: GapRelation = attrs.field(converter=lambda v: check_enum("relation", v, GapRelation))

    def exceeds(self, other: RelationEpsilon) -> bool:
        """Whether this ε is larger than ``other``, an ε under the same relation.

        Raises:
            RelationMismatchError: ``other`` is stated under another relation (the comparison
                would say nothing).
        """
        if other.relation is not self.relation:
            raise RelationMismatchError(
                "other",
                other,
                f"an ε under {self.relation.label}, the relation of the ε it is compared with "
                f"({self!r})",
            )
        return self.epsilon > other.epsilon


@attrs.frozen
class ShuffleGap:
    """The Poisson ε a shuffled run would be reported with, and the ε it provably exceeds.

    Both are stated under one relation (:attr:`relation`); constructing a gap from numbers under
    two relations raises :class:`~dpledger.errors.RelationMismatchError`.

    Attributes:
        sampling: the shuffle event, e.g. ``shuffle(b=256, n=60000)``.
        steps: the shuffled steps of the ledger.
        epochs: their epochs.
        noise_multiplier: the smallest z_eff among them (the lower bound takes every epoch at
            that noise only when all are equal; see :func:`shuffle_gap`).
        delta: δ.
        poisson_epsilon: the ε of the same number of steps Poisson-sampled with q = b/n at
            that z (the PRV accountant's upper bound): the number commonly reported.
        lower_bound: Chua et al.'s certified lower bound on the shuffled run's ε; None when the
            run's noise varies between steps (the bound needs one z).
    """

    sampling: str
    steps: int
    epochs: int
    noise_multiplier: float
    delta: float
    poisson_epsilon: RelationEpsilon
    lower_bound: RelationEpsilon | None

    def __attrs_post_init__(self) -> None:
        if self.lower_bound is not None:
            self.lower_bound.exceeds(self.poisson_epsilon)  # refuses a mismatch

    @property
    def relation(self) -> GapRelation:
        """The relation both numbers are stated under."""
        return self.poisson_epsilon.relation

    @property
    def refutes_poisson(self) -> bool:
        """Whether the lower bound exceeds the Poisson ε under the same relation, i.e. the
        Poisson ε is provably not a valid guarantee for the shuffled run."""
        return self.lower_bound is not None and self.lower_bound.exceeds(self.poisson_epsilon)

    def describe(self) -> str:
        """One paragraph for the CLI."""
        relation = self.relation.label
        if self.relation is GapRelation.ZERO_OUT:
            relation += " (for Poisson sampling the same ε as add/remove)"
        text = (
            f"shuffled batches, {self.sampling}: {self.steps} steps in {self.epochs} epochs. "
            f"Compared under {relation}: had they been Poisson-sampled with q = b/n, ε would be "
            f"{format_rounded(self.poisson_epsilon.epsilon, 'up', digits=4)} (prv upper bound)"
        )
        if self.lower_bound is None:
            return text + "; no lower bound for a noise that varies between steps."
        verdict = (
            f"so under {self.relation.label} the Poisson ε is NOT a valid guarantee for this run"
            if self.refutes_poisson
            else "which does not rule out the Poisson ε"
        )
        shown = format_rounded(self.lower_bound.epsilon, "down", digits=4)
        return f"{text}; this run's ε is at least {shown} (Chua et al. lower bound), {verdict}."


def shuffle_gap(ledger: CompressedLedger, *, delta: float) -> ShuffleGap | None:
    """The shuffle gap of a ledger whose shuffled steps share one shuffle event, else None.

    Both numbers are under the ledger's relation: replace-one for a replace-one ledger, zero-out
    for an add/remove one (:class:`GapRelation`, module docstring).

    Args:
        ledger: the compressed ledger.
        delta: δ in (0, 1).
    """
    from dpledger.accountants.prv import PrvAccountant

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
    relation = GapRelation.of_ledger(ledger.neighboring)
    poisson = CompressedLedger(
        neighboring=relation.bound_relation,
        runs=(StepRun(event.sampling_probability, z, steps),),
    )
    poisson_eps = RelationEpsilon(PrvAccountant().epsilon(poisson, delta=delta).epsilon, relation)
    lower = None
    if len(zs) == 1:
        batches = event.batches_per_epoch
        assert batches is not None
        bound = shuffle_epsilon_lower_bound(
            batches_per_epoch=batches,
            epochs=epochs,
            noise_multiplier=z,
            delta=delta,
            neighboring=relation.bound_relation.value,
        )
        lower = RelationEpsilon(bound, relation)
    return ShuffleGap(
        sampling=event.describe(),
        steps=steps,
        epochs=epochs,
        noise_multiplier=z,
        delta=delta,
        poisson_epsilon=poisson_eps,
        lower_bound=lower,
    )
