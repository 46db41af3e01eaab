"""The privacy report of a ledger file: verify it, replay it, gather the report.

:func:`build_report` verifies a ledger file, replays it with the accountants and collects what a
privacy reviewer needs to sign off a run into a :class:`PrivacyReport`; the renderers
(:mod:`dpledger.report.html`, :mod:`dpledger.report.markdown`) and :meth:`PrivacyReport.to_dict`
(the JSON twin) only format it. The report's types are in :mod:`dpledger.report.contents` and
the trade-off view in :mod:`dpledger.report.tradeoff_view`; this module gathers the rest and
re-exports them. The report states, in this order:

1. verification: whether the hash chain holds, whether the file is cut short or unclosed
   (stated first, as a warning, before any number), the head hash and the ``--expect-head``
   comparison;
2. the run: the header's relation, metadata, intent, n, creation time, writer and the report's
   generation time; what ``dpledger epsilon`` warns about (:mod:`dpledger.report.findings`);
3. the samplers and the sum queries (S and σ̃ per query label, with their z = σ̃ / S), the
   correlated-noise releases (kind, T, participation schema, S, σ, sensitivity, and how many of
   their stream's steps were taken), and the runs of identical steps (q, z_eff, count);
4. ε at δ by every accountant that supports the ledger, with what kind of number it is and its
   certified interval where it has one; the accountants that refused, and why;
5. ε against steps for each accountant;
6. the hypothesis-testing view: the best attacker's TPR against FPR, computed from an
   upper bound on δ(ε) (PLD, else PRV; :mod:`dpledger.report.tradeoff`);
7. an audit's lower bound beside the claim, when one is given.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from dpledger.accountants.base import (
    ACCOUNTANT_MODULES,
    SCHEME_SPECIFIC_ACCOUNTANTS,
    PrivacyResult,
    ResultKind,
    make_accountant,
)
from dpledger.accountants.commands import accountant_names
from dpledger.errors import (
    ComputationBudgetError,
    DeltaTooLargeWarning,
    DPLedgerError,
    InvalidParameterError,
    LedgerVerificationError,
    UnsupportedLedgerError,
)
from dpledger.ledger.commands import load_for_command, run_rows, sum_query_summary
from dpledger.ledger.ledger import PrivacyLedger
from dpledger.ledger.steps import CompressedLedger
from dpledger.report.audit_file import MAX_AUDIT_BYTES, load_audit
from dpledger.report.contents import (
    AccountantRow,
    AuditClaim,
    PrivacyReport,
    TradeoffView,
    Verification,
)
from dpledger.report.findings import run_findings
from dpledger.report.tradeoff_view import TRADEOFF_ACCOUNTANTS, tradeoff_view
from dpledger.validation import check_delta, check_positive_int

__all__ = [
    "DEFAULT_CURVE_POINTS",
    "KIND_LABELS",
    "MAX_AUDIT_BYTES",
    "TRADEOFF_ACCOUNTANTS",
    "AccountantRow",
    "AuditClaim",
    "PrivacyReport",
    "Progress",
    "TradeoffView",
    "Verification",
    "accountant_names",
    "altered_report",
    "build_report",
    "check_expect_head",
    "load_audit",
    "report_of_ledger",
    "verification_of",
]

logger = logging.getLogger(__name__)

_HASH = re.compile(r"[0-9a-f]{64}")

DEFAULT_CURVE_POINTS = 20
"""Step counts at which each accountant's ε-vs-steps curve is computed."""

KIND_LABELS = {
    ResultKind.UPPER_BOUND.value: "upper bound (a valid DP guarantee)",
    ResultKind.ESTIMATE.value: "estimate (no one-sided guarantee by itself)",
    ResultKind.APPROXIMATION.value: "approximation (no guarantee)",
}
"""What each kind of number is, in the words the report uses."""

Progress = Callable[[Iterable[Any], int, str], Iterable[Any]]
"""Wraps an iterable of ``total`` items for display (``desc`` names the work); the CLI passes
a tqdm bar, the library the identity."""


def _no_progress(items: Iterable[Any], total: int, desc: str) -> Iterable[Any]:
    return items


