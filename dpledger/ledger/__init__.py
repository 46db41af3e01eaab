"""The privacy ledger: events, the append-only ledger, its file format and replay views."""

from dpledger.ledger.correlated import (
    CorrelatedReleaseEvent,
    NoiseSeedReuseError,
    NoiseStreamRollbackError,
    ReleaseMismatchError,
    StreamStepEvent,
)
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
    noise_multiplier_from_inverse_square_sum,
    step_noise_multiplier,
)
from dpledger.ledger.verify import VerificationReport, verify_ledger

__all__ = [
    "CompressedLedger",
    "CorrelatedReleaseEvent",
    "EpochSegment",
    "LedgerHeader",
    "LedgerStep",
    "LedgerWarning",
    "NeighboringRelation",
    "NoiseSeedReuseError",
    "NoiseStreamRollbackError",
    "PrivacyLedger",
    "PrivacyUnit",
    "ReleaseMismatchError",
    "SamplingEvent",
    "SamplingScheme",
    "StepRun",
    "StreamStepEvent",
    "SumQueryEvent",
    "VerificationReport",
    "noise_multiplier_from_inverse_square_sum",
    "step_noise_multiplier",
    "verify_ledger",
]
