"""Class names that cannot collide: no adapter class is named like a core class, and each
adapter's samplers carry their framework's suffix (``…BatchSampler`` for PyTorch's
``torch.utils.data`` batch samplers, ``…DatasetSampler`` for the ``tf.data`` samplers).

Read from the source (no framework is imported), so the check runs everywhere.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "dpledger"
CORE = ("ledger", "mechanisms", "accountants", "sampling", "errors.py", "validation.py")


def _classes(*paths: Path) -> dict[str, list[str]]:
    """Public class name → the files defining it, under ``paths``."""
    found: dict[str, list[str]] = {}
    for path in paths:
        files = [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))
        for file in files:
            for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                    found.setdefault(node.name, []).append(file.relative_to(ROOT).as_posix())
    return found


@pytest.mark.slow
def test_no_adapter_class_is_named_like_a_core_class() -> None:
    core = _classes(*(ROOT / part for part in CORE))
    for adapter in ("torch", "tensorflow"):
        clash = {
            name: (files, core[name])
            for name, files in _classes(ROOT / "adapters" / adapter).items()
            if name in core
        }
        assert not clash, f"{adapter} adapter classes named like core classes: {clash}"


def test_each_adapter_names_its_samplers_with_its_suffix() -> None:
    suffixes = {"torch": "BatchSampler", "tensorflow": "DatasetSampler"}
    for adapter, suffix in suffixes.items():
        samplers = [n for n in _classes(ROOT / "adapters" / adapter) if n.endswith("Sampler")]
        assert samplers, adapter
        wrong = [n for n in samplers if not n.endswith(suffix)]
        assert not wrong, f"{adapter} samplers without the {suffix!r} suffix: {wrong}"
