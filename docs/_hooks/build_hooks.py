"""MkDocs hooks of the dpledger documentation site (``mkdocs.yml``, ``hooks:``).

* **The CLI reference is generated from the parsers.** A page holding the marker
  ``<!-- dpledger-cli-reference -->`` gets, in its place, every subcommand of ``dpledger`` with
  its usage, description and every argument (flags, metavar, default, choices, whether it is
  required, help), read from :func:`dpledger.cli.build_parser`, so that it never goes stale.
* **Links to an included file lead to its page.** A docs page that links to
  ``benchmarks/RESULTS.md`` (as it must, to work on GitHub) links to ``benchmarks.md`` on the
  site, which includes it (``INCLUDED_FILES``).
* **Files outside ``docs/`` are included with their links fixed.** A line
  ``<!-- dpledger-include: PATH -->`` is replaced by the file at ``PATH`` (relative to the
  repository root), its relative links rewritten so that they point from the page to the same
  target (a link into ``docs/`` becomes a page link; a link
  to anything else is left as it is, and ``mkdocs build --strict`` then fails on it).

The hooks import dpledger from this source tree (the repository root comes first on
``sys.path``), never an installed copy, and import neither PyTorch nor TensorFlow.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any

CLI_MARKER = "<!-- dpledger-cli-reference -->"
INCLUDED_FILES = {"benchmarks/RESULTS.md": "benchmarks.md"}
"""Repository files (relative to the root) that a page includes → that page (relative to
``docs/``)."""
_INCLUDE = re.compile(r"^<!-- dpledger-include: (\S+) -->$", re.MULTILINE)
_LINK = re.compile(r"(\]\()([^)\s#]+)(#[^)\s]*)?\)")
_MARKDOWN_SPECIAL = re.compile(r"([*_>\\`\[\]])")

_root = Path(__file__).resolve().parents[2]


def on_config(config: Any) -> Any:
    """Put the repository root first on ``sys.path`` so that the hooks read this tree's code."""
    global _root
    _root = Path(config["config_file_path"]).resolve().parent
    if str(_root) not in sys.path:
        sys.path.insert(0, str(_root))
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Expand the CLI-reference marker and the include markers of a page."""
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    docs_dir = Path(config["docs_dir"]).resolve()
    page_dir = (docs_dir / page.file.src_uri).parent

    def include(match: re.Match[str]) -> str:
        source = (_root / match.group(1)).resolve()
        if not source.is_file():
            raise FileNotFoundError(f"{page.file.src_uri}: no file {match.group(1)} to include")
        text = source.read_text(encoding="utf-8")
        return _relink(text, source.parent, page_dir, docs_dir)

    markdown = _relink_included(markdown, page_dir, docs_dir)
    return _INCLUDE.sub(include, markdown)


def _relink_included(text: str, page_dir: Path, docs_dir: Path) -> str:
    """Links of a page to a file that another page includes, pointed at that page."""
    pages = {(_root / path).resolve(): docs_dir / page for path, page in INCLUDED_FILES.items()}

    def fix(match: re.Match[str]) -> str:
        target = match.group(2)
        if "://" in target or target.startswith(("/", "mailto:")):
            return match.group(0)
        page = pages.get((page_dir / target).resolve())
        if page is None:
            return match.group(0)
        relative = Path(os.path.relpath(page, page_dir)).as_posix()
        return f"{match.group(1)}{relative}{match.group(3) or ''})"

    return _LINK.sub(fix, text)


def _relink(text: str, source_dir: Path, page_dir: Path, docs_dir: Path) -> str:
    """Relative links of an included file, rewritten to point from the including page."""

    def fix(match: re.Match[str]) -> str:
        target = match.group(2)
        if "://" in target or target.startswith(("/", "mailto:")):
            return match.group(0)
        resolved = (source_dir / target).resolve()
        try:
            resolved.relative_to(docs_dir)
        except ValueError:
            return match.group(0)
        relative = Path(os.path.relpath(resolved, page_dir)).as_posix()
        return f"{match.group(1)}{relative}{match.group(3) or ''})"

    return _LINK.sub(fix, text)


def _text(text: str) -> str:
    """Plain text from argparse as Markdown: one line, Markdown's special characters escaped."""
    return _MARKDOWN_SPECIAL.sub(r"\\\1", " ".join(text.split())).replace("<", "&lt;")


def _cell(text: str) -> str:
    return _text(text).replace("|", "\\|")


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


def _argument_rows(parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser._get_formatter()
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            name = ", ".join(action.option_strings)
            if action.nargs != 0:
                name += f" {formatter._format_args(action, action.dest.upper())}"
        else:
            name = formatter._metavar_formatter(action, action.dest)(1)[0]
        help_text = formatter._expand_help(action) if action.help else ""
        details = []
        if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
            details.append("one of " + ", ".join(f"`{c}`" for c in action.choices))
        if action.required and action.option_strings:
            details.append("required")
        shown_default = action.default not in (None, False, argparse.SUPPRESS)
        if action.option_strings and action.nargs != 0 and shown_default:
            details.append(f"default `{action.default}`")
        detail_cell = "; ".join(details).replace("|", "\\|")
        rows.append(f"| {_code(name)} | {_cell(help_text)} | {detail_cell} |")
    return rows


def cli_reference() -> str:
    """Markdown for every subcommand of ``dpledger``, read from its argparse parsers."""
    from dpledger.cli import build_parser

    os.environ.setdefault("COLUMNS", "100")
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    summaries = {a.dest: a.help or "" for a in subparsers._choices_actions}
    lines = [
        "| command | what it does |",
        "| --- | --- |",
        *(
            f"| [`dpledger {name}`](#dpledger-{name}) | {_cell(summaries.get(name, ''))} |"
            for name in subparsers.choices
        ),
        "",
    ]
    for name, sub in subparsers.choices.items():
        lines += [f"## `dpledger {name}` {{#dpledger-{name}}}", ""]
        usage = sub.format_usage().strip().removeprefix("usage: ")
        lines += ["```text", usage, "```", ""]
        if sub.description:
            lines += [_text(sub.description), ""]
        lines += ["| argument | meaning | |", "| --- | --- | --- |", *_argument_rows(sub), ""]
        if sub.epilog:
            lines += ["```text", sub.epilog.strip(), "```", ""]
    return "\n".join(lines)
