"""dpledger: differentially private training and privacy accounting around a privacy ledger.

Mechanisms append sampling and sum-query events to an append-only :class:`PrivacyLedger`;
accountants replay the ledger afterwards to compute (ε, δ). ``import dpledger`` needs neither
PyTorch nor TensorFlow; the framework adapters import them when they are used.
"""

from dpledger._version import __version__
from dpledger.errors import (
    DPLedgerError,
    InvalidParameterError,
    LedgerError,
    LedgerExistsError,
    LedgerFileError,
    LedgerLockedError,
    LedgerStateError,
    LedgerVerificationError,
    NotALedgerError,
    UnsupportedLedgerError,
)
from dpledger.ledger import (
    CompressedLedger,
    LedgerStep,
    LedgerWarning,
    NeighboringRelation,
    PrivacyLedger,
    PrivacyUnit,
    SamplingEvent,
    SamplingScheme,
    StepRun,
    SumQueryEvent,
    VerificationReport,
    verify_ledger,
)
from dpledger.mechanisms.config import DPConfig

__all__ = [
    "CompressedLedger",
    "DPConfig",
    "DPLedgerError",
    "InvalidParameterError",
    "LedgerError",
    "LedgerExistsError",
    "LedgerFileError",
    "LedgerLockedError",
    "LedgerStateError",
    "LedgerStep",
    "LedgerVerificationError",
    "LedgerWarning",
    "NeighboringRelation",
    "NotALedgerError",
    "PrivacyLedger",
    "PrivacyUnit",
    "SamplingEvent",
    "SamplingScheme",
    "StepRun",
    "SumQueryEvent",
    "UnsupportedLedgerError",
    "VerificationReport",
    "__version__",
    "verify_ledger",
]
