"""Verification of a ledger file without keeping its events in memory."""

from __future__ import annotations

import os
import re
import warnings
from typing import Any

import attrs

from dpledger.errors import InvalidParameterError, LedgerVerificationError
from dpledger.ledger.ledger import PrivacyLedger
from dpledger.validation import check_bool

__all__ = ["VerificationReport", "verify_ledger"]

_HASH = re.compile(r"[0-9a-f]{64}")


@attrs.frozen
class VerificationReport:
    """The outcome of :func:`verify_ledger`.

    Attributes:
        path: the file that was checked.
        intact: True when every line verifies and none is incomplete.
        first_bad_line: 1-based number of the first line that fails (or is incomplete), or None.
        reason: why that line fails, or None.
        num_events: events in the verified prefix.
        num_steps: steps in the verified prefix.
        closed: True when the verified prefix ends with a close marker, None when it was not
            checked (a line fails verification: nothing after it is known). A ledger whose last
            lines were deleted looks like one whose writer crashed: compare :attr:`head_hash`
            with a published value to rule that out.
        head_hash: hash of the last verified line (None when a line fails verification).
        ok: ``intact``, and the extra requirements asked for (closed, expected head) hold.
        problems: one sentence per failed requirement, empty when ``ok``.
    """

    path: str
    intact: bool
    first_bad_line: int | None
    reason: str | None
    num_events: int
    num_steps: int
    closed: bool | None
    head_hash: str | None
    ok: bool = True
    problems: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready values."""
        out = attrs.asdict(self)
        out["problems"] = list(self.problems)
        return out


def _altered_report(path: str, exc: LedgerVerificationError) -> VerificationReport:
    """The report on a file that fails verification at ``exc``'s line."""
    return VerificationReport(
        path=path,
        intact=False,
        first_bad_line=exc.line_number,
        reason=exc.reason,
        num_events=0,
        num_steps=0,
        closed=None,  # not checked: verification stopped at the altered line
        head_hash=None,
        ok=False,
        problems=(f"line {exc.line_number}: {exc.reason}",),
    )


def verify_ledger(
    path: str | os.PathLike[str],
    *,
    require_closed: bool = False,
    expect_head: str | None = None,
) -> VerificationReport:
    """Check a ledger file's hash chain, sequence numbers, events and layout.

    The chain proves that no line before the last one was changed, removed, inserted or moved;
    it cannot show that lines were removed from the end (that looks like a crash). The two
    options close that gap: ``require_closed`` asks for the close marker a finished ledger ends
    with, and ``expect_head`` compares the last line's hash with a value published when the
    ledger was finished.

    Never raises for a damaged ledger: the report names the first bad line.

    Args:
        path: the ledger file.
        require_closed: also fail when the file does not end with a close marker.
        expect_head: also fail unless the last line's hash equals this (64 lowercase hex).

    Raises:
        NotALedgerError: the path is a directory or not a ledger file.
        MissingHeaderError: the file holds no complete header (empty, or cut in line 1): there
            is no ledger to verify.
        InvalidParameterError: ``expect_head`` is not 64 lowercase hex digits.
        OSError: the file cannot be read.
    """
    check_bool("require_closed", require_closed)
    if expect_head is not None and not (
        isinstance(expect_head, str) and _HASH.fullmatch(expect_head)
    ):
        raise InvalidParameterError(
            "expect_head", expect_head, "a SHA-256 hash: 64 lowercase hexadecimal digits"
        )
    spath = os.fspath(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ledger = PrivacyLedger.load(spath, keep_events=False)
    except LedgerVerificationError as exc:
        return _altered_report(spath, exc)
    torn = ledger.torn_tail
    bad_line: int | None = None
    reason: str | None = None
    if torn is not None:
        bad_line, reason = torn.line_number, torn.describe()
    closed = bool(ledger.closed_cleanly)
    problems = []
    if bad_line is not None:
        problems.append(f"line {bad_line}: {reason}")
    if require_closed and not closed:
        problems.append(
            "the ledger does not end with a close marker (its writer crashed or is still "
            "running, or its final lines were deleted)"
        )
    if expect_head is not None and ledger.head_hash != expect_head:
        problems.append(
            f"the last line's hash {ledger.head_hash} differs from the expected {expect_head} "
            "(lines were removed from or added to the end, or it is another ledger)"
        )
    return VerificationReport(
        path=spath,
        intact=bad_line is None,
        first_bad_line=bad_line,
        reason=reason,
        num_events=ledger.num_events,
        num_steps=ledger.num_steps,
        closed=closed,
        head_hash=ledger.head_hash,
        ok=not problems,
        problems=tuple(problems),
    )