# ------------------------------------------------------------------------------ building
def build_report(
    path: str | os.PathLike[str],
    *,
    delta: float,
    accountants: Sequence[str] | None = None,
    expect_head: str | None = None,
    audit: dict[str, Any] | None = None,
    audit_source: str | None = None,
    curve_points: int = DEFAULT_CURVE_POINTS,
    progress: Progress | None = None,
) -> PrivacyReport:
    """Verify a ledger file and compute its privacy report.

    A file that fails verification (a line was altered) gets a report with its verification
    only: no number is computed from it. A file cut short or not closed is reported for the
    steps it holds, with that stated first in :attr:`Verification.warnings`. The file is read
    once (:func:`report_of_ledger` does the rest).

    Args:
        path: the ledger file.
        delta: δ in (0, 1) to state ε at.
        accountants: accountant names (default: every one; a scheme's own accountant only where
            the ledger has steps of that scheme).
        expect_head: the published hash of the last line, to compare with (64 lowercase hex).
        audit: an audit result from :func:`load_audit`, shown beside the claim.
        audit_source: where the audit result came from (its file).
        curve_points: step counts on each accountant's ε-vs-steps curve (≥ 1).
        progress: wraps the report's stages for a progress display.

    Raises:
        InvalidParameterError: a bad argument.
        MissingHeaderError, NotALedgerError, OSError: the file holds no ledger.
    """
    delta = check_delta("delta", delta)
    _check_options(expect_head, curve_points)
    spath = os.fspath(path)
    try:
        ledger, notes, _ = load_for_command(spath, keep_events=True)
    except LedgerVerificationError as exc:
        return altered_report(spath, exc, delta=delta, expect_head=expect_head)
    return report_of_ledger(
        spath,
        ledger,
        notes,
        delta=delta,
        accountants=accountants,
        expect_head=expect_head,
        audit=audit,
        audit_source=audit_source,
        curve_points=curve_points,
        progress=progress,
    )


def check_expect_head(expect_head: str | None) -> str | None:
    """``expect_head`` when it is None or a SHA-256 hash (64 lowercase hex digits).

    Raises:
        InvalidParameterError: any other value.
    """
    if expect_head is not None and not (
        isinstance(expect_head, str) and _HASH.fullmatch(expect_head)
    ):
        raise InvalidParameterError(
            "expect_head", expect_head, "a SHA-256 hash: 64 lowercase hexadecimal digits"
        )
    return expect_head


def _check_options(expect_head: str | None, curve_points: int) -> None:
    check_expect_head(expect_head)
    check_positive_int("curve_points", curve_points)


def altered_report(
    path: str, exc: LedgerVerificationError, *, delta: float, expect_head: str | None
) -> PrivacyReport:
    """The report of a file that fails verification at ``exc``'s line: its verification only."""
    verification = Verification(
        path=path,
        intact=False,
        altered=True,
        first_bad_line=exc.line_number,
        reason=exc.reason,
        closed=None,  # not checked: verification stopped at the altered line
        head_hash=None,
        expected_head=expect_head,
        head_matches=None if expect_head is None else False,
        num_events=0,
        num_steps=0,
        warnings=(
            f"VERIFICATION FAILED: line {exc.line_number}: {exc.reason}. The file was "
            "altered after it was written; no privacy number is reported for it.",
        ),
    )
    return PrivacyReport(delta=delta, verification=verification)


