"""The report as a document: titled sections of paragraphs, warnings, tables and plots.

Both renderers (:mod:`dpledger.report.html`, :mod:`dpledger.report.markdown`) draw the same
:class:`Section` list, so the HTML and Markdown reports hold the same words and the same
numbers. Numbers are shown to six significant digits, an upper bound rounded up and a lower
bound rounded down, so that a bound stays one when printed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from dpledger.accountants.display import format_rounded
from dpledger.report.contents import PrivacyReport, Verification

__all__ = [
    "Section",
    "Table",
    "monte_carlo_label",
    "report_sections",
    "shown_epsilon",
    "title_of",
]


@dataclass(frozen=True)
class Table:
    """A table: column headers and rows of cell text."""

    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Section:
    """One section of the report.

    Attributes:
        key: a stable identifier (the HTML element id).
        title: the heading.
        alerts: warnings shown before anything else in the section, loudly.
        paragraphs: text, in order.
        tables: tables, after the paragraphs.
        plot: the name of the plot shown after the tables (``"epsilon_curve"`` or
            ``"tradeoff"``), or None.
        notes: text after the tables and plot.
    """

    key: str
    title: str
    alerts: tuple[str, ...] = ()
    paragraphs: tuple[str, ...] = ()
    tables: tuple[Table, ...] = ()
    plot: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)


def shown_epsilon(value: float | None, kind: str | None) -> str:
    """ε for display: rounded up when it is an upper bound, to nearest otherwise."""
    return format_rounded(value, "up" if kind == "upper_bound" else None)


def title_of(report: PrivacyReport) -> str:
    """The report's title."""
    return f"Privacy report: {report.verification.path}"


def report_sections(report: PrivacyReport) -> list[Section]:
    """The report's sections, in the order they are shown (verification first)."""
    v = report.verification
    sections = [_verification(report)]
    if v.altered:
        return sections
    sections.append(_summary(report))
    sections.append(
        Section(
            key="run",
            title="The run",
            tables=(
                Table(
                    ("field", "value"),
                    (
                        ("neighbouring relation", report.header.get("neighboring", "-")),
                        ("created", str(report.header.get("created", "-"))),
                        ("written by", f"dpledger {report.header.get('library_version', '-')}"),
                        ("file format version", str(report.header.get("format_version", "-"))),
                        ("metadata", json.dumps(report.header.get("metadata", {}), sort_keys=True)),
                        ("intent", report.intent_text),
                        ("noise source", "; ".join(report.noise_provenance)),
                        ("records (n)", _population(report)),
                        ("steps", str(v.num_steps)),
                        ("events", str(v.num_events)),
                        ("report generated", report.generated or "-"),
                    ),
                ),
            ),
        )
    )
    sections.append(_mechanism(report))
    sections.append(_accountants(report))
    sections.append(
        Section(
            key="epsilon-curve",
            title="ε against steps",
            paragraphs=(
                f"ε at δ = {report.delta:g} after each number of steps, by every accountant "
                "that answered. Approximations are dashed and carry no guarantee.",
            ),
            plot="epsilon_curve",
            notes=tuple(
                f"{r.accountant}: no curve: {r.curve_unavailable}"
                for r in report.answered
                if r.curve_unavailable is not None
            ),
        )
    )
    sections.append(_tradeoff(report))
    if report.audit is not None:
        sections.append(_audit(report))
    return sections


