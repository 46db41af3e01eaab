"""``dpledger info`` and ``dpledger verify``, and how every command loads a ledger file.

Commands that print numbers from a ledger load it with :func:`load_for_command`: a file with no
complete header is an error (exit 2), never an empty ledger with ε = 0; a file whose last line
was cut short loads as its valid prefix with a warning printed before any result, and
``--strict`` (an intact file is required) or ``--require-closed`` (a close marker is required)
turn that into a failed check (exit 1). Every command warns about the ledger's noise provenance
(a caller-given seed, a caller's generator, generator states in checkpoints), and ``--strict``
refuses a ledger whose noise or sampler was seeded by the caller.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import warnings
from typing import Any

import attrs

from dpledger.ledger.events import SumQueryEvent
from dpledger.ledger.ledger import LedgerWarning, PrivacyLedger
from dpledger.ledger.provenance import provenance_findings, provenance_of, provenance_text
from dpledger.ledger.verify import verify_ledger

__all__ = [
    "add_ledger_checks",
    "intent_text",
    "load_for_command",
    "one_line",
    "print_warnings",
    "provenance_warnings",
    "register",
    "run_rows",
    "sum_query_summary",
]

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def one_line(text: str) -> str:
    """``text`` with line breaks and other control characters escaped, so it prints as one line."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def add_ledger_checks(parser: argparse.ArgumentParser) -> None:
    """Add ``--strict`` and ``--require-closed`` to a command that reads a ledger."""
    parser.add_argument(
        "--strict",
        action="store_true",
        help="fail (exit 1) unless the file is intact and its noise was not seeded by the "
        "caller: a last line cut short, or a caller-given seed of the noise or the sampler, "
        "is an error, not a warning",
    )
    parser.add_argument(
        "--require-closed",
        action="store_true",
        help="fail (exit 1) unless the ledger ends with a close marker (implies --strict)",
    )


def load_for_command(
    path: str, *, strict: bool = False, require_closed: bool = False, keep_events: bool = False
) -> tuple[PrivacyLedger, list[str], str | None]:
    """Load a ledger file for a command, read-only and (by default) without keeping its events.

    Args:
        path: the ledger file.
        strict: a torn last line, or noise or batches seeded with a caller's seed (the
            ledger's noise provenance, :mod:`dpledger.ledger.provenance`), is a failed check
            rather than a warning.
        require_closed: the ledger must end with a close marker (implies ``strict``).
        keep_events: keep every event in memory (for a command that reads the queries).

    Returns:
        ``(ledger, warnings, problem)``: the loaded ledger (the valid prefix of a torn file),
        the warnings to print before any result, and the failed check as one sentence (None
        when every requirement holds; the command then exits 1).

    Raises:
        MissingHeaderError: the file holds no complete header (it is empty or cut in line 1).
        NotALedgerError: the path is a directory or not a ledger.
        LedgerVerificationError: the file was altered (exit 1).
        OSError: the file cannot be read.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LedgerWarning)
        ledger = PrivacyLedger.load(path, keep_events=keep_events)
    notes = [str(w.message) for w in caught if issubclass(w.category, LedgerWarning)]
    records = provenance_of(ledger.notes)
    problem = None
    torn = ledger.torn_tail
    if (strict or require_closed) and torn is not None:
        problem = f"{path}: {torn.describe().replace('; it was ignored', '')}"
    elif strict and any(r.caller_seeded for r in records):
        problem = (
            f"{path}: the noise or the batch sampler was seeded with a seed the caller gave "
            "(--strict refuses a ledger whose ε holds only while a seed stays secret)"
        )
    elif require_closed and not ledger.closed_cleanly:
        problem = (
            f"{path}: the ledger does not end with a close marker (its writer crashed or is still "
            "running, or its final lines were deleted)"
        )
    return ledger, notes, problem


def provenance_warnings(ledger: PrivacyLedger) -> list[str]:
    """What ``info`` and ``epsilon`` warn about the ledger's noise provenance (a caller-given
    seed, a caller's generator, generator states in checkpoints), one sentence each, naming
    the file (:func:`~dpledger.ledger.provenance.provenance_findings`)."""
    return [f"{ledger.path}: {f}" for f in provenance_findings(provenance_of(ledger.notes))]


def print_warnings(command: str, notes: list[str]) -> None:
    """Print warnings one line each on stderr, in the CLI's ``warning:`` style."""
    for note in notes:
        print(f"dpledger {command}: warning: {one_line(note)}", file=sys.stderr)


