"""``dpledger report``: a privacy report of a ledger file that a privacy reviewer can sign.

Exit status (the CLI's conventions, :mod:`dpledger.cli`): 0 when the report was written for an
intact ledger whose requirements hold; 1 when a check failed: the file was altered (the report
is still written, stating only that), ``--strict`` or ``--require-closed`` refuse a file cut
short or unclosed (nothing is written), or ``--expect-head`` does not match (the report is
written, saying so first); 2 when the command could not run (bad options, a missing file,
every accountant refusing the ledger).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable
from typing import Any

from dpledger.accountants.commands import add_accounting_arguments
from dpledger.errors import InvalidParameterError, LedgerVerificationError
from dpledger.ledger.commands import add_ledger_checks, load_for_command, print_warnings
from dpledger.report.build import (
    DEFAULT_CURVE_POINTS,
    PrivacyReport,
    accountant_names,
    build_report,
    load_audit,
)
from dpledger.validation import check_delta

__all__ = ["MAX_CURVE_POINTS", "register"]

MAX_CURVE_POINTS = 1000
"""The most step counts on each accountant's ε-vs-steps curve (each is one evaluation)."""

_OUT_NAMES = {"html": "report.html", "markdown": "report.md", "json": "report.json"}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``report`` command to the ``dpledger`` parser."""
    rep = subparsers.add_parser(
        "report",
        help="write a privacy report of a ledger file (HTML, Markdown, JSON) for sign-off",
        description=(
            "Verify a ledger file and write a privacy report: verification status (stated "
            "first), the run's metadata, samplers and sum queries, ε at δ by every accountant "
            "with what kind of number each is, ε against steps, and the best membership "
            "attacker's TPR against FPR. Without --out, --html, --markdown or --json the "
            "Markdown report is printed."
        ),
    )
    add_accounting_arguments(rep)
    rep.add_argument(
        "--out",
        metavar="DIR",
        help="write report.html, report.md and report.json into DIR (created if missing)",
    )
    rep.add_argument("--html", metavar="FILE", help="write the HTML report to FILE")
    rep.add_argument("--markdown", metavar="FILE", help="write the Markdown report to FILE")
    rep.add_argument("--json", metavar="FILE", help="write the JSON report to FILE")
    rep.add_argument(
        "--curve",
        type=int,
        default=DEFAULT_CURVE_POINTS,
        metavar="N",
        help=f"step counts on the ε-vs-steps curve, 1 <= N <= {MAX_CURVE_POINTS} "
        f"(default {DEFAULT_CURVE_POINTS})",
    )
    rep.add_argument(
        "--expect-head",
        metavar="HASH",
        help="fail (exit 1, the report saying so first) unless the last line's hash equals HASH",
    )
    rep.add_argument(
        "--audit",
        metavar="AUDIT.json",
        help='an audit result {"lower_bound": ε, "delta": …, "confidence": …} to show beside '
        "the claim",
    )
    add_ledger_checks(rep)
    rep.set_defaults(func=_report)


def _outputs(args: argparse.Namespace) -> dict[str, str]:
    """The files to write, by format, checked before any work."""
    chosen = {k: getattr(args, k) for k in _OUT_NAMES if getattr(args, k) is not None}
    if args.out is not None:
        if chosen:
            flag = "--" + next(iter(chosen))
            raise InvalidParameterError(
                "out", args.out, f"either --out or {flag} (and the other file options), not both"
            )
        if not args.out or "\x00" in args.out or os.path.isfile(args.out):
            raise InvalidParameterError("out", args.out, "a directory to write the reports into")
        parent = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(parent):
            raise InvalidParameterError(
                "out", args.out, f"a directory whose parent exists ({parent!r} does not)"
            )
        chosen = {k: os.path.join(args.out, name) for k, name in _OUT_NAMES.items()}
    else:
        for key, path in chosen.items():
            folder = os.path.dirname(os.path.abspath(path)) if path else ""
            if not path or "\x00" in path or os.path.isdir(path) or not os.path.isdir(folder):
                raise InvalidParameterError(key, path, "a file path in an existing directory")
    return chosen


def _progress(items: Iterable[Any], total: int, desc: str) -> Iterable[Any]:
    """A tqdm bar on stderr when stderr is a terminal (and tqdm is installed)."""
    if not sys.stderr.isatty():
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is an optional extra
        return items
    return tqdm(items, total=total, desc=desc, unit="task", file=sys.stderr)


def _write(report: PrivacyReport, outputs: dict[str, str], args: argparse.Namespace) -> None:
    from dpledger.report.html import render_html
    from dpledger.report.markdown import render_markdown

    if args.out is not None:
        os.makedirs(args.out, exist_ok=True)
    render = {
        "html": lambda: render_html(report),
        "markdown": lambda: render_markdown(report),
        "json": lambda: json.dumps(report.to_dict(), indent=2, sort_keys=True) + "\n",
    }
    if not outputs:
        print(render["markdown"](), end="")
        return
    for key, path in outputs.items():
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(render[key]())
        print(f"{key} report written to {path}")


def _report(args: argparse.Namespace) -> int:
    # Every option is checked before the ledger is read or an accountant runs.
    delta = check_delta("delta", args.delta)
    names = accountant_names(args.accountant)
    if not 1 <= args.curve <= MAX_CURVE_POINTS:
        raise InvalidParameterError(
            "curve", args.curve, f"a number of points from 1 to {MAX_CURVE_POINTS}"
        )
    outputs = _outputs(args)
    audit = None if args.audit is None else load_audit(args.audit)
    common: dict[str, Any] = {
        "delta": delta,
        "accountants": None if args.accountant.strip() == "all" else names,
        "expect_head": args.expect_head,
        "audit": audit,
        "audit_source": args.audit,
        "curve_points": args.curve,
        "progress": _progress,
    }
    try:
        _, _, problem = load_for_command(
            args.ledger, strict=args.strict, require_closed=args.require_closed
        )
    except LedgerVerificationError:
        report = build_report(args.ledger, **common)  # a report stating the failure only
        _write(report, outputs, args)
        v = report.verification
        print(
            f"dpledger report: verification failed: {args.ledger}: line {v.first_bad_line}: "
            f"{v.reason}",
            file=sys.stderr,
        )
        return 1
    if problem is not None:
        print(f"dpledger report: verification failed: {problem}", file=sys.stderr)
        return 1
    report = build_report(args.ledger, **common)
    print_warnings("report", list(report.verification.warnings))
    _write(report, outputs, args)
    if report.verification.head_matches is False:
        return 1
    if report.accountants and not report.answered:
        print("dpledger report: error: every accountant refused the ledger", file=sys.stderr)
        return 2
    return 0