def _verification(report: PrivacyReport) -> Section:
    v = report.verification
    if v.altered:
        status = "FAILED: the hash chain does not verify"
    elif not v.intact:
        status = "valid prefix only: the file is cut short"
    else:
        status = "ok: every line verifies"
    if v.expected_head is None:
        head = "not checked (no --expect-head given)"
    else:
        head = "matches" if v.head_matches else "DOES NOT MATCH"
        head = f"{head} the expected {v.expected_head}"
    rows = (
        ("file", v.path),
        ("hash chain", status),
        ("first bad line", "-" if v.first_bad_line is None else str(v.first_bad_line)),
        ("closed", _closed(v)),
        ("head hash", v.head_hash or "-"),
        ("expected head", head),
    )
    verdict = (
        "The file verifies, is closed, and every number below is that of the whole run."
        if v.ok
        else "Read the warnings above before any number below."
    )
    return Section(
        key="verification",
        title="Verification",
        alerts=v.warnings,
        tables=(Table(("check", "result"), rows),),
        paragraphs=() if v.altered else (verdict,),
    )


def _closed(v: Verification) -> str:
    """Whether the file ends with a close marker, or that it was not checked (verification
    stopped at an altered line, so nothing after it, the close marker included, is known)."""
    if v.closed is None:
        line = "" if v.first_bad_line is None else f" at line {v.first_bad_line}"
        return f"not checked (verification stopped{line})"
    return "yes" if v.closed else "NO (no close marker)"


def _summary(report: PrivacyReport) -> Section:
    best = report.smallest_upper_bound
    if best is None:
        text = (
            f"No accountant gave an upper bound on ε at δ = {report.delta:g} for this ledger: "
            "there is no ε to sign off."
        )
    elif best.epsilon is not None and math.isinf(best.epsilon):
        text = (
            f"The run is NOT differentially private: ε = inf at δ = {report.delta:g} (a step "
            "has a sum query with σ̃ = 0); there is no finite ε to sign off."
        )
    else:
        text = (
            f"Claim: the run is (ε = {shown_epsilon(best.epsilon, best.kind)}, "
            f"δ = {report.delta:g})-differentially private under the "
            f"{report.header.get('neighboring', '?')} relation, an upper bound by the "
            f"{best.accountant} accountant (the smallest upper bound of the accountants below)."
        )
    paragraphs = [text]
    gap = report.shuffle_gap
    if gap is not None and gap["refutes_poisson"]:
        paragraphs.append(
            f"The Poisson ε ({format_rounded(gap['poisson_epsilon'], 'up', digits=4)} under "
            f"{gap['relation'].replace('_', '-')}) is not valid for this run: its batches were "
            f"shuffled, and this run's ε is at least "
            f"{format_rounded(gap['lower_bound'], 'down', digits=4)} (Chua et al. lower bound)."
        )
    view = report.tradeoff
    if view is not None and view.tpr_at_fpr:
        shown = [(a, format_rounded(t, "up", digits=4)) for a, t in view.tpr_at_fpr]
        rates = "; ".join(f"at FPR {a:g}, TPR ≤ {t}" for a, t in shown)
        line = f"Best membership attacker ({view.accountant}, upper bound): {rates}."
        if any(float(t) >= 1.0 for _, t in shown):
            line += (
                " A bound of TPR ≤ 1 rules out no attacker: as far as this accounting can "
                "say, the record may be identified with certainty"
            )
            line += (
                " (no amplification by this ledger's sampling is certified)."
                if report.sampling_notes
                else "."
            )
        paragraphs.append(line)
    if not report.verification.ok:
        paragraphs.insert(0, "This claim is about the steps the file holds: see Verification.")
    return Section(
        key="summary", title="Summary", alerts=report.findings, paragraphs=tuple(paragraphs)
    )


def _population(report: PrivacyReport) -> str:
    """The population sizes n the sampling events record, or "not recorded"."""
    sizes = [("not recorded" if n is None else str(n)) for n in report.population_sizes]
    return ", ".join(sizes) or "not recorded"


