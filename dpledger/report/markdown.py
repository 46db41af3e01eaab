"""The report as Markdown: the same sections, words and numbers as the HTML report, without the
plots (their numbers are in the JSON report)."""

from __future__ import annotations

from dpledger.report.contents import PrivacyReport
from dpledger.report.sections import Table, report_sections, title_of

__all__ = ["render_markdown"]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(table: Table) -> list[str]:
    lines = [
        "| " + " | ".join(_cell(h) for h in table.headers) + " |",
        "|" + "|".join("---" for _ in table.headers) + "|",
    ]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in table.rows]
    return [*lines, ""]


def render_markdown(report: PrivacyReport) -> str:
    """The report as a Markdown document."""
    lines = [f"# {title_of(report)}", ""]
    for section in report_sections(report):
        lines += [f"## {section.title}", ""]
        lines += [f"> **WARNING:** {a}\n" for a in section.alerts]
        for p in section.paragraphs:
            lines += [p, ""]
        for t in section.tables:
            lines += _table(t)
        if section.plot is not None:
            lines += [f"_(The {section.title} plot is in the HTML report.)_", ""]
        for n in section.notes:
            lines += [f"_{n}_", ""]
    return "\n".join(lines).rstrip() + "\n"
