"""``dpledger report`` without matplotlib (the state a plain ``pip install dpledger`` leaves):
the report is written whole, tables and claim included, and says where its plots would be that
they need the ``report`` extra; and a failure at any point leaves no empty or partial file."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dpledger.cli import main
from dpledger.report import html as html_module
from dpledger.report import markdown as markdown_module
from dpledger.report.plots import NO_MATPLOTLIB
from tests.report.conftest import DELTA

ROOT = Path(__file__).resolve().parents[2]

# matplotlib cannot be imported in this process: a finder first on sys.meta_path refuses it
_BLOCKED = textwrap.dedent(
    """
    import sys

    class _NoMatplotlib:
        def find_spec(self, name, path=None, target=None):
            if name == "matplotlib" or name.startswith("matplotlib."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _NoMatplotlib())
    from dpledger.cli import main

    sys.exit(main(sys.argv[1:]))
    """
)


def _run_without_matplotlib(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", _BLOCKED, *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
    )


@pytest.mark.slow
def test_the_report_is_written_whole_without_matplotlib(
    shared_ledger: Path, tmp_path: Path
) -> None:
    page = tmp_path / "report.html"
    out = tmp_path / "review"
    done = _run_without_matplotlib(
        "report", str(shared_ledger), "--delta", str(DELTA), "--curve", "2", "--html", str(page),
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "internal error" not in done.stderr
    assert 'pip install "dpledger[report]"' in done.stderr
    text = page.read_text(encoding="utf-8")
    assert text.rstrip().endswith("</html>")
    assert "Claim: the run is (ε = " in text and "<td>rdp</td>" in text
    assert text.count(NO_MATPLOTLIB.replace('"', "&quot;")) == 2  # ε curve and trade-off
    assert "data:image/png" not in text
    done = _run_without_matplotlib(
        "report", str(shared_ledger), "--delta", str(DELTA), "--curve", "2", "--out", str(out),
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["report.html", "report.json", "report.md"]
    assert all(p.stat().st_size > 0 for p in out.iterdir())


def _fail(*args: object, **kwargs: object) -> str:
    raise RuntimeError("rendering failed")


@pytest.mark.slow
@pytest.mark.parametrize("broken", ["html", "markdown"])
def test_a_failure_midway_leaves_no_file(
    shared_ledger: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch, broken: str,
) -> None:  # fmt: skip
    module = html_module if broken == "html" else markdown_module
    monkeypatch.setattr(module, f"render_{broken}", _fail)
    out = tmp_path / "review"
    common = ["report", str(shared_ledger), "--delta", str(DELTA), "--curve", "1"]
    assert main([*common, "--out", str(out)]) == 2
    assert "rendering failed" in capsys.readouterr().err
    assert not out.exists() or list(out.iterdir()) == []
    page = tmp_path / "report.html"
    assert main([*common, "--html", str(page), "--markdown", str(tmp_path / "report.md")]) == 2
    assert list(tmp_path.iterdir()) == ([out] if out.exists() else [])


@pytest.mark.slow
def test_a_failed_rename_leaves_only_whole_files_and_no_temporary(
    shared_ledger: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    real = os.replace
    calls = []

    def replace_once(src: str, dst: str) -> None:  # the second rename fails (a full disk)
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace_once)
    md = tmp_path / "report.md"
    argv = ["report", str(shared_ledger), "--delta", str(DELTA), "--curve", "1"]
    assert main([*argv, "--markdown", str(md), "--json", str(tmp_path / "r.json")]) == 2
    capsys.readouterr()
    # the first file is whole (it was renamed into place); no temporary is left behind
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]
    assert md.read_text(encoding="utf-8").startswith("# Privacy report: ")