_MAX_RUNS_SHOWN = 20


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ledger commands to the ``dpledger`` parser."""
    info = subparsers.add_parser(
        "info",
        help="show a ledger's header, steps, events, distinct (q, z_eff) runs and labels",
        description="Show what a ledger file holds. The file is verified as it is read.",
    )
    info.add_argument("ledger", metavar="LEDGER", help="path of the ledger file")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    add_ledger_checks(info)
    info.set_defaults(func=_info)

    verify = subparsers.add_parser(
        "verify",
        help="check a ledger's hash chain; exit 0 if intact, 1 with the first bad line",
        description=(
            "Verify every line of a ledger file (hash chain, sequence numbers, event values). "
            "Exit status 0: intact; 1: a line was altered or is incomplete."
        ),
    )
    verify.add_argument("ledger", metavar="LEDGER", help="path of the ledger file")
    verify.add_argument("--json", action="store_true", help="print one JSON object")
    verify.add_argument(
        "--require-closed",
        action="store_true",
        help="also fail (exit 1) when the ledger does not end with a close marker",
    )
    verify.add_argument(
        "--expect-head",
        metavar="HASH",
        help="also fail unless the last line's hash equals HASH (detects deleted final lines)",
    )
    verify.set_defaults(func=_verify)


def _z_text(z: float) -> str:
    if math.isinf(z):
        return "inf (no query)"
    if z == 0.0:
        return "0 (NOT PRIVATE)"
    return f"{z:.6g}"


def _json_number(x: float) -> float | str:
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")


def sum_query_summary(ledger: PrivacyLedger) -> list[dict[str, Any]]:
    """One entry per query label and distinct (S, σ̃): the clip bound C (S), the noise standard
    deviation σ̃, their ratio z = σ̃ / S and the number of such queries, in order of first
    appearance (``dpledger info`` and ``dpledger report`` show them)."""
    counts: dict[tuple[str | None, float, float], int] = {}
    for event in ledger.events():
        if isinstance(event, SumQueryEvent):
            key = (event.label, event.l2_norm_bound, event.noise_stddev)
            counts[key] = counts.get(key, 0) + 1
    return [
        {
            "label": label,
            "l2_norm_bound": bound,
            "noise_stddev": sigma,
            "noise_multiplier": sigma / bound,
            "count": count,
        }
        for (label, bound, sigma), count in counts.items()
    ]


def _query_summary(ledger: PrivacyLedger) -> list[dict[str, Any]]:
    """:func:`sum_query_summary` with every ratio as a JSON value."""
    return [
        {**entry, "noise_multiplier": _json_number(entry["noise_multiplier"])}
        for entry in sum_query_summary(ledger)
    ]


def _info(args: argparse.Namespace) -> int:
    ledger, notes, problem = load_for_command(
        args.ledger, strict=args.strict, require_closed=args.require_closed, keep_events=True
    )
    if problem is not None:
        print(f"dpledger info: verification failed: {problem}", file=sys.stderr)
        return 1
    print_warnings("info", notes + provenance_warnings(ledger))
    runs = ledger.runs()
    comp = ledger.compressed()
    distinct = {(r.sampling, r.sampling_probability, r.noise_multiplier) for r in runs}
    sampling = _sampling_summary(comp)
    header = ledger.header
    queries = _query_summary(ledger)
    intent = ledger.intent  # the header's, or a note's
    provenance = provenance_of(ledger.notes)
    if args.json:
        out: dict[str, Any] = {
            "path": ledger.path,
            "format_version": header.format_version,
            "library_version": header.library_version,
            "created": header.created,
            "neighboring": header.neighboring.value,
            "metadata": header.metadata,
            "num_steps": ledger.num_steps,
            "num_events": ledger.num_events,
            "closed": bool(ledger.closed_cleanly),
            "head_hash": ledger.head_hash,
            "population_sizes": list(ledger.population_sizes),
            "labels": list(ledger.labels),
            "num_runs": len(runs),
            "runs": [
                {
                    "sampling_probability": r.sampling_probability,
                    "noise_multiplier": _json_number(r.noise_multiplier),
                    "count": r.count,
                    "scheme": r.scheme.value,
                    "sampling": None if r.sampling is None else r.sampling.describe(),
                    "epoch_start": r.sampling is not None and r.sampling.epoch_start,
                }
                for r in runs
            ],
            "sampling": sampling,
            "num_distinct": len(distinct),
            "torn_tail": None if ledger.torn_tail is None else ledger.torn_tail.describe(),
            "warnings": notes,
            "queries": queries,
            "intent": intent,
            "noise_provenance": [r.to_json() for r in provenance] or "not recorded",
            "correlated_releases": [
                {
                    **{a.name: getattr(c, a.name) for a in attrs.fields(type(c))},
                    "description": c.describe(),
                    "steps_taken": ledger.stream_progress(i),
                }
                for i, c in enumerate(ledger.correlated_releases)
            ],
        }
        print(json.dumps(out, indent=2))
        return 0
    print(f"ledger        {ledger.path}")
    version = header.library_version
    print(f"format        dpledger-ledger v{header.format_version} (written by {version})")
    print(f"created       {header.created}")
    print(f"neighboring   {header.neighboring.value}")
    print(f"metadata      {json.dumps(header.metadata, sort_keys=True)}")
    if intent is not None:
        print(f"intent        {intent_text(intent)}")
    for i, line in enumerate(provenance_text(provenance)):
        print(f"{'noise' if i == 0 else '':<14}{one_line(line)}")
    print(f"steps         {ledger.num_steps}")
    print(f"events        {ledger.num_events}")
    print(f"closed        {'yes' if ledger.closed_cleanly else 'no'}")
    if ledger.torn_tail is not None:
        print(f"torn tail     {ledger.torn_tail.describe()} (the numbers below are the prefix's)")
    print(f"head hash     {ledger.head_hash}")
    sizes = ", ".join("unknown" if n is None else str(n) for n in ledger.population_sizes)
    print(f"population    {sizes or '-'}")
    labels = ", ".join(one_line(label) for label in ledger.labels)
    print(f"labels        {labels or '-'}")
    for i, item in enumerate(sampling):
        epochs = "" if item["epochs"] is None else f", {item['epochs']} epochs"
        relations = " or ".join(item["relations"])
        print(
            f"{'sampling' if i == 0 else '':<14}{item['sampling']}: {item['steps']} steps{epochs}"
            f" (unit {item['unit']}; analysed under {relations})"
        )
    kinds = "sampling, q, z_eff" if not comp.is_poisson or comp.sampling_events() else "q, z_eff"
    print(f"runs          {len(runs)} runs of identical steps, {len(distinct)} distinct ({kinds})")
    rows = run_rows(comp)
    if rows:
        print(f"  {'q':>12}  {'z_eff':>16}  {'steps':>10}  scheme")
        for row in rows[:_MAX_RUNS_SHOWN]:
            z = _z_text(row["noise_multiplier"])
            epochs = row["epochs"]
            shape = (
                ""
                if epochs is None
                else f" ({epochs} epoch{'s' if epochs != 1 else ''} of "
                f"{row['steps_per_epoch']} steps)"
            )
            print(
                f"  {row['sampling_probability']:>12.6g}  {z:>16}  {row['count']:>10}  "
                f"{row['scheme']}{shape}"
            )
        if len(rows) > _MAX_RUNS_SHOWN:
            print(f"  … {len(rows) - _MAX_RUNS_SHOWN} more rows (use --json for every run)")
    print(f"queries       {len(queries)} distinct (label, C, σ̃)")
    if queries:
        print(f"  {'label':<24}  {'C':>12}  {'σ̃':>12}  {'z = σ̃/C':>12}  {'queries':>10}")
        for item in queries[:_MAX_RUNS_SHOWN]:
            label = "-" if item["label"] is None else one_line(item["label"])
            print(
                f"  {label:<24}  {item['l2_norm_bound']:>12.6g}  {item['noise_stddev']:>12.6g}  "
                f"{item['noise_stddev'] / item['l2_norm_bound']:>12.6g}  {item['count']:>10}"
            )
        if len(queries) > _MAX_RUNS_SHOWN:
            print(f"  … {len(queries) - _MAX_RUNS_SHOWN} more (use --json for all)")
    correlated = ledger.correlated_releases
    if correlated:
        print(f"correlated    {len(correlated)} correlated-noise release(s)")
        for i, c in enumerate(correlated):
            label = "" if c.label is None else f"{one_line(c.label)}: "
            print(f"  {label}{c.describe()}")
            print(f"    {ledger.stream_progress(i)} of {c.num_steps} steps taken")
    return 0


def _g(x: Any) -> str:
    """A number in ``%.6g`` form; anything else (metadata is free-form) as it is."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return f"{x:.6g}"
    return str(x)


