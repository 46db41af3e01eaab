"""Verification of a ledger file without loading its events into memory."""

from __future__ import annotations

import os
import warnings
from typing import Any

import attrs

from dpledger.errors import LedgerVerificationError, NotALedgerError
from dpledger.ledger.ledger import PrivacyLedger

__all__ = ["VerificationReport", "verify_ledger"]


@attrs.frozen
class VerificationReport:
    """The outcome of :func:`verify_ledger`.

    Attributes:
        path: the file that was checked.
        intact: True when every line verifies and none is incomplete.
        first_bad_line: 1-based number of the first line that fails, or None.
        reason: why that line fails, or None.
        num_events: events in the verified prefix.
        num_steps: steps in the verified prefix.
        closed: True when the verified prefix ends with a close marker. A ledger whose last
            lines were deleted looks like one whose writer crashed: compare :attr:`head_hash`
            with a published value to rule that out.
        head_hash: hash of the last verified line.
    """

    path: str
    intact: bool
    first_bad_line: int | None
    reason: str | None
    num_events: int
    num_steps: int
    closed: bool
    head_hash: str | None

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready values."""
        return attrs.asdict(self)


def verify_ledger(path: str | os.PathLike[str]) -> VerificationReport:
    """Check a ledger file's hash chain, sequence numbers and events.

    Never raises for a damaged ledger: the report names the first bad line. A file that is not a
    ledger at all still raises :class:`~dpledger.errors.NotALedgerError`.
    """
    spath = os.fspath(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ledger = PrivacyLedger.load(spath, keep_events=False)
    except LedgerVerificationError as exc:
        return VerificationReport(
            path=spath,
            intact=False,
            first_bad_line=exc.line_number,
            reason=exc.reason,
            num_events=0,
            num_steps=0,
            closed=False,
            head_hash=None,
        )
    except NotALedgerError:
        raise
    torn = ledger.torn_tail
    return VerificationReport(
        path=spath,
        intact=torn is None,
        first_bad_line=None if torn is None else torn.line_number,
        reason=None if torn is None else torn.describe(),
        num_events=ledger.num_events,
        num_steps=ledger.num_steps,
        closed=bool(ledger.closed_cleanly),
        head_hash=ledger.head_hash,
    )
