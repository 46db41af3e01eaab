"""dpledger: differentially private training and privacy accounting around a privacy ledger.

Mechanisms append sampling and sum-query events to an append-only :class:`PrivacyLedger`;
accountants replay the ledger afterwards to compute (ε, δ). ``import dpledger`` needs neither
PyTorch nor TensorFlow; the framework adapters import them when they are used.
"""

from typing import TYPE_CHECKING, Any

from dpledger._version import __version__
from dpledger.errors import DPLedgerError, InvalidParameterError
from dpledger.ledger import PrivacyLedger, SamplingEvent, verify_ledger

if TYPE_CHECKING:
    from dpledger.mechanisms.config import DPConfig

__all__ = [
    "DPConfig",
    "DPLedgerError",
    "InvalidParameterError",
    "PrivacyLedger",
    "SamplingEvent",
    "__version__",
    "verify_ledger",
]


def __getattr__(name: str) -> Any:
    # DPConfig lives in dpledger.mechanisms (which imports NumPy); it is loaded when first
    # used, so that ``import dpledger`` stays as light as the ledger.
    if name == "DPConfig":
        from dpledger.mechanisms.config import DPConfig

        return DPConfig
    raise AttributeError(f"module 'dpledger' has no attribute {name!r}")
