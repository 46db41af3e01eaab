"""The report as Markdown: the same sections, words and numbers as the HTML report, without the
plots (their numbers are in the JSON report).

Every string a section holds is text, never markup, as in the HTML report: each one goes through
:func:`escape_markdown` before it is placed in the document (title, headings, warnings,
paragraphs, table cells, notes), so a file name, a query label, a release label or an audit's
method can neither inject HTML (``<script>``) nor start a line of its own (a newline followed by
``## verification ok``).
"""

from __future__ import annotations

import html
import re

from dpledger.report.contents import PrivacyReport
from dpledger.report.sections import Table, report_sections, title_of

__all__ = ["escape_markdown", "render_markdown"]

_LINE_BREAKS = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_PUNCTUATION = re.compile(r"([\\`*_\[\]#|~!])")


def escape_markdown(text: str) -> str:
    """``text`` as literal Markdown text on one line.

    Control characters and line or paragraph separators are shown as escapes (a newline as
    ``\\n``, as the CLI shows them); ``&``, ``<`` and ``>`` become HTML entities, so no tag and
    no autolink is ever formed; Markdown's punctuation (backslash, backtick, ``*``, ``_``,
    brackets, ``#``, ``|``, ``~``, ``!``) is backslash-escaped, so no emphasis, code span, link,
    image, heading or table cell is formed from it. A renderer shows the original characters.
    """
    text = _PUNCTUATION.sub(r"\\\1", str(text))
    text = _LINE_BREAKS.sub(lambda m: repr(m.group())[1:-1].replace("\\", "\\\\"), text)
    return html.escape(text, quote=False)


def _table(table: Table) -> list[str]:
    lines = [
        "| " + " | ".join(escape_markdown(h) for h in table.headers) + " |",
        "|" + "|".join("---" for _ in table.headers) + "|",
    ]
    lines += ["| " + " | ".join(escape_markdown(c) for c in row) + " |" for row in table.rows]
    return [*lines, ""]


def render_markdown(report: PrivacyReport) -> str:
    """The report as a Markdown document."""
    lines = [f"# {escape_markdown(title_of(report))}", ""]
    for section in report_sections(report):
        title = escape_markdown(section.title)
        lines += [f"## {title}", ""]
        lines += [f"> **WARNING:** {escape_markdown(a)}\n" for a in section.alerts]
        for p in section.paragraphs:
            lines += [escape_markdown(p), ""]
        for t in section.tables:
            lines += _table(t)
        if section.plot is not None:
            lines += [f"_(The {title} plot is in the HTML report.)_", ""]
        for n in section.notes:
            lines += [f"_{escape_markdown(n)}_", ""]
    return "\n".join(lines).rstrip() + "\n"
