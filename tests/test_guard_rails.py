"""The linters and the type check run as part of the test suite.

``ruff check`` and ``ruff format --check`` cover the whole repository with the configuration in
``pyproject.toml``; ``mypy`` checks the core (the ledger, the mechanisms, the accountants, the
sampling schemes and the top-level modules they import), which must have no type errors. Each
test fails with the tool's own output, so the fix is in the failure message.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CORE_TYPE_CHECKED = (
    "dpledger/__init__.py",
    "dpledger/_version.py",
    "dpledger/errors.py",
    "dpledger/validation.py",
    "dpledger/ledger",
    "dpledger/mechanisms",
    "dpledger/accountants",
    "dpledger/sampling",
)
"""What mypy checks, relative to the repository root (a package not yet in the tree is left
out). ``[tool.mypy] files`` in ``pyproject.toml`` names the same paths for a plain ``mypy``."""


def _run(args: list[str], *, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def _report(proc: subprocess.CompletedProcess) -> str:
    return f"exit status {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


def test_ruff_check_is_clean() -> None:
    proc = _run(["ruff", "check", "--no-cache", "."])
    assert proc.returncode == 0, "ruff check . found problems:\n" + _report(proc)


def test_ruff_format_is_clean() -> None:
    proc = _run(["ruff", "format", "--check", "--no-cache", "."])
    assert proc.returncode == 0, "ruff format --check . would reformat files:\n" + _report(proc)


def _mypy(targets: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory(prefix="dpledger-mypy-") as cache:
        return _run(["mypy", "--cache-dir", cache, *targets], env=env)


def test_mypy_finds_no_errors_in_the_core() -> None:
    targets = [path for path in CORE_TYPE_CHECKED if (ROOT / path).exists()]
    assert "dpledger/ledger" in targets and "dpledger/accountants" in targets
    proc = _mypy(targets)
    assert proc.returncode == 0, "mypy found type errors in the core:\n" + _report(proc)


def test_the_checks_report_a_planted_fault(tmp_path: Path) -> None:
    """The same commands, with the project's configuration, fail on a file with known faults."""
    bad = tmp_path / "planted.py"
    bad.write_text("import os\n\n\ndef half(x: int) -> int:\n    return x / 2\n")
    config = str(ROOT / "pyproject.toml")
    lint = _run(["ruff", "check", "--no-cache", "--config", config, str(bad)])
    assert lint.returncode != 0 and "F401" in lint.stdout, _report(lint)
    bad.write_text("pair = ( 1,2 )\n")
    fmt = _run(["ruff", "format", "--check", "--no-cache", "--config", config, str(bad)])
    assert fmt.returncode != 0, _report(fmt)
    bad.write_text("def half(x: int) -> int:\n    return x / 2\n")
    types = _mypy(["--config-file", config, str(bad)])
    assert types.returncode != 0 and "planted.py:2: error" in types.stdout, _report(types)


def test_the_package_ships_type_information() -> None:
    assert (ROOT / "dpledger" / "py.typed").is_file()
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert 'dpledger = ["py.typed"]' in pyproject


_SECTION_CITATION = re.compile(r'docs/architecture\.md`{0,2}, "([^"]+)"')
_ANCHOR_LINK = re.compile(r"\]\((?:docs/)?([a-z-]+\.md)#([^)\s]+)\)")


def _slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _headings(doc: Path) -> list[str]:
    lines = doc.read_text(encoding="utf-8").splitlines()
    return [line.lstrip("#").strip() for line in lines if re.match(r"#{1,6} ", line)]


def _cited_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in ("dpledger", "tests", "benchmarks", "examples"):
        files += sorted((ROOT / folder).rglob("*.py"))
    return files


def test_citations_of_the_docs_name_sections_that_exist() -> None:
    """A section of docs/architecture.md cited in code or docs, and a ``](page.md#anchor)``
    link in Markdown, name headings that exist."""
    sections = set(_headings(ROOT / "docs" / "architecture.md"))
    anchors = {doc.name: {_slug(h) for h in _headings(doc)} for doc in (ROOT / "docs").glob("*.md")}
    broken, cited = [], 0
    for path in _cited_files():
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(ROOT)
        for section in _SECTION_CITATION.findall(text):
            cited += 1
            if section not in sections:
                broken.append(f"{rel}: no section {section!r} in docs/architecture.md")
        if path.suffix == ".md":
            for page, anchor in _ANCHOR_LINK.findall(text):
                cited += 1
                if anchor not in anchors.get(page, set()):
                    broken.append(f"{rel}: no heading for {page}#{anchor}")
    assert cited >= 5, "the citation pattern matched almost nothing: is it still the one used?"
    assert not broken, "\n".join(broken)


def test_slug_follows_github() -> None:
    assert _slug('What "upper bound" means') == "what-upper-bound-means"
    assert _slug("8. What the chain detects, and what it does not") == (
        "8-what-the-chain-detects-and-what-it-does-not"
    )
