"""The documentation site builds without a warning, and the public API it documents has docstrings.

``mkdocs build --strict`` (``mkdocs.yml`` at the repository root, sources in ``docs/``) fails on
any warning: a broken link or anchor, a reference mkdocstrings cannot resolve, a docstring whose
``Args:`` name a parameter the signature lacks, an include that is missing. The build runs with
stand-ins for ``torch`` and ``tensorflow`` that raise on import, so the test also proves that the
API reference is read by static analysis (griffe) and needs neither framework.

The docstring check is static too (griffe, no import): every name in ``__all__`` of a documented
package that is a class or a function, and every public method of such a class, has a docstring.

The code blocks of the pages run in ``tests/test_readme_blocks.py``, in order, as pasted.
"""

from __future__ import annotations

import argparse
import html
import math
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import griffe
import pytest

from dpledger.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent

DOCUMENTED_MODULES = (
    "dpledger",
    "dpledger.errors",
    "dpledger.ledger",
    "dpledger.mechanisms",
    "dpledger.mechanisms.allocation",
    "dpledger.mechanisms.correlated",
    "dpledger.mechanisms.correlated.strategies",
    "dpledger.sampling",
    "dpledger.accountants",
    "dpledger.accountants.interop",
    "dpledger.adapters.torch",
    "dpledger.adapters.torch.registry",
    "dpledger.adapters.torch.layer_rules",
    "dpledger.adapters.tensorflow",
    "dpledger.adapters.tensorflow.registry",
    "dpledger.checks",
    "dpledger.checks.torch_step",
    "dpledger.checks.keras_step",
    "dpledger.audit",
    "dpledger.audit.privacy_bounds",
    "dpledger.audit.threshold_selection",
    "dpledger.audit.canaries",
    "dpledger.audit.torch_audit",
    "dpledger.diagnostics",
    "dpledger.diagnostics.model_calibration",
    "dpledger.report",
)
"""The modules whose ``:::`` pages make up the API reference (``docs/reference/api/``)."""

_BLOCKED_FRAMEWORK = (
    "raise ImportError('the documentation build must not import {name}: the API reference is "
    "built by static analysis')\n"
)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built by ``mkdocs build --strict`` into a temporary folder."""
    tmp = tmp_path_factory.mktemp("docs")
    blocked = tmp / "blocked"
    for name in ("torch", "tensorflow", "keras"):
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text(_BLOCKED_FRAMEWORK.format(name=name))
    site_dir = tmp / "site"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(blocked), str(ROOT)]),
        "NO_MKDOCS_2_WARNING": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, (
        f"mkdocs build --strict failed (exit status {proc.returncode}):\n"
        f"{proc.stdout}\n{proc.stderr}"
    )
    return site_dir


def _text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


@pytest.mark.slow
def test_the_site_has_its_pages(site: Path) -> None:
    for page in (
        "index.html",
        "getting-started/index.html",
        "concepts/ledger/index.html",
        "concepts/mechanisms/index.html",
        "concepts/sampling/index.html",
        "concepts/accountants/index.html",
        "how-to/migrate-from-opacus/index.html",
        "how-to/migrate-from-tf-privacy/index.html",
        "how-to/review-a-run/index.html",
        "how-to/calibrate/index.html",
        "how-to/audit/index.html",
        "how-to/federated-flower/index.html",
        "architecture/index.html",
        "guarantees/index.html",
        "ledger-format/index.html",
        "clipping-study/index.html",
        "img/clipping_study_bias.png",
    ):
        assert (site / page).is_file(), f"{page} is missing from the built site"


def test_the_api_reference_documents_the_public_packages(site: Path) -> None:
    api = site / "reference" / "api"
    expected = {
        "ledger": ["dpledger.ledger.PrivacyLedger", "dpledger.ledger.PrivacyLedger.record_sample"],
        "mechanisms": ["dpledger.mechanisms.GaussianSumQuery", "dpledger.mechanisms.DPConfig"],
        "sampling": ["dpledger.sampling.PoissonSampler", "dpledger.sampling.ShuffleScheme"],
        "accountants": [
            "dpledger.accountants.PrvAccountant",
            "dpledger.accountants.interop.ledger_from_opacus_history",
        ],
        "adapters-torch": ["dpledger.adapters.torch.DPOptimizer"],
        "adapters-tensorflow": ["dpledger.adapters.tensorflow.DPKerasModel"],
        "checks": ["dpledger.checks.DPSGDChecker", "dpledger.checks.torch_step.check_dp_sgd"],
        "audit": ["dpledger.audit.run_distinguishing_game"],
        "diagnostics": ["dpledger.diagnostics.clipping_bias"],
        "report": ["dpledger.report.build_report"],
        "errors": ["dpledger.errors.InvalidParameterError"],
    }
    for page, anchors in expected.items():
        markup = _text(api / page / "index.html")
        for anchor in anchors:
            assert f'id="{anchor}"' in markup, f"reference/api/{page}: no entry for {anchor}"


@pytest.mark.slow
def test_every_exported_name_has_an_entry(site: Path) -> None:
    """Each name in ``__all__`` of a documented module (but its submodules) has an entry on the
    module's reference page, documented or not: a public name never silently drops out."""
    package = _load_as_documented("dpledger", ROOT)
    pages = {
        module: site / "reference" / "api" / page.stem / "index.html"
        for page in (ROOT / "docs" / "reference" / "api").glob("*.md")
        for module in re.findall(r"^::: (\S+)$", page.read_text(encoding="utf-8"), re.M)
    }
    missing = []
    for name in DOCUMENTED_MODULES:
        if name == "dpledger":  # its names are re-exports, documented on their own pages
            continue
        module = package[name.removeprefix("dpledger.")]
        markup = _text(pages[name])
        for export in module.exports or []:
            member = module[str(export)]
            target = member.final_target if member.is_alias else member
            if not target.is_module and f'id="{name}.{export}"' not in markup:
                missing.append(f"{name}.{export}")
    assert not missing, "exported but not in the API reference: " + ", ".join(missing)


