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


def __getattr__(name: str) -> object:
    """``effective_noise_multiplier``: the former name of
    :func:`noise_multiplier_from_inverse_square_sum`, kept for one release with a warning (the
    name belongs to :func:`dpledger.mechanisms.effective_noise_multiplier`, which takes the
    queries' bounds and standard deviations)."""
    if name == "effective_noise_multiplier":
        import warnings

        warnings.warn(
            "dpledger.ledger.effective_noise_multiplier was renamed "
            "dpledger.ledger.noise_multiplier_from_inverse_square_sum",
            DeprecationWarning,
            stacklevel=2,
        )
        return noise_multiplier_from_inverse_square_sum
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
