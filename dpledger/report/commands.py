"""``dpledger report``: a privacy report of a ledger file that a privacy reviewer can sign.

Exit status (the CLI's conventions, :mod:`dpledger.cli`): 0 when the report was written for an
intact ledger whose requirements hold; 1 when a check failed: the file was altered (the report
is still written, stating only that), ``--strict`` or ``--require-closed`` refuse a file cut
short or unclosed (nothing is written), or ``--expect-head`` does not match (the report is
written, saying so first); 2 when the command could not run (bad options, a missing file,
every accountant refusing the ledger).

Progress goes to stderr, stage by stage (reading the ledger, the sum queries, each accountant's
ε and its ε-vs-steps curve, the trade-off view): a tqdm bar on a terminal, otherwise one line
per stage as it starts, beginning with :data:`PROGRESS_PREFIX`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Iterable
from typing import Any

from dpledger.accountants.commands import add_accounting_arguments
from dpledger.errors import InvalidParameterError, LedgerVerificationError
from dpledger.ledger.commands import add_ledger_checks, load_for_command, one_line, print_warnings
from dpledger.report.build import (
    DEFAULT_CURVE_POINTS,
    PrivacyReport,
    accountant_names,
    altered_report,
    check_expect_head,
    load_audit,
    report_of_ledger,
    verification_of,
)
from dpledger.validation import check_delta

__all__ = ["MAX_CURVE_POINTS", "PROGRESS_PREFIX", "register"]

MAX_CURVE_POINTS = 1000
"""The most step counts on each accountant's ε-vs-steps curve (each is one evaluation)."""

PROGRESS_PREFIX = "dpledger report: progress: "
"""How each progress line on stderr starts when stderr is not a terminal."""

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
    """Progress on stderr: a tqdm bar when stderr is a terminal (and tqdm is installed), else one
    plain line per stage as it starts (``dpledger report: progress: [i/total] stage``), so that
    a run in a pipeline or a batch job shows where it is too."""
    if sys.stderr.isatty():
        try:
            from tqdm.auto import tqdm
        except ImportError:  # pragma: no cover - tqdm is an optional extra
            pass
        else:
            return _tqdm_stages(tqdm(items, total=total, desc=desc, unit="stage", file=sys.stderr))
    return _progress_lines(items, total)


def _tqdm_stages(bar: Any) -> Iterable[Any]:
    for item in bar:
        bar.set_postfix_str(str(item), refresh=True)
        yield item


def _progress_lines(items: Iterable[Any], total: int) -> Iterable[Any]:
    for i, item in enumerate(items, 1):
        print(f"{PROGRESS_PREFIX}[{i}/{total}] {one_line(str(item))}", file=sys.stderr, flush=True)
        yield item


def _write(report: PrivacyReport, outputs: dict[str, str], args: argparse.Namespace) -> None:
    """Render every requested format, then write each file whole or not at all.

    Everything is rendered in memory first; each file is written to a temporary file in its
    own directory and renamed over its path only when every file is written, so a failure at
    any point (an error while rendering, a full disk) leaves no empty or partial report behind.
    """
    from dpledger.report.html import render_html
    from dpledger.report.markdown import render_markdown
    from dpledger.report.plots import plots_available

    render = {
        "html": lambda: render_html(report),
        "markdown": lambda: render_markdown(report),
        "json": lambda: json.dumps(report.to_dict(), indent=2, sort_keys=True) + "\n",
    }
    if not outputs:
        print(render["markdown"](), end="")
        return
    texts = {key: render[key]() for key in outputs}
    if "html" in outputs and not report.verification.altered and not plots_available():
        print_warnings(
            "report",
            [
                "matplotlib is not installed: the HTML report is written without its plots "
                '(they need the report extra: pip install "dpledger[report]")'
            ],
        )
    if args.out is not None:
        os.makedirs(args.out, exist_ok=True)
    written: list[tuple[str, str]] = []
    try:
        for key, path in outputs.items():
            written.append((_write_temporary(path, texts[key]), path))
        for temporary, path in written:
            os.replace(temporary, path)
    finally:
        for temporary, _ in written:
            if os.path.exists(temporary):
                os.unlink(temporary)
    for key, path in outputs.items():
        print(f"{key} report written to {path}")


def _write_temporary(path: str, text: str) -> str:
    """``text`` written to a new temporary file beside ``path``; returns its name. The file is
    removed again when the write fails."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, temporary = tempfile.mkstemp(
        prefix=f".{os.path.basename(path)}.", suffix=".partial", dir=folder
    )
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)  # as open() would have created it, not mkstemp's 0600
    except BaseException:
        os.unlink(temporary)
        raise
    return temporary


def _report(args: argparse.Namespace) -> int:
    # Every option is checked before the ledger is read or an accountant runs.
    delta = check_delta("delta", args.delta)
    names = accountant_names(args.accountant)
    if not 1 <= args.curve <= MAX_CURVE_POINTS:
        raise InvalidParameterError(
            "curve", args.curve, f"a number of points from 1 to {MAX_CURVE_POINTS}"
        )
    check_expect_head(args.expect_head)
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
    for _ in _progress_lines(["reading and verifying the ledger"], 1):
        pass
    try:
        ledger, notes, problem = load_for_command(
            args.ledger, strict=args.strict, require_closed=args.require_closed, keep_events=True
        )
    except LedgerVerificationError as exc:
        report = altered_report(args.ledger, exc, delta=delta, expect_head=args.expect_head)
        _write(report, outputs, args)
        print(
            f"dpledger report: verification failed: {args.ledger}: line {exc.line_number}: "
            f"{exc.reason}",
            file=sys.stderr,
        )
        return 1
    if problem is not None:
        print(f"dpledger report: verification failed: {problem}", file=sys.stderr)
        return 1
    verification = verification_of(args.ledger, ledger, notes, expect_head=args.expect_head)
    print_warnings("report", list(verification.warnings))
    report = report_of_ledger(args.ledger, ledger, notes, **common)
    print_warnings("report", list(report.findings))
    _write(report, outputs, args)
    if report.verification.head_matches is False:
        return 1
    if report.accountants and not report.answered:
        print("dpledger report: error: every accountant refused the ledger", file=sys.stderr)
        return 2
    return 0
