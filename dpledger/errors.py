"""The exceptions dpledger raises.

Every error is a :class:`DPLedgerError`. Errors caused by a bad argument also subclass
:class:`ValueError`, so code that already catches ``ValueError`` keeps working. Messages name the
parameter, the value that was given and what would have been valid.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DPLedgerError",
    "InvalidParameterError",
    "LedgerError",
    "LedgerExistsError",
    "LedgerFileError",
    "LedgerLockedError",
    "LedgerStateError",
    "LedgerVerificationError",
    "NotALedgerError",
    "UnsupportedLedgerError",
]


class DPLedgerError(Exception):
    """Root of every exception raised by dpledger."""


class InvalidParameterError(DPLedgerError, ValueError):
    """A parameter has a value outside its valid domain.

    Attributes:
        parameter: the name of the offending parameter, as the caller spelled it.
        value: the value that was rejected.
        expected: a short description of the valid values.
    """

    def __init__(self, parameter: str, value: Any, expected: str) -> None:
        self.parameter = parameter
        self.value = value
        self.expected = expected
        super().__init__(f"{parameter}={value!r} is invalid: expected {expected}")


class LedgerError(DPLedgerError):
    """A privacy ledger cannot do what was asked."""


class LedgerStateError(LedgerError, RuntimeError):
    """The ledger is in the wrong state for the call.

    Examples: a sum query recorded before any sampling event, or a record on a ledger that was
    closed or loaded read-only.
    """


class LedgerFileError(LedgerError):
    """A problem with a ledger file on disk."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        self.path = path
        super().__init__(message)


class NotALedgerError(LedgerFileError, ValueError):
    """The file is not a dpledger ledger (or a path is a directory)."""


class LedgerExistsError(LedgerFileError, FileExistsError):
    """A new ledger was asked for at a path where a file already exists."""


class LedgerLockedError(LedgerFileError):
    """Another writer holds the ledger file open for appending."""


class LedgerVerificationError(LedgerFileError):
    """A ledger file was altered after it was written.

    Attributes:
        line_number: 1-based number of the first line that fails verification.
        reason: what is wrong with that line.
    """

    def __init__(self, reason: str, *, line_number: int, path: str | None = None) -> None:
        self.line_number = line_number
        self.reason = reason
        where = f"{path}: " if path else ""
        super().__init__(f"{where}line {line_number}: {reason}", path=path)


class UnsupportedLedgerError(DPLedgerError, ValueError):
    """An accountant cannot analyse this ledger (an event kind, a neighboring relation, …)."""


class MissingHeaderError(NotALedgerError):
    """A file holds no complete ledger header: it is empty, or its writer stopped in line 1.

    Such a file records nothing, not even the neighboring relation, so it is not a ledger that can
    be read or accounted (an accountant would report ε = 0 for it). Reopening it with
    ``PrivacyLedger(path, resume=True)`` starts it over with a new header.
    """


__all__ += ["MissingHeaderError"]


class SamplerMismatchError(DPLedgerError, RuntimeError):
    """A step's records were not drawn by the sampler whose parameters the ledger would record.

    The sampling event of a step says how its records were chosen (q and n of a Poisson sampler);
    a batch from another loader, or one cut or filtered after sampling, would be recorded with a
    guarantee it does not have. The step is refused before anything is recorded.
    """


__all__ += ["SamplerMismatchError"]
