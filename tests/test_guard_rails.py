"""The linters, the type check and the size rules run as part of the test suite.

``ruff check`` and ``ruff format --check`` cover the whole repository with the configuration in
``pyproject.toml``; ``mypy`` checks the core (the ledger, the mechanisms, the accountants, the
sampling schemes and the top-level modules they import), which must have no type errors. Each
test fails with the tool's own output, so the fix is in the failure message.

The two size rules of ``docs/architecture.md``, "Size rules", are checked on the source: a module
under ``dpledger/`` of more than :data:`MODULE_LINES` lines states why in its module docstring,
and no function of the training hot path (:data:`HOT_PATH`) has more than
:data:`FUNCTION_LINES` lines of code. Their failure messages name each module or function and
its size.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

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


@pytest.mark.slow
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


MODULE_LINES = 500
"""A module under ``dpledger/`` longer than this many lines states why in its docstring."""

SIZE_REASON = re.compile(r"This module is (?:a little )?over 500 lines because\b")
"""How the paragraph that states the reason starts: "This module is over 500 lines because"
(or "This module is a little over 500 lines because")."""

FUNCTION_LINES = 80
"""The most lines of code a function of the training hot path may have, docstring excluded."""

HOT_PATH = (
    # the PyTorch adapter: the engine, the optimizer and its stages, the per-layer rules
    "adapters/torch/engine*",
    "adapters/torch/optimizer*",
    "adapters/torch/accumulation*",
    "adapters/torch/release*",
    "adapters/torch/functional_gradients*",
    "adapters/torch/layer_rules*",
    # the TensorFlow adapter: the engine, PrivateGradients, DPKerasModel, the layer rules
    "adapters/tensorflow/engine*",
    "adapters/tensorflow/private_gradients*",
    "adapters/tensorflow/keras_model*",
    "adapters/tensorflow/layer_rules*",
    # the core: the sum query, clipping, the steps and runs of the ledger
    "mechanisms/sum_query*",
    "mechanisms/clipping*",
    "ledger/steps*",
)
"""The modules of the training hot path (what runs on every training step), as globs relative
to ``dpledger/`` that name modules or packages (a package counts with all its modules). A glob
(``engine*``) also covers what is split out of a module later: ``engine_hooks.py``, or an
``engine/`` package. Every glob must match something, so that a rename updates this list."""


def _package_modules() -> list[Path]:
    return sorted((ROOT / "dpledger").rglob("*.py"))


def _paragraphs(docstring: str) -> list[str]:
    """The paragraphs of a docstring, each on one line."""
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", docstring) if p.strip()]


def _states_its_size(source: str) -> bool:
    docstring = ast.get_docstring(ast.parse(source)) or ""
    return any(SIZE_REASON.match(paragraph) for paragraph in _paragraphs(docstring))


def _code_lines(function: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> int:
    """Lines of code of ``function`` from its ``def`` to its last line: blank lines, comment
    lines and the lines of its docstring do not count (those of a nested function do)."""
    skipped: set[int] = set()
    if ast.get_docstring(function, clean=False) is not None:
        docstring = function.body[0]
        skipped.update(range(docstring.lineno, (docstring.end_lineno or docstring.lineno) + 1))
    first = min([function.lineno, *(d.lineno for d in function.decorator_list)])
    last = function.end_lineno or function.lineno
    count = 0
    for number in range(first, last + 1):
        text = lines[number - 1].strip()
        if number in skipped or not text or text.startswith("#"):
            continue
        count += 1
    return count


def _hot_path_modules() -> dict[str, list[Path]]:
    """The modules each glob of :data:`HOT_PATH` names (a package: all its modules)."""
    package = ROOT / "dpledger"
    found = {}
    for pattern in HOT_PATH:
        paths: set[Path] = set()
        for match in package.glob(pattern):
            if match.is_dir():
                paths.update(match.rglob("*.py"))
            elif match.suffix == ".py":
                paths.add(match)
        found[pattern] = sorted(paths)
    return found


def _long_functions(path: Path) -> list[str]:
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            size = _code_lines(node, lines)
            if size > FUNCTION_LINES:
                found.append(f"{node.name} (line {node.lineno}): {size} lines of code")
    return found


def test_a_long_module_states_why_it_is_long() -> None:
    """Every module under ``dpledger/`` over 500 lines has a docstring paragraph starting "This
    module is over 500 lines because" (docs/architecture.md, "Size rules")."""
    unexplained = []
    for path in _package_modules():
        source = path.read_text(encoding="utf-8")
        size = len(source.splitlines())
        if size > MODULE_LINES and not _states_its_size(source):
            unexplained.append(f"{path.relative_to(ROOT)}: {size} lines")
    assert not unexplained, (
        f"modules over {MODULE_LINES} lines whose docstring has no paragraph starting "
        f'"This module is over {MODULE_LINES} lines because" (split the module, or say why '
        "it is one):\n" + "\n".join(unexplained)
    )


def test_no_function_of_the_hot_path_is_long() -> None:
    """No function in the modules of :data:`HOT_PATH` has more than 80 lines of code, its
    docstring, comments and blank lines excluded (docs/architecture.md, "Size rules")."""
    modules = _hot_path_modules()
    unmatched = [pattern for pattern, paths in modules.items() if not paths]
    assert not unmatched, f"hot-path globs that match no module (update HOT_PATH): {unmatched}"
    long = []
    for paths in modules.values():
        for path in paths:
            long += [f"{path.relative_to(ROOT)}: {f}" for f in _long_functions(path)]
    assert not long, (
        f"functions of the training hot path over {FUNCTION_LINES} lines of code "
        "(docstring excluded):\n" + "\n".join(sorted(set(long)))
    )


def test_the_size_rules_measure_what_they_say(tmp_path: Path) -> None:
    """The two size checks, on planted sources: a long module with and without its reason, and
    a function whose docstring, comments and blank lines do not count."""
    reason = '"""Sums.\n\nThis module is over 500 lines because it is one table.\n"""\n'
    little = '"""Sums.\n\nThis module is a little over 500 lines because it is one table.\n"""'
    assert _states_its_size(reason) and _states_its_size(little)
    assert not _states_its_size('"""Sums; this module is over 500 lines because of a table."""')
    assert not _states_its_size("# This module is over 500 lines because it is one table.\n")
    body = ["    x = 0"] + ["    x += 1"] * 77 + ["    # a comment", "", "    return x"]
    planted = tmp_path / "planted.py"
    planted.write_text('def f():\n    """Counts.\n\n    More.\n    """\n' + "\n".join(body) + "\n")
    assert _long_functions(planted) == []
    planted.write_text("def f():\n" + "\n".join(["    y = 1", *body]) + "\n")
    assert _long_functions(planted) == ["f (line 1): 81 lines of code"]
    modules = _hot_path_modules()
    assert (
        ROOT / "dpledger" / "adapters" / "torch" / "layer_rules" / "linear.py"
        in (modules["adapters/torch/layer_rules*"])
    )
    assert all(path.suffix == ".py" for paths in modules.values() for path in paths)
