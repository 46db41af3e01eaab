"""The ``dpledger`` command.

Each part of the library that has commands provides a module with
``register(subparsers: argparse._SubParsersAction) -> None``; the parsers it adds set
``func=handler`` where ``handler(args) -> int`` returns the exit code.

Exit codes: 0 success; 1 a ledger failed verification (it was altered, or a requirement such as
``--require-closed`` does not hold); 2 the command could not run (bad arguments, a missing file,
a path that is not a ledger). Errors are printed as one line on stderr; ``--json`` output goes to
stdout.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from dpledger._version import __version__
from dpledger.errors import DPLedgerError, LedgerVerificationError

__all__ = ["build_parser", "main"]

_COMMAND_MODULES = (
    "dpledger.ledger.commands",
    "dpledger.accountants.commands",
    "dpledger.audit.commands",
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every registered command."""
    parser = argparse.ArgumentParser(
        prog="dpledger",
        description="Inspect, verify and account privacy ledgers.",
    )
    parser.add_argument("--version", action="version", version=f"dpledger {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except LedgerVerificationError as exc:
        print(f"dpledger {args.command}: verification failed: {exc}", file=sys.stderr)
        return 1
    except DPLedgerError as exc:
        print(f"dpledger {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"dpledger {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
