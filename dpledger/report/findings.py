"""What ``dpledger epsilon`` tells a reader about a ledger besides its ε, gathered for the report.

The report is the document a reviewer signs, so everything ``dpledger epsilon`` warns about is on
it too, from the same checks (never a second copy of them): δ ≥ 1/n
(:func:`~dpledger.validation.delta_too_large_message`, at the largest population size the
ledger records), the samplers of a non-Poisson ledger, and for a shuffled ledger the shuffle gap
(:func:`~dpledger.accountants.sampling_report.shuffle_gap`: the Poisson ε commonly reported
beside the certified lower bound on the run's ε, both under one named relation). With them: the
population sizes n, the run's intent (``dpledger info``'s line, or "not recorded"), where the
noise came from (a caller-given seed is a finding: the ε holds only while it stays secret) and
the time the report was generated.
"""

from __future__ import annotations

import datetime
from typing import Any

from dpledger.accountants.sampling_report import shuffle_gap
from dpledger.errors import DPLedgerError
from dpledger.ledger.commands import intent_text
from dpledger.ledger.intent import intent_of
from dpledger.ledger.ledger import PrivacyLedger
from dpledger.ledger.provenance import provenance_findings, provenance_of, provenance_text
from dpledger.ledger.steps import CompressedLedger
from dpledger.validation import delta_too_large_message

__all__ = ["NOT_RECORDED", "run_findings"]

NOT_RECORDED = "not recorded"
"""What the report shows for an intent the ledger's header does not hold."""


def run_findings(ledger: PrivacyLedger, comp: CompressedLedger, delta: float) -> dict[str, Any]:
    """The report's fields that say what ``dpledger epsilon`` says beside the numbers.

    Returns:
        A dict with ``population_sizes`` (the distinct n of the sampling events, None for an
        unrecorded one), ``intent`` (the header's intent, or None), ``intent_text`` (it on one
        line, or :data:`NOT_RECORDED`), ``generated`` (UTC, ISO 8601), ``findings`` (the
        warnings a reader must see before signing: noise or batches seeded by the caller or
        generator states in checkpoints, from
        :func:`~dpledger.ledger.provenance.provenance_findings`; δ ≥ 1/n; a shuffle gap that
        refutes the Poisson ε), ``noise_provenance`` (where the noise came from, or "not
        recorded"), ``sampling_notes`` (``epsilon``'s ``sampling:`` lines) and
        ``shuffle_gap`` (its numbers, or None).
    """
    findings: list[str] = []
    records = provenance_of(ledger.notes)
    findings.extend(f"NOISE: {finding}" for finding in provenance_findings(records))
    sizes = [n for n in ledger.population_sizes if n is not None]
    too_large = delta_too_large_message(delta, max(sizes)) if sizes else None
    if too_large is not None:
        findings.append(too_large)
    notes: list[str] = []
    gap_data: dict[str, Any] | None = None
    events = comp.sampling_events()
    if events:
        notes.append(
            "this ledger's steps were sampled by " + "; ".join(e.describe() for e in events)
        )
        try:
            gap = shuffle_gap(comp, delta=delta)
        except DPLedgerError as exc:
            notes.append(f"the shuffle gap could not be computed: {exc}")
        else:
            if gap is not None:
                notes.append(gap.describe())
                if gap.refutes_poisson:
                    findings.append(f"SHUFFLED BATCHES: {gap.describe()}")
                gap_data = {
                    "sampling": gap.sampling,
                    "relation": gap.relation.value,
                    "poisson_epsilon": gap.poisson_epsilon.epsilon,
                    "lower_bound": None if gap.lower_bound is None else gap.lower_bound.epsilon,
                    "refutes_poisson": gap.refutes_poisson,
                }
    intent = intent_of(ledger.header.metadata)
    return {
        "population_sizes": tuple(ledger.population_sizes),
        "intent": intent,
        "intent_text": NOT_RECORDED if intent is None else intent_text(intent),
        "generated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "findings": tuple(findings),
        "sampling_notes": tuple(notes),
        "shuffle_gap": gap_data,
        "noise_provenance": tuple(provenance_text(records)),
    }