def test_attrs_classes_show_their_constructor(site: Path) -> None:
    """The griffe extension writes the ``__init__`` attrs generates: DPConfig's fields are its
    parameters (the docstring's ``Args:``), with their defaults."""
    markup = _text(site / "reference" / "api" / "mechanisms" / "index.html")
    start = markup.index('id="dpledger.mechanisms.DPConfig"')
    signature = re.sub(r"<[^>]+>", "", markup[start : start + 20_000])
    for parameter in ("l2_norm_bound", "noise_multiplier", "clip_split", "clip_margin"):
        assert parameter in signature


def test_docstring_roles_become_links_and_examples_render_as_code(site: Path) -> None:
    """Sphinx roles in docstrings link to their target's entry (here ``:class:`PrivacyLedger```
    in the mechanisms, rendered on the ledger page); none is left as raw text, nor a reST
    ``text::`` literal block; an ``Example:`` doctest renders as a code block, not as a
    paragraph."""
    api = site / "reference" / "api"
    mechanisms = _text(api / "mechanisms" / "index.html")
    assert 'href="../ledger/#dpledger.ledger.PrivacyLedger"' in mechanisms
    for page in api.glob("*/index.html"):
        markup = _text(page)
        assert ":class:`" not in markup and ":func:`" not in markup, page
        assert "::</p>" not in markup, f"{page}: a reST literal block was left as text"
    example = mechanisms[mechanisms.index('id="dpledger.mechanisms.GaussianSumQuery"') :]
    doctest = example[: example.index("Attributes:") if "Attributes:" in example else None]
    assert "[(3, 2), (2,)]" in re.sub(r"<[^>]+>", "", doctest)
    assert '<span class="gp">&gt;&gt;&gt; </span>' in doctest  # a highlighted console prompt
    assert "<p>&gt;&gt;&gt;" not in doctest


def test_examples_are_included_from_the_tested_scripts(site: Path) -> None:
    """The code of ``examples/ledger_demo.py`` and ``examples/numpy_logistic_regression.py`` is
    included from the files themselves (pymdownx.snippets), not copied."""
    demo = re.sub(r"<[^>]+>", "", _text(site / "getting-started" / "index.html"))
    assert "POPULATION = 60_000" in demo and "ledger.record_sum_query" in demo
    numpy_example = re.sub(r"<[^>]+>", "", _text(site / "concepts" / "mechanisms" / "index.html"))
    assert "split_clip_by_dimension(total_l2_norm_bound=TOTAL_CLIP" in numpy_example


def test_links_to_the_benchmark_results_lead_to_the_benchmarks_page(site: Path) -> None:
    """``docs/guarantees.md`` links to ``../benchmarks/RESULTS.md`` (right on GitHub); on the site
    the link leads to the page that includes that file."""
    assert 'href="../benchmarks/"' in _text(site / "guarantees" / "index.html")


