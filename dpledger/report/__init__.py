"""The privacy report of a ledger file (``dpledger report``): what a privacy reviewer signs.

:func:`build_report` computes a :class:`PrivacyReport` (pure data, with a JSON twin); the
renderers :func:`render_html` and :func:`render_markdown` format it. This package sits above the
core: it imports the core, matplotlib (for the plots) and tqdm (for the progress bar), never a
framework, the adapters, the audit, the checks or the CLI.
"""

from dpledger.report.build import PrivacyReport, build_report
from dpledger.report.html import render_html
from dpledger.report.markdown import render_markdown

__all__ = ["PrivacyReport", "build_report", "render_html", "render_markdown"]