def _mechanism(report: PrivacyReport) -> Section:
    samplers = Table(
        ("sampling", "scheme", "unit", "q", "steps"),
        tuple(
            (
                s["sampling"],
                s["scheme"],
                s["unit"],
                ", ".join(f"{q:.6g}" for q in s["sampling_probabilities"]),
                str(s["steps"]),
            )
            for s in report.samplers
        ),
    )
    queries = Table(
        ("query label", "C (L2 clipping bound)", "σ̃ (noise std of the sum)", "z = σ̃ / C", "count"),
        tuple(
            (
                "(no label)" if q["label"] is None else str(q["label"]),
                f"{q['l2_norm_bound']:.6g}",
                f"{q['noise_stddev']:.6g}",
                f"{q['noise_multiplier']:.6g}",
                str(q["count"]),
            )
            for q in report.sum_queries
        ),
    )
    runs = Table(
        ("steps", "count", "q", "z_eff", "scheme"),
        tuple(
            (
                f"{r['first_step']}–{r['last_step']}",
                str(r["count"]),
                f"{r['sampling_probability']:.6g}",
                f"{r['noise_multiplier']:.6g}",
                (r["sampling"] or r["scheme"])
                + (
                    ""
                    if r.get("epochs") is None
                    else f" ({r['epochs']} epochs of {r['steps_per_epoch']} steps)"
                ),
            )
            for r in report.runs
        ),
    )
    paragraphs: tuple[str, ...] = (
        "Each step draws a sample and computes Gaussian sum queries on it; a query clips "
        "every record's contribution to L2 norm ≤ C and adds N(0, σ̃²) noise to the sum. A "
        "step's effective noise multiplier is z_eff = (Σ (C/σ̃)²)^(-1/2). Runs are "
        "consecutive steps with identical sampling and z_eff; the epochs of a shuffled or "
        "balls-in-bins run that have one shape share a row.",
    )
    paragraphs += tuple(f"Sampling: {n}" for n in report.sampling_notes)
    tables: tuple[Table, ...] = (samplers, queries, runs)
    if report.correlated_releases:
        paragraphs += (
            "A correlated-noise release adds the noise of one matrix mechanism to a stream of "
            "T steps, each record clipped to C; it is accounted once, for its whole stream, "
            "from its sensitivity per unit clip under its participation schema. Its progress "
            "counts the stream's steps taken so far.",
        )
        tables += (_releases_table(report),)
    return Section(
        key="mechanism",
        title="Samplers, sum queries and runs",
        paragraphs=paragraphs,
        tables=tables,
    )


def _releases_table(report: PrivacyReport) -> Table:
    """The correlated-noise releases: kind, T, participation schema, C, σ, sensitivity,
    progress."""
    rows = []
    for c in report.correlated_releases:
        schema = (
            f"{c['participation']} (k={c['max_participations']}, separation {c['min_separation']})"
        )
        if c["sampling"] != "none":
            schema += f", Poisson q={c['sampling_probability']:.6g} within bands"
        bound = "" if c["sensitivity_exact"] else " (bound)"
        rows.append(
            (
                c["strategy"] if c["label"] is None else f"{c['strategy']} ({c['label']})",
                str(c["num_steps"]),
                schema,
                f"{c['l2_norm_bound']:.6g}",
                f"{c['noise_stddev']:.6g}",
                f"{c['sensitivity']:.6g}{bound}",
                f"{c['steps_taken']} of {c['num_steps']} steps taken",
            )
        )
    return Table(
        (
            "correlated release",
            "T",
            "participation",
            "C (L2 clipping bound)",
            "σ (noise std)",
            "sensitivity per unit C",
            "progress",
        ),
        tuple(rows),
    )