def test_the_cli_reference_lists_every_command_and_option(site: Path) -> None:
    """Generated from :func:`dpledger.cli.build_parser` at build time: compared with it here."""
    markup = _text(site / "reference" / "cli" / "index.html")
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert len(commands.choices) >= 6
    for name, sub in commands.choices.items():
        assert f'id="dpledger-{name}"' in markup, f"no section for dpledger {name}"
        for action in sub._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert flag in markup, f"dpledger {name}: option {flag} is not documented"


def test_the_benchmarks_page_includes_the_results(site: Path) -> None:
    page = html.unescape(re.sub(r"<[^>]+>", "", _text(site / "benchmarks" / "index.html")))
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    headings = re.findall(r"^## (.+)$", results, flags=re.MULTILINE)
    assert headings
    for heading in headings:
        words = re.sub(r"[`*]", "", heading).split()[:3]
        assert " ".join(words) in page, f"benchmarks page lacks the section {heading!r}"


def test_the_docstring_check_covers_every_reference_page() -> None:
    """``DOCUMENTED_MODULES`` are exactly the modules of the ``:::`` directives of the API pages."""
    pages = sorted((ROOT / "docs" / "reference" / "api").glob("*.md"))
    directives = {
        module
        for page in pages
        for module in re.findall(r"^::: (\S+)$", page.read_text(encoding="utf-8"), re.M)
    }
    assert directives == set(DOCUMENTED_MODULES)


def _undocumented(package: griffe.Module, module_names: tuple[str, ...]) -> tuple[int, list[str]]:
    """How many exported classes and functions were walked, and those (or their public
    methods) without a docstring, by public import path."""
    walked, missing = 0, []
    for name in module_names:
        root = package.path
        module = package if name == root else package[name.removeprefix(f"{root}.")]
        assert module.exports is not None, f"{name} has no __all__"
        for export in module.exports:
            member = module[str(export)]
            target = member.final_target if member.is_alias else member
            if not (target.is_class or target.is_function):
                continue
            walked += 1
            public_name = f"{name}.{export}"
            if not (target.docstring and target.docstring.value.strip()):
                missing.append(f"{public_name} ({target.filepath}:{target.lineno})")
            if not target.is_class:
                continue
            for method_name, method in target.members.items():
                if method_name.startswith("_") or method.is_alias or not method.is_function:
                    continue
                if not (method.docstring and method.docstring.value.strip()):
                    missing.append(
                        f"{public_name}.{method_name} ({method.filepath}:{method.lineno})"
                    )
    return walked, missing


def _load_as_documented(name: str, search_path: Path) -> griffe.Module:
    """The package as the API reference sees it: griffe with the site's extension
    (``docs/_hooks/griffe_dpledger.py``: attrs constructors, bound methods as functions)."""
    extension = f"{ROOT / 'docs' / '_hooks' / 'griffe_dpledger.py'}:DpledgerDocs"
    return griffe.load(
        name,
        search_paths=[str(search_path)],
        resolve_aliases=True,
        extensions=griffe.load_extensions(extension),
    )


@pytest.mark.slow
def test_every_public_class_and_function_has_a_docstring() -> None:
    """Static (griffe, nothing imported): ``__all__`` of every documented module, and the public
    methods of its classes. The failure names each by its public import path and its source."""
    package = _load_as_documented("dpledger", ROOT)
    walked, missing = _undocumented(package, DOCUMENTED_MODULES)
    assert walked > 200, "the walk found almost nothing: is __all__ still read?"
    assert not missing, "public API without a docstring:\n" + "\n".join(missing)


def test_the_docstring_walk_names_what_is_undocumented(tmp_path: Path) -> None:
    """The same walk on a planted package names its undocumented function and method, and
    neither the documented ones nor private names."""
    package = tmp_path / "planted"
    package.mkdir()
    (package / "__init__.py").write_text(
        '"""A package."""\n\nfrom planted.core import Thing, documented, helper\n\n'
        '__all__ = ["Thing", "documented", "helper"]\n'
    )
    (package / "core.py").write_text(
        "def helper():\n    return 1\n\n\n"
        'def documented():\n    """Documented."""\n\n\n'
        'class Thing:\n    """A thing."""\n\n'
        "    def run(self):\n        return 2\n\n"
        "    def _private(self):\n        return 3\n\n"
        '    def stop(self):\n        """Stop."""\n'
    )
    loaded = _load_as_documented("planted", tmp_path)
    walked, missing = _undocumented(loaded, ("planted",))
    assert walked == 3
    assert [entry.split(" ")[0] for entry in missing] == ["planted.Thing.run", "planted.helper"]


