"""The privacy ledger: events, the append-only ledger, its file format and replay views."""

from dpledger.ledger.correlated import CorrelatedReleaseEvent
from dpledger.ledger.events import (
    NeighboringRelation,
    PrivacyUnit,
    SamplingEvent,
    SamplingScheme,
    SumQueryEvent,
)
from dpledger.ledger.ledger import LedgerWarning, PrivacyLedger
from dpledger.ledger.steps import LedgerStep, StepRun
from dpledger.ledger.verify import VerificationReport, verify_ledger

__all__ = [
    "CorrelatedReleaseEvent",
    "LedgerStep",
    "LedgerWarning",
    "NeighboringRelation",
    "PrivacyLedger",
    "PrivacyUnit",
    "SamplingEvent",
    "SamplingScheme",
    "StepRun",
    "SumQueryEvent",
    "VerificationReport",
    "verify_ledger",
]