def report_of_ledger(
    path: str,
    ledger: PrivacyLedger,
    notes: Sequence[str],
    *,
    delta: float,
    accountants: Sequence[str] | None = None,
    expect_head: str | None = None,
    audit: dict[str, Any] | None = None,
    audit_source: str | None = None,
    curve_points: int = DEFAULT_CURVE_POINTS,
    progress: Progress | None = None,
) -> PrivacyReport:
    """The privacy report of a ledger already loaded (and verified) from ``path`` with its
    events (``keep_events=True``); ``notes`` are the warnings its loading gave. The arguments
    are those of :func:`build_report`.

    The work is done in stages shown through ``progress``: the sum-query summary, each
    accountant's ε at δ, then its ε-vs-steps curve, then the trade-off view. An accountant
    whose curve cannot be computed (a ledger with a correlated-noise release, a curve over the
    accountant's work budget) keeps its ε: :attr:`AccountantRow.curve_unavailable` says why.
    """
    delta = check_delta("delta", delta)
    _check_options(expect_head, curve_points)
    names = list(ACCOUNTANT_MODULES) if accountants is None else list(dict.fromkeys(accountants))
    verification = verification_of(path, ledger, notes, expect_head=expect_head)
    comp = ledger.compressed()
    if accountants is None:
        names = [
            n
            for n in names
            if n not in SCHEME_SPECIFIC_ACCOUNTANTS
            or SCHEME_SPECIFIC_ACCOUNTANTS[n] in comp.schemes
        ]
    rows: dict[str, AccountantRow] = {}
    found: dict[str, Any] = {}

    def summarise() -> None:
        found["sum_queries"] = tuple(sum_query_summary(ledger))

    def answer(name: str) -> None:
        rows[name] = _account(name, comp, delta)

    def curve(name: str) -> None:
        rows[name] = _with_curve(rows[name], name, comp, delta, curve_points)

    def view() -> None:
        found["tradeoff"] = tradeoff_view(comp, delta, tuple(rows.values()))

    stages = [_Stage("the sum queries", summarise)]
    for name in names:
        stages.append(_Stage(f"{name}: ε at δ = {delta:g}", functools.partial(answer, name)))
        stages.append(
            _Stage(
                f"{name}: ε against steps ({curve_points} points)", functools.partial(curve, name)
            )
        )
    stages.append(_Stage("the trade-off view", view))
    with warnings.catch_warnings():  # δ ≥ 1/n is stated once, in the report's findings
        warnings.simplefilter("ignore", DeltaTooLargeWarning)
        for stage in (progress or _no_progress)(stages, len(stages), "report"):
            stage.run()
        found.update(run_findings(ledger, comp, delta))
    result = PrivacyReport(
        delta=delta,
        verification=verification,
        header=_header(ledger),
        samplers=tuple(_samplers(comp)),
        sum_queries=found["sum_queries"],
        correlated_releases=tuple(_correlated_releases(ledger)),
        runs=tuple(_runs(ledger)),
        accountants=tuple(rows[n] for n in names),
        tradeoff=found["tradeoff"],
        **{key: found[key] for key in _FINDINGS},
    )
    if audit is not None:
        best = result.smallest_upper_bound
        claimed = None if best is None else best.epsilon
        claim = AuditClaim(
            source=audit_source or "",
            lower_bound=float(audit["lower_bound"]),
            delta=audit.get("delta"),
            confidence=audit.get("confidence"),
            method=audit.get("method"),
            claimed_epsilon=claimed,
            refutes_claim=None if claimed is None else float(audit["lower_bound"]) > claimed,
        )
        result = PrivacyReport(**{**result.__dict__, "audit": claim})
    return result


_FINDINGS = (
    "population_sizes",
    "intent",
    "intent_text",
    "generated",
    "findings",
    "sampling_notes",
    "shuffle_gap",
    "noise_provenance",
)


@dataclass(frozen=True)
class _Stage:
    """One stage of the report's work: its description (what a progress display shows) and
    the function that does it."""

    label: str
    run: Callable[[], None]

    def __str__(self) -> str:
        return self.label


def verification_of(
    path: str, ledger: PrivacyLedger, notes: Sequence[str], *, expect_head: str | None
) -> Verification:
    """What the loading of ``ledger`` from ``path`` found (``notes``: its warnings), with the
    warnings a reader must see before any number, in the order they are shown."""
    head_matches = None if expect_head is None else ledger.head_hash == expect_head
    torn = ledger.torn_tail
    closed = bool(ledger.closed_cleanly)
    shown: list[str] = []
    if torn is not None:
        shown.append(
            f"TRUNCATED: {torn.describe().replace('; it was ignored', '')}. Every number below "
            f"is that of the valid prefix ({ledger.num_steps} steps), not of the whole run."
        )
    shown.extend(n for n in notes if torn is None or "incomplete" not in n)
    if not closed:
        shown.append(
            "NOT CLOSED: the ledger does not end with a close marker (its writer crashed or is "
            "still running, or its final lines were deleted): ε is that of the steps it holds; "
            "compare the head hash with the published one."
        )
    if head_matches is False:
        shown.append(
            f"HEAD MISMATCH: the last line's hash {ledger.head_hash} differs from the expected "
            f"{expect_head} (lines were removed from or added to the end, or it is another "
            "ledger)."
        )
    return Verification(
        path=path,
        intact=torn is None,
        altered=False,
        first_bad_line=None if torn is None else torn.line_number,
        reason=None if torn is None else torn.describe(),
        closed=closed,
        head_hash=ledger.head_hash,
        expected_head=expect_head,
        head_matches=head_matches,
        num_events=ledger.num_events,
        num_steps=ledger.num_steps,
        warnings=tuple(shown),
    )