@pytest.fixture(scope="module")
def ledger_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding ``demo.dpl`` as ``examples/ledger_demo.py`` writes it."""
    folder = tmp_path_factory.mktemp("ledgers")
    argv = sys.argv
    sys.argv = ["ledger_demo.py", str(folder / "demo.dpl")]
    try:
        runpy.run_path(str(ROOT / "examples" / "ledger_demo.py"), run_name="__main__")
    finally:
        sys.argv = argv
    return folder


def _quoted_block(page: str, after: str) -> list[str]:
    """The lines of the first ```text block after ``after`` on a docs page."""
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    start = text.index(after)
    block = re.search(r"```text\n(.*?)\n```", text[start:], re.S)
    assert block, f"{page}: no text block after {after!r}"
    return block.group(1).splitlines()


def _numbers_of_rows(lines: list[str]) -> dict[str, list[str]]:
    """Accountant rows of ``dpledger epsilon``: name → epsilon, kind, lower, upper (the seconds
    column, which depends on the machine, left out)."""
    rows = {}
    for line in lines:
        fields = line.split()
        if fields and fields[0] in ("rdp", "prv", "gdp", "pld", "balls_in_bins"):
            rows[fields[0]] = fields[1:5]
    return rows


DELTA = ("--delta", "1e-5")


@pytest.mark.slow
def test_the_quoted_epsilon_table_is_what_the_command_prints(ledger_files: Path) -> None:
    """The ε table on the getting-started page is the output of ``dpledger epsilon`` on the demo
    ledger, every accountant's number, kind and bounds (not the seconds)."""
    quoted = _numbers_of_rows(
        _quoted_block("getting-started.md", "dpledger epsilon demo.dpl --delta 1e-5")
    )
    assert set(quoted) == {"rdp", "prv", "gdp", "pld"}
    proc = subprocess.run(
        [sys.executable, "-m", "dpledger", "epsilon", str(ledger_files / "demo.dpl"), *DELTA],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert _numbers_of_rows(proc.stdout.splitlines()) == quoted


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_the_quoted_calibration_is_what_the_accountant_gives(accountant: str) -> None:
    """The noise multipliers quoted on the calibration page (ε = 1 at δ = 1e-5, q = 0.004,
    T = 10,000) are what ``calibrate_noise_multiplier`` computes, shown as ``dpledger
    calibrate`` shows them: six significant digits, rounded up (towards more noise)."""
    from dpledger.accountants import calibrate_noise_multiplier

    command = "--steps 10000" + ("" if accountant == "prv" else " --accountant rdp") + "\n```"
    quoted = " ".join(_quoted_block("how-to/calibrate.md", command))
    assert f"({accountant}, upper_bound)" in quoted
    shown = float(re.search(r"noise multiplier: ([0-9.]+)", quoted).group(1))  # type: ignore[union-attr]
    z = calibrate_noise_multiplier(
        target_epsilon=1.0,
        delta=1e-5,
        sampling_probability=0.004,
        steps=10_000,
        accountant=accountant,
    ).value
    assert z <= shown < z + 10 ** (math.floor(math.log10(z)) - 5)


def test_a_bound_method_alias_is_documented_as_a_function(tmp_path: Path) -> None:
    """``check = CHECKS.check`` with ``CHECKS = Checks(...)``: to static analysis an attribute
    without a docstring; the extension documents it as the function it is at run time."""
    package = tmp_path / "bound"
    package.mkdir()
    (package / "__init__.py").write_text(
        '"""A package."""\n\n\n'
        "class Checks:\n"
        '    """Checks."""\n\n'
        "    def __init__(self, kind: str) -> None:\n"
        "        self.kind = kind\n\n"
        "    def check(self, step: int, *, strict: bool = False) -> str:\n"
        '        """Check one step."""\n'
        "        return self.kind\n\n\n"
        'CHECKS = Checks("plain")\n'
        "check = CHECKS.check\n"
        '__all__ = ["check"]\n'
    )
    loaded = _load_as_documented("bound", tmp_path)
    function = loaded["check"]
    assert function.is_function
    assert [p.name for p in function.parameters] == ["step", "strict"]
    assert function.docstring is not None and function.docstring.value == "Check one step."
    walked, missing = _undocumented(loaded, ("bound",))
    assert (walked, missing) == (1, [])
