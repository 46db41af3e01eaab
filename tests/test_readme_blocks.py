"""Every code block of the README and of the docs pages runs as pasted.

A reader pastes a page's blocks in order into one session in a fresh folder: the ```python
blocks into one Python interpreter (the names one block defines are there for the next), the
```bash blocks into a shell (``dpledger ...`` on the files the Python blocks wrote). That is what
this test does, page by page, in one subprocess per page, in a fresh temporary folder that holds
nothing but a link to the repository's ``examples/`` (the pages run their commands "from the
repository root"). A page passes when every block succeeds, no ``dpledger`` command warns on
stderr, no warning of dpledger's own categories is raised, and every ledger file left behind ends
with its close marker (an unclosed ledger makes every later ``dpledger epsilon`` warn).

Not run: the README's two setup commands (they create virtual environments; CI runs the second
one, ``tests/test_cli_readme.py`` checks both), and a block right after the comment
``<!-- not-run: reason -->``, which should be rare: code of another library shown for comparison,
an include of a script that a test runs on its own, a cluster or a training of hundreds of models.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

_FIRST = ("README.md", "docs/getting-started.md")
_DOCS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md"))

_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
_NOT_RUN = re.compile(r"<!-- not-run: (\S[^>]*?) -->\s*$")
_SETUP = re.compile(r"^python3\.11 -m venv ")
_SEED_KEYWORD = re.compile(r"\bseed\s*=")


def runnable_blocks(text: str) -> list[tuple[str, str]]:
    """The (language, code) of the ```python and ```bash blocks of a Markdown text that run, in
    order: not those marked ``<!-- not-run: reason -->`` on the line right before the fence, nor
    the README's setup commands (``python3.11 -m venv ...``)."""
    blocks = []
    for match in _FENCE.finditer(text):
        language, code = match.group(1), match.group(2)
        if language not in ("python", "bash"):
            continue
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        if _NOT_RUN.search(before):
            continue
        if language == "bash" and _SETUP.match(code):
            continue
        blocks.append((language, code))
    return blocks


PAGES = tuple(
    page
    for page in (*_FIRST, *(page for page in _DOCS if page not in _FIRST))
    if runnable_blocks((ROOT / page).read_text(encoding="utf-8"))
)
"""The pages with a block that runs: the README, the getting-started page, then every other page
of docs/ (the concepts, the how-to guides, the reference, ...); a page whose blocks are all
marked not-run, or that has none, has nothing to run."""


_DRIVER = r"""
import json, os, subprocess, sys, traceback, warnings

blocks, report_path = json.load(open(sys.argv[1], encoding="utf-8")), sys.argv[2]
report = {"failed": None, "commands": [], "warnings": []}
namespace = {"__name__": "__main__"}
for index, (language, code) in enumerate(blocks):
    label = f"block {index + 1} ({language})"
    if language == "python":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                exec(compile(code, f"<{label}>", "exec"), namespace)
            except BaseException:
                report["failed"] = f"{label} raised:\n{traceback.format_exc()}\n{code}"
        for w in caught:
            module = getattr(w.category, "__module__", "")
            report["warnings"].append([label, f"{module}.{w.category.__name__}", str(w.message)])
    else:
        proc = subprocess.run(
            ["bash", "-e", "-u", "-o", "pipefail", "-c", code], capture_output=True, text=True
        )
        sys.stdout.write(proc.stdout)
        report["commands"].append([label, code, proc.returncode, proc.stderr])
        if proc.returncode != 0:
            report["failed"] = f"{label} exited with {proc.returncode}:\n{code}\n{proc.stderr}"
    if report["failed"]:
        break
from dpledger import PrivacyLedger
report["unclosed"] = [
    name for name in sorted(os.listdir("."))
    if name.endswith(".dpl") and not PrivacyLedger.load(name).closed_cleanly
]
json.dump(report, open(report_path, "w", encoding="utf-8"))
"""