def _header(ledger: PrivacyLedger) -> dict[str, Any]:
    header = ledger.header
    return {
        "neighboring": header.neighboring.value,
        "metadata": header.metadata,
        "created": header.created,
        "library_version": header.library_version,
        "format_version": header.format_version,
    }


def _samplers(comp: CompressedLedger) -> list[dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for run in comp.runs:
        name = (
            run.sampling.describe()
            if run.sampling is not None
            else ("full_batch" if run.scheme.value == "full" else "poisson")
        )
        entry = out.setdefault(
            name,
            {
                "sampling": name,
                "scheme": run.scheme.value,
                "unit": run.unit.value,
                "sampling_probabilities": [],
                "steps": 0,
            },
        )
        if run.sampling_probability not in entry["sampling_probabilities"]:
            entry["sampling_probabilities"].append(run.sampling_probability)
        entry["steps"] += run.count
    return list(out.values())


def _correlated_releases(ledger: PrivacyLedger) -> list[dict[str, Any]]:
    """One entry per correlated-noise release, in order, with its stream's progress."""
    return [
        {
            "release": i,
            "strategy": c.strategy,
            "num_steps": c.num_steps,
            "participation": c.participation,
            "max_participations": c.max_participations,
            "min_separation": c.min_separation,
            "sampling": c.sampling,
            "sampling_probability": c.sampling_probability,
            "l2_norm_bound": c.l2_norm_bound,
            "noise_stddev": c.noise_stddev,
            "sensitivity": c.sensitivity,
            "sensitivity_exact": c.sensitivity_exact,
            "label": c.label,
            "steps_taken": ledger.stream_progress(i),
        }
        for i, c in enumerate(ledger.correlated_releases)
    ]


def _runs(ledger: PrivacyLedger) -> list[dict[str, Any]]:
    """The runs table's rows: ``dpledger info``'s (epochs of one shape in one row)."""
    return run_rows(ledger.compressed())


def _curve_steps(total: int, points: int) -> list[int]:
    return sorted({max(1, round(total * (i + 1) / points)) for i in range(points)})


def _account(name: str, comp: CompressedLedger, delta: float) -> AccountantRow:
    """The accountant's ε at δ, or why it refused the ledger."""
    try:
        acc = make_accountant(name)
    except ImportError as exc:
        return AccountantRow(name, None, None, None, refused=f"not installed ({exc})")
    try:
        result: PrivacyResult = acc.epsilon(comp, delta=delta)
    except UnsupportedLedgerError as exc:
        return AccountantRow(name, None, None, None, refused=str(exc))
    except DPLedgerError as exc:  # beyond its budget, or outside what its arithmetic handles
        return AccountantRow(name, None, None, None, refused=f"could not compute: {exc}")
    logger.debug("%s: ε = %r (%s)", name, result.epsilon, result.kind.value)
    return AccountantRow(
        accountant=name,
        epsilon=result.epsilon,
        kind=result.kind.value,
        kind_label=KIND_LABELS[result.kind.value],
        lower=result.lower,
        upper=result.upper,
        upper_confidence=result.upper_confidence,
        confidence=result.confidence,
        seconds=result.seconds,
        warnings=tuple(result.warnings),
    )


def _with_curve(
    row: AccountantRow, name: str, comp: CompressedLedger, delta: float, points: int
) -> AccountantRow:
    """``row`` with the accountant's ε-vs-steps curve, or with why there is none. A curve that
    cannot be computed never turns an ε into a refusal: the ε stands, the curve is missing."""
    if row.refused is not None:
        return row
    if comp.correlated:
        why = (
            f"the ledger holds {len(comp.correlated)} correlated-noise release(s), each one "
            "mechanism over its whole stream, so ε after a number of steps is not defined for it"
        )
        return replace(row, curve_unavailable=why)
    if not comp.num_steps:
        return row
    steps = _curve_steps(comp.num_steps, points)
    try:
        results = make_accountant(name).epsilon_curve(comp, delta=delta, steps=steps)
    except ComputationBudgetError as exc:
        why = f"{exc}; or ask for fewer points on the curve (--curve, now {points})"
        return replace(row, curve_unavailable=why)
    except DPLedgerError as exc:
        return replace(row, curve_unavailable=str(exc))
    return replace(row, curve=tuple((r.num_steps, r.epsilon) for r in results))
