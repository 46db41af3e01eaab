"""The privacy report as data: what :func:`dpledger.report.build.build_report` gathers and the
renderers format.

:class:`PrivacyReport` holds the file's :class:`Verification`, one :class:`AccountantRow` per
accountant, the :class:`TradeoffView` and an :class:`AuditClaim`; :meth:`PrivacyReport.to_dict`
is its JSON twin. Nothing here reads a file or runs an accountant.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from dpledger.accountants.base import ResultKind

__all__ = ["AccountantRow", "AuditClaim", "PrivacyReport", "TradeoffView", "Verification"]


@dataclass(frozen=True)
class Verification:
    """What the file's verification found.

    Attributes:
        path: the ledger file.
        intact: every line verifies and none is cut short.
        altered: a line fails verification (the file was changed); no number is reported.
        first_bad_line: the first line that fails or is cut short, or None.
        reason: why that line fails, or None.
        closed: the verified lines end with a close marker; None when it was not checked
            (the file was altered: verification stopped at :attr:`first_bad_line`).
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
    closed: bool | None
    head_hash: str | None
    expected_head: str | None
    head_matches: bool | None
    num_events: int
    num_steps: int
    warnings: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """Intact, closed, and the head as expected (when given)."""
        return self.intact and self.closed is True and self.head_matches is not False


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
        upper_confidence: a Monte-Carlo upper bound on ε that holds with probability
            ``confidence`` over the method's random draws (``balls_in_bins``): NOT certified,
            so never shown as ``upper`` nor as the claim.
        confidence: the probability ``upper_confidence`` holds with (None without one).
        seconds: time the computation took.
        warnings: the accountant's warnings.
        refused: why the accountant refused the ledger (None when it answered).
        curve: (steps, ε) pairs of the ε-vs-steps curve.
        curve_unavailable: why the accountant has no ε-vs-steps curve although it answered (a
            ledger with a correlated-noise release, a curve beyond its work budget), or None.
    """

    accountant: str
    epsilon: float | None
    kind: str | None
    kind_label: str | None
    lower: float | None = None
    upper: float | None = None
    upper_confidence: float | None = None
    confidence: float | None = None
    seconds: float | None = None
    warnings: tuple[str, ...] = ()
    refused: str | None = None
    curve: tuple[tuple[int, float], ...] = ()
    curve_unavailable: str | None = None


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
        correlated_releases: one entry per correlated-noise release (kind, T, participation
            schema, S, σ, sensitivity per unit clip), with ``steps_taken``, its stream's steps
            recorded so far.
        runs: the runs of identical steps (q, z_eff, count, scheme).
        accountants: the accountants' answers and refusals, in the order asked for.
        tradeoff: the hypothesis-testing view.
        audit: an audit's lower bound, or None.
        population_sizes: the distinct population sizes n the sampling events record (None
            for one not recorded).
        intent: the run's intent from the header's metadata, or None when not recorded.
        intent_text: the intent on one line, or ``"not recorded"``.
        generated: when the report was generated (UTC, ISO 8601).
        findings: what ``dpledger epsilon`` warns about besides the file's verification, one
            sentence each, shown before any number: δ ≥ 1/n, a shuffle gap that proves the
            Poisson ε wrong (:mod:`dpledger.report.findings`).
        sampling_notes: what the ledger's sampling means for its ε (``epsilon``'s
            ``sampling:`` lines; empty for a Poisson ledger).
        shuffle_gap: the shuffle gap's numbers (relation, Poisson ε, lower bound, whether it
            refutes the Poisson ε) for a shuffled ledger, else None.
        noise_provenance: where the noise came from, one line per distinct record of the
            ledger (:func:`~dpledger.ledger.provenance.provenance_text`; "not recorded ..." for
            a ledger without one).
    """

    delta: float
    verification: Verification
    header: dict[str, Any] = field(default_factory=dict)
    samplers: tuple[dict[str, Any], ...] = ()
    sum_queries: tuple[dict[str, Any], ...] = ()
    correlated_releases: tuple[dict[str, Any], ...] = ()
    runs: tuple[dict[str, Any], ...] = ()
    accountants: tuple[AccountantRow, ...] = ()
    tradeoff: TradeoffView | None = None
    audit: AuditClaim | None = None
    population_sizes: tuple[int | None, ...] = ()
    intent: dict[str, Any] | None = None
    intent_text: str = "not recorded"
    generated: str | None = None
    findings: tuple[str, ...] = ()
    sampling_notes: tuple[str, ...] = ()
    shuffle_gap: dict[str, Any] | None = None
    noise_provenance: tuple[str, ...] = ("not recorded",)

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