def run_page(page: str, folder: Path) -> dict[str, object]:
    """Run the page's blocks in order in ``folder``, in one Python subprocess; its report."""
    blocks = runnable_blocks((ROOT / page).read_text(encoding="utf-8"))
    bin_dir = folder / ".bin"
    bin_dir.mkdir()
    for name, command in (("dpledger", "-m dpledger"), ("python", "")):
        shim = bin_dir / name  # this checkout's dpledger, also under PYTHONPATH=. in a command
        shim.write_text(
            f'#!/bin/sh\nPYTHONPATH="{ROOT}:$PYTHONPATH" exec "{sys.executable}" {command} "$@"\n',
            encoding="utf-8",
        )
        shim.chmod(0o755)
    work = folder / "work"
    work.mkdir()
    (work / "examples").symlink_to(ROOT / "examples")
    (folder / "blocks.json").write_text(json.dumps(blocks), encoding="utf-8")
    (folder / "driver.py").write_text(_DRIVER, encoding="utf-8")
    env = {
        **os.environ,
        "PATH": os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")]),
        "PYTHONPATH": str(ROOT),
        "MPLBACKEND": "Agg",
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }
    report_path = folder / "report.json"
    proc = subprocess.run(
        [sys.executable, str(folder / "driver.py"), str(folder / "blocks.json"), str(report_path)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0 and report_path.is_file(), (
        f"{page}: the driver failed (exit status {proc.returncode}):\n{proc.stderr[-4000:]}"
    )
    return json.loads(report_path.read_text(encoding="utf-8"))


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_every_block_of_the_page_runs_as_pasted(page: str, tmp_path: Path) -> None:
    report = run_page(page, tmp_path)
    assert report["failed"] is None, f"{page}: {report['failed']}"
    assert report["commands"] or page != "README.md", "the README's dpledger commands did not run"
    for label, code, _, stderr in report["commands"]:  # type: ignore[misc]
        warned = [line for line in stderr.splitlines() if re.match(r"dpledger \S+: warning", line)]
        assert not warned, f"{page}, {label}:\n{code}\nwarned:\n" + "\n".join(warned)
    ours = [w for w in report["warnings"] if w[1].startswith("dpledger.")]  # type: ignore[union-attr]
    assert not ours, f"{page}: dpledger warnings: {ours}"
    assert report["unclosed"] == [], f"{page}: ledgers left without a close marker"


def test_pages_have_blocks_and_the_marker_is_honoured() -> None:
    concepts = [f"docs/concepts/{name}.md" for name in ("accountants", "ledger", "mechanisms")]
    assert {*concepts, "docs/correlated-noise.md", "docs/ledger-format.md"} <= set(PAGES)
    readme = runnable_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
    assert [lang for lang, _ in readme].count("python") >= 3  # two quick starts, accounting
    assert any(code.startswith("dpledger report") for lang, code in readme if lang == "bash")
    text = (
        "```bash\npython3.11 -m venv .venv && pip install .\n```\n"
        "<!-- not-run: another library's code, for comparison -->\n```python\nimport opacus\n```\n"
        "```python\nx = 1\n```\n"
        "```text\nnot code\n```\n"
        "```bash\ndpledger info x.dpl\n```\n"
    )
    assert runnable_blocks(text) == [("python", "x = 1\n"), ("bash", "dpledger info x.dpl\n")]


@pytest.mark.slow
def test_a_failing_block_and_an_unclosed_ledger_are_reported(tmp_path: Path) -> None:
    """The driver stops at the first block that fails, and lists a ledger left open."""
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nfrom dpledger import PrivacyLedger\n"
        "ledger = PrivacyLedger('open.dpl')\n"
        "ledger.record_sample(sampling_probability=0.1, population_size=100)\n"
        "ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0)\nledger.flush()\n```\n"
        "```bash\ndpledger epsilon open.dpl --delta 1e-5 --accountant rdp\n```\n"
        "```python\nundefined_name\n```\n"
        "```python\nraise SystemExit('not reached')\n```\n",
        encoding="utf-8",
    )
    folder = tmp_path / "run"
    folder.mkdir()
    report = run_page(str(page), folder)  # an absolute path: ROOT / page is page
    assert "NameError" in report["failed"] and "undefined_name" in report["failed"]  # type: ignore[operator]
    ((_, _, status, stderr),) = report["commands"]  # type: ignore[misc]
    assert status == 0 and "dpledger epsilon: warning" in stderr  # what the page test refuses
    assert report["unclosed"] == ["open.dpl"]


def test_the_readme_is_short_and_its_quick_starts_do_not_seed_the_noise() -> None:
    """At most 250 lines, the depth is in docs/; ``seed=`` of make_private or DPKerasModel seeds
    the noise and the sampler, so a quick start seeds only the data and the model."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    for _, code in runnable_blocks(text):
        assert not _SEED_KEYWORD.search(code), f"a README block passes seed=:\n{code}"