def _accountants(report: PrivacyReport) -> Section:
    rows = []
    for r in report.accountants:
        if r.refused is not None:
            continue
        rows.append(
            (
                r.accountant,
                shown_epsilon(r.epsilon, r.kind),
                r.kind_label or "-",
                format_rounded(r.lower, "down"),
                format_rounded(r.upper, "up"),
                "-" if r.seconds is None else f"{r.seconds:.3f}",
            )
        )
    refused = tuple((r.accountant, r.refused) for r in report.accountants if r.refused is not None)
    tables = [
        Table(("accountant", "ε", "what it is", "certified lower", "certified upper", "seconds"),
              tuple(rows))
    ]  # fmt: skip
    tables += _monte_carlo_tables(report)
    if refused:
        tables.append(Table(("accountant", "refused because"), refused))
    notes = tuple(f"{r.accountant}: warning: {w}" for r in report.accountants for w in r.warnings)
    return Section(
        key="accountants",
        title=f"ε at δ = {report.delta:g} by every accountant",
        paragraphs=(
            "Only an upper bound is a differential-privacy guarantee. An estimate has no "
            "one-sided guarantee by itself (its certified interval is shown where it has one); "
            "an approximation has no guarantee at all: never sign one off.",
        ),
        tables=tuple(tables),
        notes=notes,
    )


def monte_carlo_label(confidence: float) -> str:
    """The words a Monte-Carlo upper bound is shown under: it holds only with ``confidence``
    over the method's random draws, so it is never a certified bound."""
    return f"Monte-Carlo bound (not certified, probability {confidence:g} over the random draws)"


def _monte_carlo_tables(report: PrivacyReport) -> list[Table]:
    """The Monte-Carlo upper bounds (``balls_in_bins``), in a table of their own, one per
    confidence: never in the certified columns, never the claim."""
    by_confidence: dict[float, list[tuple[str, str]]] = {}
    for r in report.answered:
        if r.upper_confidence is not None and r.confidence is not None:
            shown = format_rounded(r.upper_confidence, "up")
            by_confidence.setdefault(r.confidence, []).append((r.accountant, shown))
    return [
        Table(("accountant", monte_carlo_label(c)), tuple(rows))
        for c, rows in by_confidence.items()
    ]


def _tradeoff(report: PrivacyReport) -> Section:
    view = report.tradeoff
    if view is None or view.unavailable is not None:
        why = "not computed" if view is None else view.unavailable
        return Section(
            key="tradeoff", title="Hypothesis-testing view", paragraphs=(f"Not available: {why}.",)
        )
    table = Table(
        ("false-positive rate (FPR)", "best attacker's TPR (upper bound)", "TPR / FPR"),
        tuple(
            (f"{a:g}", format_rounded(t, "up", digits=4), format_rounded(t / a, "up", digits=4))
            for a, t in view.tpr_at_fpr
        ),
    )
    return Section(
        key="tradeoff",
        title="Hypothesis-testing view",
        paragraphs=(
            "A membership attacker decides, from everything the run released, whether a given "
            "record was in the training data. For each false-positive rate α, the smallest "
            "type-II error any attacker can reach is β(α) = max over ε of max(0, 1 − δ(ε) − "
            "e^ε α, e^(−ε) (1 − δ(ε) − α)); the true-positive rate is TPR = 1 − β(α).",
            f"Computed {view.basis}.",
        ),
        tables=(table,),
        plot="tradeoff",
    )


def _audit(report: PrivacyReport) -> Section:
    a = report.audit
    assert a is not None
    if a.claimed_epsilon is None:
        verdict = "There is no upper bound to compare it with."
    elif a.refutes_claim:
        verdict = (
            "THE AUDIT REFUTES THE CLAIM: its lower bound exceeds the upper bound; the "
            "accounting or the training code is wrong."
        )
    else:
        verdict = "Consistent: the audited lower bound does not exceed the claimed upper bound."
    rows = (
        ("audit file", a.source),
        ("audited ε lower bound", format_rounded(a.lower_bound, "down")),
        ("claimed ε upper bound", format_rounded(a.claimed_epsilon, "up")),
        ("audit δ", "-" if a.delta is None else f"{a.delta:g}"),
        ("confidence", "-" if a.confidence is None else f"{a.confidence:g}"),
        ("method", a.method or "-"),
    )
    return Section(
        key="audit",
        title="Audit beside the claim",
        tables=(Table(("item", "value"), rows),),
        paragraphs=(verdict,),
    )
