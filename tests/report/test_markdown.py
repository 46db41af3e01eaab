"""The Markdown report treats every string as text, as the HTML report does: no raw HTML and
no line of its own from a file name, a query label, a release label or an audit's method."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dpledger.ledger import PrivacyLedger
from dpledger.mechanisms.correlated import ParticipationSchema, tree_factorization
from dpledger.mechanisms.correlated.release import release_event
from dpledger.report import build_report, render_markdown
from dpledger.report.build import load_audit
from dpledger.report.markdown import escape_markdown
from tests.report.conftest import DELTA

HOSTILE = "<script>alert(1)</script>\n## FAKE verification ok\n| x | [a](javascript:x) `c` *e*"


def _hostile_report(tmp_path: Path):  # type: ignore[no-untyped-def]
    path = tmp_path / f"run{HOSTILE.replace('/', '_')}.dpl"
    with PrivacyLedger(path, metadata={"note": HOSTILE}) as ledger:
        ledger.record_correlated_release(
            release_event(
                tree_factorization(8),
                ParticipationSchema.single(num_steps=8),
                l2_norm_bound=1.0,
                noise_stddev=4.0,
                label=HOSTILE,
            )
        )
        for _ in range(3):
            ledger.record_sample(sampling_probability=0.01)
            ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0, label=HOSTILE)
    audit_file = tmp_path / "audit.json"
    audit_file.write_text(json.dumps({"lower_bound": 0.1, "method": HOSTILE}))
    return build_report(
        path, delta=DELTA, accountants=["rdp"], curve_points=1,
        audit=load_audit(str(audit_file)), audit_source=str(audit_file),
    )  # fmt: skip


@pytest.mark.slow
def test_hostile_strings_reach_the_markdown_as_text_only(tmp_path: Path) -> None:
    markdown = render_markdown(_hostile_report(tmp_path))
    assert "<script" not in markdown and "<" not in markdown.replace("&lt;", "")
    lines = markdown.splitlines()
    assert not any(re.match(r"\s*#+\s*FAKE", line) for line in lines)
    assert [line.split(" ")[0] for line in lines if line.startswith("#")].count("#") == 1
    # The hostile label shows, escaped, in the query table, the release table and the audit.
    shown = escape_markdown(HOSTILE)
    assert markdown.count(shown) >= 4  # file name (title and table), label, release, method
    # Tables keep their columns: every row of a table has as many cells as its header.
    for block in re.split(r"\n\n", markdown):
        rows = [r for r in block.splitlines() if r.startswith("|")]
        if rows:
            cells = {len(re.split(r"(?<!\\)\|", r)) for r in rows}
            assert len(cells) == 1, block


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("<b>&amp;", "&lt;b&gt;&amp;amp;"),
        ("a\nb\r\u2028c", "a\\\\nb\\\\r\\\\u2028c"),
        ("[x](y) ![i](u)", "\\[x\\](y) \\!\\[i\\](u)"),
        ("*e* _u_ `c` ~s~ # | \\", "\\*e\\* \\_u\\_ \\`c\\` \\~s\\~ \\# \\| \\\\"),
        ("ε = 1.5 (upper bound), δ = 1e-05", "ε = 1.5 (upper bound), δ = 1e-05"),
    ],
)
def test_escape_markdown(text: str, shown: str) -> None:
    assert escape_markdown(text) == shown
