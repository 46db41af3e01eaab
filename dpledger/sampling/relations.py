"""Which neighbouring relation a ledger needs for the scheme that samples its steps.

dpledger analyses each sampling scheme under some neighbouring relations only
(:attr:`~dpledger.ledger.SamplingEvent.relations`): fixed-size and shuffled batches under
replace-one, for example. A ledger created with another relation would record steps no
accountant can certify, so the optimizers refuse it when they are built, before any step.
"""

from __future__ import annotations

from dpledger.errors import InvalidParameterError
from dpledger.ledger import NeighboringRelation, SamplingEvent

__all__ = ["check_ledger_relation", "default_relation"]


def default_relation(event: SamplingEvent) -> NeighboringRelation:
    """The relation of a new in-memory ledger for steps sampled as ``event``: add/remove when
    the scheme is analysed under it, else the first relation it is analysed under."""
    relations = event.relations
    if NeighboringRelation.ADD_REMOVE in relations:
        return NeighboringRelation.ADD_REMOVE
    return relations[0]


def check_ledger_relation(event: SamplingEvent, neighboring: NeighboringRelation) -> None:
    """Refuse a ledger relation under which the scheme of ``event`` has no analysis.

    Args:
        event: the sampling event of the steps.
        neighboring: the ledger's neighbouring relation.

    Raises:
        InvalidParameterError: naming ``ledger`` and the relation(s) to create it with.
    """
    relations = event.relations
    if neighboring in relations:
        return
    wanted = " or ".join(f"neighboring={r.value!r}" for r in relations)
    raise InvalidParameterError(
        "ledger",
        f"<PrivacyLedger with neighboring={neighboring.value!r}>",
        f"a ledger created with {wanted} (e.g. PrivacyLedger(path, "
        f"neighboring={relations[0].value!r})): steps sampled by {event.describe()} are "
        f"analysed under {' or '.join(r.value for r in relations)} only, so no accountant "
        "could certify this run",
    )
