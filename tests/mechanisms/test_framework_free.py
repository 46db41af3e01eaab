"""The mechanisms package is framework-free: it never imports torch or tensorflow."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import dpledger.mechanisms

PACKAGE = pathlib.Path(dpledger.mechanisms.__file__).parent
FORBIDDEN = {"torch", "tensorflow", "jax", "keras"}


def test_no_framework_import_statements() -> None:
    for path in PACKAGE.glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = {(node.module or "").split(".")[0]}
            else:
                continue
            assert not roots & FORBIDDEN, f"{path.name} imports {roots & FORBIDDEN}"
        assert "importlib" not in path.read_text(encoding="utf-8"), path.name


def test_importing_mechanisms_loads_no_framework() -> None:
    code = (
        "import sys, dpledger.mechanisms; "
        f"print(sorted(m for m in {sorted(FORBIDDEN)!r} if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=PACKAGE.parent.parent,
    )
    assert out.stdout.strip() == "[]"
