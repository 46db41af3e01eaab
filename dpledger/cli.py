"""The ``dpledger`` command.

Each part of the library that has commands provides a module with
``register(subparsers: argparse._SubParsersAction) -> None``; the parsers it adds set
``func=handler`` where ``handler(args) -> int`` returns the exit code.

Exit codes:

- 0: success.
- 1: a check failed, and only that: a ledger failed verification (it was altered, or is cut
  short where ``--strict`` asks for an intact file), a requirement such as ``--require-closed``
  or ``--expect-head`` does not hold, or ``dpledger check`` found a bug.
- 2: the command could not run: bad or out-of-range options, a missing file, a path that is not
  a ledger, a file with no complete header (an empty file), every accountant refusing the ledger,
  or an unexpected internal error (reported with its exception type, never as a traceback).

Every error is one line on stderr (``dpledger COMMAND: error: …``), naming the command-line flag
(``--delta``, not the Python keyword ``delta``). Warnings, such as a ledger whose last line was
cut short, are one line each on stderr (``dpledger COMMAND: warning: …``), printed before any
result. ``--json`` output goes to stdout.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import warnings
from collections.abc import Sequence
from typing import Any, NoReturn

from dpledger._version import __version__
from dpledger.errors import DPLedgerError, InvalidParameterError, LedgerVerificationError
from dpledger.ledger.commands import one_line

__all__ = ["build_parser", "main", "one_line"]

_COMMAND_MODULES = (
    "dpledger.ledger.commands",
    "dpledger.accountants.commands",
    "dpledger.checks.commands",
    "dpledger.report.commands",
)
_SHOWN_CHARS = 80
_SNAKE_SWITCH = re.compile(r"\b([a-z][a-z0-9]*(?:_[a-z0-9]+)+)=True\b")
_SNAKE_NAME = re.compile(r"\b([a-z][a-z0-9]*(?:_[a-z0-9]+)+)\b")


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line on stderr (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every registered command."""
    parser = _Parser(
        prog="dpledger",
        description="Inspect, verify and account privacy ledgers.",
    )
    parser.add_argument("--version", action="version", version=f"dpledger {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def _show(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:  # an int beyond the str conversion limit, deep nesting, …
        text = f"<a {type(value).__name__}>"
    if len(text) > _SHOWN_CHARS:
        text = f"{text[: _SHOWN_CHARS - 25]}… ({len(text)} characters)"
    return text


def _flags(parser: argparse.ArgumentParser) -> tuple[dict[str, str], set[str]]:
    """The command's options by destination (``delta`` → ``--delta``, positionals by metavar),
    and the destinations of its on/off switches."""
    names: dict[str, str] = {}
    switches: set[str] = set()
    for action in parser._actions:
        if action.option_strings:
            longs = [s for s in action.option_strings if s.startswith("--")]
            names[action.dest] = (longs or action.option_strings)[0]
            if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
                switches.add(action.dest)
        elif action.dest != argparse.SUPPRESS:
            names[action.dest] = str(action.metavar or action.dest.upper())
    if "ledger" in names:  # the library calls a ledger file's path ``path``
        names.setdefault("path", names["ledger"])
    return names, switches


def _flag_message(exc: InvalidParameterError, parser: argparse.ArgumentParser | None) -> str:
    """The error's message with Python keyword names replaced by the command's flags."""
    if parser is None:
        return str(exc)
    names, switches = _flags(parser)

    def switch(match: re.Match[str]) -> str:
        name = match.group(1)
        return names[name] if name in switches else match.group()

    def name(match: re.Match[str]) -> str:
        return names.get(match.group(1), match.group())

    parameter = names.get(exc.parameter, exc.parameter)
    expected = _SNAKE_NAME.sub(name, _SNAKE_SWITCH.sub(switch, str(exc.expected)))
    return f"{parameter}={_show(exc.value)} is invalid: expected {expected}"


def _print_warning(command: str) -> Any:
    def show(message: Warning | str, category: type[Warning], *_args: Any, **_kw: Any) -> None:
        print(f"dpledger {command}: warning: {one_line(str(message))}", file=sys.stderr)

    return show


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (argparse exits with 2 on a usage error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command
    choices = next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub = choices.get(command)

    def fail(message: str, *, prefix: str = "error") -> None:
        print(f"dpledger {command}: {prefix}: {one_line(message)}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.showwarning = _print_warning(command)
        try:
            return int(args.func(args))
        except LedgerVerificationError as exc:
            fail(str(exc), prefix="verification failed")
            return 1
        except InvalidParameterError as exc:
            fail(_flag_message(exc, sub))
            return 2
        except DPLedgerError as exc:
            fail(str(exc))
            return 2
        except OSError as exc:
            fail(str(exc))
            return 2
        except Exception as exc:  # a bug: say so in one line, with the exception's type
            fail(f"internal error ({type(exc).__name__}: {exc}); please report it")
            return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
