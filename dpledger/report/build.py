"""The privacy report of a ledger file, as pure data.

:func:`build_report` verifies a ledger file, replays it with the accountants and collects what a
privacy reviewer needs to sign off a run into a :class:`PrivacyReport`; the renderers
(:mod:`dpledger.report.html`, :mod:`dpledger.report.markdown`) and :meth:`PrivacyReport.to_dict`
(the JSON twin) only format it. The report states, in this order:

1. verification: whether the hash chain holds, whether the file is cut short or unclosed
   (stated first, as a warning, before any number), the head hash and the ``--expect-head``
   comparison;
2. the run: the header's relation, metadata, creation time and writer;
3. the samplers and the sum queries (S and σ̃ per query label, with their z = σ̃ / S), and the
   runs of identical steps (q, z_eff, count);
4. ε at δ by every accountant that supports the ledger, with what kind of number it is and its
   certified interval where it has one; the accountants that refused, and why;
5. ε against steps for each accountant;
6. the hypothesis-testing view: the best attacker's TPR against FPR, computed from an
   upper bound on δ(ε) (PLD, else PRV; :mod:`dpledger.report.tradeoff`);
7. an audit's lower bound beside the claim, when one is given.
"""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from dpledger.accountants.base import (
    ACCOUNTANT_MODULES,
    SCHEME_SPECIFIC_ACCOUNTANTS,
    PrivacyResult,
    ResultKind,
    make_accountant,
)
from dpledger.errors import (
    DPLedgerError,
    InvalidParameterError,
    LedgerVerificationError,
    UnsupportedLedgerError,
)
from dpledger.ledger.commands import load_for_command
from dpledger.ledger.events import SumQueryEvent
from dpledger.ledger.ledger import LedgerWarning, PrivacyLedger
from dpledger.ledger.steps import CompressedLedger
from dpledger.ledger.verify import verify_ledger
from dpledger.report import tradeoff
from dpledger.validation import check_delta

__all__ = [
    "DEFAULT_CURVE_POINTS",
    "KIND_LABELS",
    "TRADEOFF_ACCOUNTANTS",
    "AccountantRow",
    "AuditClaim",
    "PrivacyReport",
    "Progress",
    "TradeoffView",
    "Verification",
    "accountant_names",
    "build_report",
    "load_audit",
]

logger = logging.getLogger(__name__)

DEFAULT_CURVE_POINTS = 20
"""Step counts at which each accountant's ε-vs-steps curve is computed."""

TRADEOFF_ACCOUNTANTS = ("pld", "prv")
"""Accountants whose δ(ε) the trade-off curve is computed from, in order of preference: the PLD
accountant's pessimistic privacy-loss distribution, else the PRV accountant's certified upper
bound on δ; each is an upper bound on the privacy profile at every ε (so the TPR derived from
it is an upper bound on any attacker's)."""

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


@dataclass(frozen=True)
class Verification:
    """What the file's verification found.

    Attributes:
        path: the ledger file.
        intact: every line verifies and none is cut short.
        altered: a line fails verification (the file was changed); no number is reported.
        first_bad_line: the first line that fails or is cut short, or None.
        reason: why that line fails, or None.
        closed: the verified lines end with a close marker.
        head_hash: hash of the last verified line (None when the file was altered).
        expected_head: the ``--expect-head`` value, or None.
        head_matches: whether the head equals ``expected_head`` (None when none was given).
        num_events: events in the verified prefix.
        num_steps: steps in the verified prefix.
        warnings: what the reader must know before any number (cut short, not closed, head
            mismatch), one sentence each, in the order they are shown.
    """

    path: str
    intact: bool
    altered: bool
    first_bad_line: int | None
    reason: str | None
    closed: bool
    head_hash: str | None
    expected_head: str | None
    head_matches: bool | None
    num_events: int
    num_steps: int
    warnings: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """Intact, closed, and the head as expected (when given)."""
        return self.intact and self.closed and self.head_matches is not False