def intent_text(intent: dict[str, Any]) -> str:
    """The run's intent on one line: the target, the calibration, the population, versions
    (as ``dpledger info`` and ``dpledger report`` show it).

    Args:
        intent: the intent stored in a ledger's header
            (:func:`~dpledger.ledger.intent.intent_of`).
    """
    parts = []
    if "target_epsilon" in intent:
        parts.append(f"target ε = {_g(intent['target_epsilon'])} at δ = {_g(intent.get('delta'))}")
    elif "delta" in intent:
        parts.append(f"δ = {_g(intent['delta'])}")
    if "calibrated_by" in intent:
        parts.append(f"noise calibrated by {intent['calibrated_by']}")
    if "noise_multiplier" in intent:
        parts.append(f"z = {_g(intent['noise_multiplier'])}")
    if "population_size" in intent:
        parts.append(f"n = {intent['population_size']} ({intent.get('unit', 'record')}s)")
    versions = intent.get("versions")
    if isinstance(versions, dict):
        parts.append(", ".join(f"{k} {v}" for k, v in versions.items()))
    return one_line("; ".join(parts))


def run_rows(comp: Any) -> list[dict[str, Any]]:
    """The ledger's runs as a table shows them: consecutive steps with identical sampling and
    z_eff in one row, and for epoch-based schemes (shuffle, balls-in-bins) the epochs of one
    shape in one row (``epochs`` of ``steps_per_epoch`` steps each) instead of a one-step
    epoch-start run plus the rest for every epoch.

    Each row: ``first_step``, ``last_step``, ``count`` (steps), ``sampling_probability``,
    ``noise_multiplier``, ``scheme``, ``sampling`` (the event's description, or None for a
    record-level Poisson or full batch), ``epochs`` and ``steps_per_epoch`` (None outside
    epoch-based schemes).
    """
    from dpledger.ledger.steps import EpochSegment

    rows: list[dict[str, Any]] = []
    start = 0
    for item in comp.epoch_view():
        if isinstance(item, EpochSegment):
            q, z, steps, event = (
                item.sampling.sampling_probability,
                item.noise_multiplier,
                item.steps,
                item.sampling,
            )
            last = rows[-1] if rows else None
            if (
                last is not None
                and last["epochs"] is not None
                and last["steps_per_epoch"] == steps
                and (last["sampling_probability"], last["noise_multiplier"]) == (q, z)
                and last["sampling"] == event.describe()
            ):
                last["epochs"] += 1
                last["count"] += steps
                last["last_step"] += steps
            else:
                rows.append(
                    {
                        "first_step": start + 1,
                        "last_step": start + steps,
                        "count": steps,
                        "sampling_probability": q,
                        "noise_multiplier": z,
                        "scheme": event.scheme.value,
                        "sampling": event.describe(),
                        "epochs": 1,
                        "steps_per_epoch": steps,
                    }
                )
        else:
            steps = item.count
            rows.append(
                {
                    "first_step": start + 1,
                    "last_step": start + steps,
                    "count": steps,
                    "sampling_probability": item.sampling_probability,
                    "noise_multiplier": item.noise_multiplier,
                    "scheme": item.scheme.value,
                    "sampling": None if item.sampling is None else item.sampling.describe(),
                    "epochs": None,
                    "steps_per_epoch": None,
                }
            )
        start += steps
    return rows


