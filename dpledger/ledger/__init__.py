"""The privacy ledger: events, the append-only ledger, its file format and replay views."""

from dpledger.ledger.events import (
    NeighboringRelation,
    PrivacyUnit,
    SamplingEvent,
    SamplingScheme,
    SumQueryEvent,
)
from dpledger.ledger.ledger import LedgerHeader, LedgerWarning, PrivacyLedger
from dpledger.ledger.steps import (
    CompressedLedger,
    EpochSegment,
    LedgerStep,
    StepRun,
    effective_noise_multiplier,
    step_noise_multiplier,
)
from dpledger.ledger.verify import VerificationReport, verify_ledger

__all__ = [
    "CompressedLedger",
    "EpochSegment",
    "LedgerHeader",
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
    "effective_noise_multiplier",
    "step_noise_multiplier",
    "verify_ledger",
]