@dataclass(frozen=True)
class AccountantRow:
    """One accountant's answer at the report's δ, or its refusal.

    Attributes:
        accountant: the accountant's name.
        epsilon: ε at δ (None when it refused).
        kind: ``upper_bound``, ``estimate`` or ``approximation`` (None when it refused).
        kind_label: the kind in words.
        lower: a certified lower bound on ε, when the method has one.
        upper: a certified upper bound on ε, when the method has one.
        seconds: time the computation took.
        warnings: the accountant's warnings.
        refused: why the accountant refused the ledger (None when it answered).
        curve: (steps, ε) pairs of the ε-vs-steps curve.
    """

    accountant: str
    epsilon: float | None
    kind: str | None
    kind_label: str | None
    lower: float | None = None
    upper: float | None = None
    seconds: float | None = None
    warnings: tuple[str, ...] = ()
    refused: str | None = None
    curve: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TradeoffView:
    """The hypothesis-testing view of the run.

    Attributes:
        accountant: the accountant whose δ(ε) it is computed from (None when none could).
        basis: how it was computed, in one sentence.
        tpr_at_fpr: the best attacker's TPR at each reported FPR (an upper bound).
        curve: (FPR, TPR) points of the trade-off curve, for the plot.
        unavailable: why it could not be computed (None when it was).
    """

    accountant: str | None
    basis: str
    tpr_at_fpr: tuple[tuple[float, float], ...] = ()
    curve: tuple[tuple[float, float], ...] = ()
    unavailable: str | None = None


@dataclass(frozen=True)
class AuditClaim:
    """An audit's ε lower bound, shown beside the accountants' claims.

    Attributes:
        source: the audit file.
        lower_bound: the audited ε lower bound.
        delta: δ of the audit's bound, when given.
        confidence: the confidence of the lower bound, when given.
        method: how it was computed, when given.
        claimed_epsilon: the smallest upper bound the report claims (None when none).
        refutes_claim: True when the audited lower bound exceeds that upper bound.
    """

    source: str
    lower_bound: float
    delta: float | None
    confidence: float | None
    method: str | None
    claimed_epsilon: float | None
    refutes_claim: bool | None