def _sampling_summary(comp: Any) -> list[dict[str, Any]]:
    """One entry per sampling kind of the ledger: what it is, its steps and epochs, its unit
    and the relations it is analysed under, in order of first appearance."""
    from dpledger.ledger.events import SCHEME_RELATIONS, SamplingEvent
    from dpledger.ledger.steps import EpochSegment

    out: dict[str, dict[str, Any]] = {}
    for item in comp.epoch_view():
        if isinstance(item, EpochSegment):
            event, steps, epochs = item.sampling, item.steps, item.epochs
        else:
            event = item.sampling or SamplingEvent(item.sampling_probability)
            steps, epochs = item.count, None
        key = (
            event.describe()
            if item.sampling is not None or isinstance(item, EpochSegment)
            else ("full_batch" if event.scheme.value == "full" else "poisson")
        )
        entry = out.setdefault(
            key,
            {
                "sampling": key,
                "scheme": event.scheme.value,
                "unit": event.unit.value,
                "relations": [r.value for r in SCHEME_RELATIONS[event.scheme]],
                "steps": 0,
                "epochs": None,
            },
        )
        entry["steps"] += steps
        if epochs is not None:
            entry["epochs"] = (entry["epochs"] or 0) + epochs
    return list(out.values())


def _verify(args: argparse.Namespace) -> int:
    report = verify_ledger(
        args.ledger, require_closed=args.require_closed, expect_head=args.expect_head
    )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    elif report.ok:
        closed = "closed" if report.closed else "not closed (a writer may still be appending)"
        counts = f"{report.num_events} events in {report.num_steps} steps"
        print(f"OK: {report.path}: {counts}, {closed}; head {report.head_hash}")
    else:
        print(f"FAILED: {report.path}")
        for problem in report.problems:
            print(f"  {problem}")
    return 0 if report.ok else 1
