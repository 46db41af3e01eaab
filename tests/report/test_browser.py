"""The HTML report in a real browser: headless Chromium renders it without console errors, its
DOM holds the key numbers, and its screenshot is kept as a test artefact.

The test needs a Chromium binary (Debian's ``chromium`` package; ``.ci/run`` installs it) and
is skipped, saying so, only when none is installed. The screenshot is written under pytest's
``tmp_path`` and copied to ``tests/artifacts/`` (git-ignored); both paths are printed.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dpledger.cli import main
from dpledger.report.sections import shown_epsilon
from tests.report.conftest import DELTA

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
_TIMEOUT_S = 120


def _chromium() -> str | None:
    for name in _CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return "/usr/bin/chromium" if Path("/usr/bin/chromium").is_file() else None


CHROMIUM = _chromium()
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no Chromium binary is installed (apt-get install -y chromium; .ci/run does this)",
)


def _browse(page: Path, *mode: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    return subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            "--enable-logging=stderr",
            "--v=0",
            "--window-size=1200,2000",
            *mode,
            page.resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
        check=False,
    )


def _console_messages(stderr: str) -> list[str]:
    """Lines the page wrote to the console, and resources it failed to load. The report has no
    script, so any console message is an error of the page."""
    return [
        line
        for line in stderr.splitlines()
        if ":CONSOLE" in line or "Failed to load resource" in line
    ]


@needs_chromium
def test_the_console_check_sees_an_error(tmp_path: Path) -> None:
    # The check below would pass on a browser that logs nothing: show that it catches errors.
    page = tmp_path / "broken.html"
    page.write_text("<!DOCTYPE html><p>x</p><script>console.error('marker'); nope();</script>")
    result = _browse(page, "--dump-dom")
    messages = _console_messages(result.stderr)
    assert any("marker" in m for m in messages) and any("nope" in m for m in messages)


@needs_chromium
def test_the_report_renders_in_chromium(shared_ledger: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "review"
    code = main(["report", str(shared_ledger), "--delta", str(DELTA), "--out", str(out)])
    capsys.readouterr()
    assert code == 0
    page = out / "report.html"
    data = json.loads((out / "report.json").read_text())

    dom = _browse(page, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert _console_messages(dom.stderr) == []
    text = re.sub(r"\s+", " ", dom.stdout)
    assert data["verification"]["head_hash"] in text
    assert "ok: every line verifies" in text
    for row in data["accountants"]:
        assert (
            f"<td>{row['accountant']}</td><td>{shown_epsilon(row['epsilon'], row['kind'])}</td>"
            in text
        )
    assert "approximation (no guarantee)" in text
    for section in ("verification", "summary", "accountants", "epsilon-curve", "tradeoff"):
        assert f'id="{section}"' in text
    assert 'id="plot-epsilon_curve"' in text and 'id="plot-tradeoff"' in text

    shot = tmp_path / "report.png"
    result = _browse(page, f"--screenshot={shot}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert _console_messages(result.stderr) == []
    assert shot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and shot.stat().st_size > 10_000
    ARTIFACTS.mkdir(exist_ok=True)
    kept = ARTIFACTS / "report-screenshot.png"
    shutil.copyfile(shot, kept)
    print(f"report screenshot: {shot} (kept as {kept})")