@dataclass(frozen=True)
class PrivacyReport:
    """Everything the report shows; see the module docstring for the order.

    Attributes:
        delta: δ the ε values are stated at.
        verification: the file's verification.
        header: the run's header (relation, metadata, created, writer, format version).
        samplers: one entry per kind of sampling, with its steps.
        sum_queries: one entry per (label, S, σ̃), with its count and z = σ̃ / S.
        runs: the runs of identical steps (q, z_eff, count, scheme).
        accountants: the accountants' answers and refusals, in the order asked for.
        tradeoff: the hypothesis-testing view.
        audit: an audit's lower bound, or None.
    """

    delta: float
    verification: Verification
    header: dict[str, Any] = field(default_factory=dict)
    samplers: tuple[dict[str, Any], ...] = ()
    sum_queries: tuple[dict[str, Any], ...] = ()
    runs: tuple[dict[str, Any], ...] = ()
    accountants: tuple[AccountantRow, ...] = ()
    tradeoff: TradeoffView | None = None
    audit: AuditClaim | None = None

    @property
    def answered(self) -> tuple[AccountantRow, ...]:
        """The accountants that answered."""
        return tuple(r for r in self.accountants if r.refused is None)

    @property
    def smallest_upper_bound(self) -> AccountantRow | None:
        """The answered row with the smallest ε labelled an upper bound (the claim to sign)."""
        bounds = [r for r in self.answered if r.kind == ResultKind.UPPER_BOUND.value]
        return min(bounds, key=lambda r: r.epsilon or 0.0) if bounds else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready values with stable keys (∞ as the string ``"inf"``)."""
        out = asdict(self)
        out["format"] = "dpledger-privacy-report"
        out["format_version"] = 1
        out["verification"]["ok"] = self.verification.ok
        best = self.smallest_upper_bound
        out["claim"] = (
            None
            if best is None
            else {"accountant": best.accountant, "epsilon": best.epsilon, "delta": self.delta}
        )
        return _json_ready(out)


def _json_ready(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "inf" if x > 0 else ("-inf" if x < 0 else "nan")
    if isinstance(x, dict):
        return {str(k): _json_ready(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_ready(v) for v in x]
    return x


# ------------------------------------------------------------------------------ inputs
def accountant_names(spec: str) -> list[str]:
    """The accountants a comma-separated ``--accountant`` value names (``all``: every one).

    Raises:
        InvalidParameterError: an unknown name, or none.
    """
    names = [n.strip() for n in str(spec).split(",") if n.strip()]
    if names == ["all"]:
        return list(ACCOUNTANT_MODULES)
    if not names:
        raise InvalidParameterError("accountant", spec, "accountant names or 'all'")
    for n in names:
        if n not in ACCOUNTANT_MODULES:
            valid = ", ".join(ACCOUNTANT_MODULES)
            raise InvalidParameterError("accountant", n, f"one of {valid}, or 'all'")
    return names


def load_audit(path: str) -> dict[str, Any]:
    """Read an audit result: a JSON object with ``lower_bound`` (or ``epsilon_lower_bound``), a
    number ≥ 0, and optionally ``delta``, ``confidence`` and ``method``.

    Raises:
        InvalidParameterError: the file is not such a JSON object (named as ``audit``).
        OSError: the file cannot be read.
    """
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    expected = 'a JSON file with an ε lower bound: {"lower_bound": number >= 0, ...}'
    try:
        data = json.loads(text)
    except ValueError:
        raise InvalidParameterError("audit", path, expected) from None
    if not isinstance(data, dict):
        raise InvalidParameterError("audit", path, expected)
    bound = data.get("lower_bound", data.get("epsilon_lower_bound"))
    if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not bound >= 0:
        raise InvalidParameterError("audit", path, expected)
    out: dict[str, Any] = {"lower_bound": float(bound)}
    for key in ("delta", "confidence"):
        value = data.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1
        ):
            raise InvalidParameterError("audit", path, f"{key} in [0, 1] when given")
        out[key] = None if value is None else float(value)
    method = data.get("method")
    out["method"] = None if method is None else str(method)
    return out


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
    steps it holds, with that stated first in :attr:`Verification.warnings`.

    Args:
        path: the ledger file.
        delta: δ in (0, 1) to state ε at.
        accountants: accountant names (default: every one; a scheme's own accountant only where
            the ledger has steps of that scheme).
        expect_head: the published hash of the last line, to compare with (64 lowercase hex).
        audit: an audit result from :func:`load_audit`, shown beside the claim.
        audit_source: where the audit result came from (its file).
        curve_points: step counts on each accountant's ε-vs-steps curve (≥ 1).
        progress: wraps the accountants' work for a progress display.

    Raises:
        InvalidParameterError: a bad argument.
        MissingHeaderError, NotALedgerError, OSError: the file holds no ledger.
    """
    delta = check_delta("delta", delta)
    if isinstance(curve_points, bool) or not isinstance(curve_points, int) or curve_points < 1:
        raise InvalidParameterError("curve_points", curve_points, "an integer >= 1")
    names = list(ACCOUNTANT_MODULES) if accountants is None else list(accountants)
    every = accountants is None
    progress = progress or _no_progress
    spath = os.fspath(path)
    report = verify_ledger(spath, expect_head=expect_head)  # checks expect_head's form
    head_matches = None if expect_head is None else report.head_hash == expect_head
    try:
        ledger, notes, _ = load_for_command(spath)
    except LedgerVerificationError as exc:
        verification = Verification(
            path=spath,
            intact=False,
            altered=True,
            first_bad_line=exc.line_number,
            reason=exc.reason,
            closed=False,
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
    verification = _verification(spath, ledger, notes, report, expect_head, head_matches)
    full = _load_events(spath)
    comp = ledger.compressed()
    if every:
        names = [
            n
            for n in names
            if n not in SCHEME_SPECIFIC_ACCOUNTANTS
            or SCHEME_SPECIFIC_ACCOUNTANTS[n] in comp.schemes
        ]
    accounted: list[AccountantRow] = []
    view: TradeoffView | None = None
    tasks: list[str | None] = [*names, None]  # None: the trade-off, after the accountants
    for task in progress(tasks, len(tasks), "accountants and trade-off"):
        if task is None:
            view = _tradeoff(comp, delta, accounted)
        else:
            accounted.append(_account(task, comp, delta, curve_points))
    rows = tuple(accounted)
    result = PrivacyReport(
        delta=delta,
        verification=verification,
        header=_header(ledger),
        samplers=tuple(_samplers(comp)),
        sum_queries=tuple(_sum_queries(full)),
        runs=tuple(_runs(ledger)),
        accountants=rows,
        tradeoff=view,
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


def _verification(
    path: str,
    ledger: PrivacyLedger,
    notes: list[str],
    report: Any,
    expect_head: str | None,
    head_matches: bool | None,
) -> Verification:
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


def _load_events(path: str) -> PrivacyLedger:
    """The ledger with its events (for the sum queries), warnings already reported."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LedgerWarning)
        return PrivacyLedger.load(path, keep_events=True)


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


def _sum_queries(ledger: PrivacyLedger) -> list[dict[str, Any]]:
    counts: dict[tuple[str | None, float, float], int] = {}
    for event in ledger.events():
        if isinstance(event, SumQueryEvent):
            key = (event.label, event.l2_norm_bound, event.noise_stddev)
            counts[key] = counts.get(key, 0) + 1
    return [
        {
            "label": label,
            "l2_norm_bound": s,
            "noise_stddev": sigma,
            "noise_multiplier": sigma / s,
            "count": count,
        }
        for (label, s, sigma), count in counts.items()
    ]


def _runs(ledger: PrivacyLedger) -> list[dict[str, Any]]:
    out = []
    start = 0
    for run in ledger.runs():
        out.append(
            {
                "first_step": start + 1,
                "last_step": start + run.count,
                "count": run.count,
                "sampling_probability": run.sampling_probability,
                "noise_multiplier": run.noise_multiplier,
                "scheme": run.scheme.value,
                "sampling": None if run.sampling is None else run.sampling.describe(),
            }
        )
        start += run.count
    return out


def _curve_steps(total: int, points: int) -> list[int]:
    return sorted({max(1, round(total * (i + 1) / points)) for i in range(points)})


def _account(name: str, comp: CompressedLedger, delta: float, points: int) -> AccountantRow:
    try:
        acc = make_accountant(name)
    except ImportError as exc:
        return AccountantRow(name, None, None, None, refused=f"not installed ({exc})")
    try:
        result: PrivacyResult = acc.epsilon(comp, delta=delta)
        curve: tuple[tuple[int, float], ...] = ()
        if comp.num_steps:
            steps = _curve_steps(comp.num_steps, points)
            curve = tuple(
                (r.num_steps, r.epsilon) for r in acc.epsilon_curve(comp, delta=delta, steps=steps)
            )
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
        seconds=result.seconds,
        warnings=tuple(result.warnings),
        curve=curve,
    )


_TRADEOFF_FPRS = tuple(np.concatenate([np.geomspace(1e-5, 1e-2, 25), np.linspace(0.011, 1, 60)]))


def _tradeoff(comp: CompressedLedger, delta: float, rows: Sequence[AccountantRow]) -> TradeoffView:
    """The trade-off curve from an upper bound on δ(ε): the PLD accountant's pessimistic
    privacy-loss distribution, or, where the PLD accountant refuses the ledger, the PRV
    accountant's certified upper bound on δ at each ε."""
    if any(not run.is_private for run in comp.runs):
        return TradeoffView(
            None,
            "",
            unavailable="a step has a sum query with σ̃ = 0: the run is not differentially "
            "private (ε = ∞), and an attacker may reach TPR = 1 at any FPR",
        )
    if not any(not run.releases_nothing for run in comp.runs):
        return TradeoffView(
            "pld",
            "no step releases anything: every test has TPR = FPR",
            tpr_at_fpr=tuple((a, a) for a in tradeoff.REPORTED_FPRS),
            curve=tuple((a, a) for a in _TRADEOFF_FPRS),
        )
    found = _pld_profile(comp)
    if isinstance(found, str):
        fallback = _prv_profile(comp)
        if isinstance(fallback, str):
            return TradeoffView(None, "", unavailable=f"{found}; {fallback}")
        found = fallback
    name, delta_of, points, how = found
    known = {r.accountant: r.epsilon for r in rows if r.epsilon is not None}
    top = known.get(name)
    if top is None or not math.isfinite(top):
        top = _epsilon_where(delta_of, 1e-12)
    grid = tradeoff.epsilon_grid(max(4.0 * top, 1.0), points=points)
    try:
        reported = tradeoff.true_positive_rate(delta_of, tradeoff.REPORTED_FPRS, grid)
        curve = tradeoff.true_positive_rate(delta_of, _TRADEOFF_FPRS, grid, refine=False)
    except DPLedgerError as exc:
        return TradeoffView(
            None, "", unavailable=f"the {name} accountant could not compute it: {exc}"
        )
    return TradeoffView(
        accountant=name,
        basis=(
            f"from {how}, an upper bound on the privacy profile at every ε, maximised over "
            f"{len(grid)} values of ε in [0, {grid[-1]:.4g}]: the TPR shown is an upper bound "
            "on any membership attacker's"
        ),
        tpr_at_fpr=tuple(zip(tradeoff.REPORTED_FPRS, (float(x) for x in reported), strict=True)),
        curve=tuple(zip(_TRADEOFF_FPRS, (float(x) for x in curve), strict=True)),
    )


_Profile = tuple[str, Callable[[np.ndarray], np.ndarray], int, str]


def _pld_profile(comp: CompressedLedger) -> _Profile | str:
    """The PLD accountant's pessimistic δ(ε), or why there is none."""
    from dpledger.accountants.pld import PldAccountant

    acc = PldAccountant()
    try:
        acc.check_supported(comp)
        distribution = acc.distribution(comp)
    except UnsupportedLedgerError as exc:
        return f"the pld accountant refused the ledger: {exc}"
    except DPLedgerError as exc:
        return f"the pld accountant could not compute it: {exc}"

    def delta_of(eps: np.ndarray) -> np.ndarray:
        eps = np.asarray(eps, dtype=float)
        if eps.size == 1:  # dp-accounting answers one ε much faster than a one-element array
            return np.array([float(distribution.get_delta_for_epsilon(float(eps.ravel()[0])))])
        return np.asarray(distribution.get_delta_for_epsilon(eps), dtype=float)

    return "pld", delta_of, 2001, "the pld accountant's pessimistic δ(ε)"


def _prv_profile(comp: CompressedLedger) -> _Profile | str:
    """The PRV accountant's certified upper bound on δ at each ε, or why there is none."""
    acc = make_accountant("prv")
    try:
        acc.check_supported(comp)
    except UnsupportedLedgerError as exc:
        return f"the prv accountant refused the ledger: {exc}"
    cache: dict[float, float] = {}

    def one(e: float) -> float:
        if e not in cache:
            result = acc.delta(comp, epsilon=e)
            if result.kind is not ResultKind.UPPER_BOUND or result.upper is None:
                raise DPLedgerError(f"the prv accountant gave no upper bound on δ at ε = {e!r}")
            cache[e] = result.upper
        return cache[e]

    def delta_of(eps: np.ndarray) -> np.ndarray:
        return np.array([one(float(e)) for e in np.asarray(eps, dtype=float).ravel()])

    try:
        one(0.0)
    except DPLedgerError as exc:
        return f"the prv accountant could not compute it: {exc}"
    return "prv", delta_of, 201, "the prv accountant's certified upper bound on δ(ε)"


def _epsilon_where(delta_of: Callable[[np.ndarray], np.ndarray], target: float) -> float:
    """An ε with δ(ε) ≤ target, found by doubling (the grid's upper end when no accountant
    reported ε)."""
    e = 1.0
    while e < 1e4 and float(delta_of(np.array([e]))[0]) > target:
        e *= 2.0
    return e
