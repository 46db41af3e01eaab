"""The sampling package is core: it imports neither torch nor tensorflow, not even lazily."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import dpledger.sampling

PACKAGE = pathlib.Path(dpledger.sampling.__file__).parent
FORBIDDEN = {"torch", "tensorflow", "jax", "keras"}


def test_no_framework_import_statements() -> None:
    for path in PACKAGE.glob("*.py"):
        text = path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = {(node.module or "").split(".")[0]}
            else:
                continue
            assert not roots & FORBIDDEN, f"{path.name} imports {roots & FORBIDDEN}"
            assert "adapters" not in (getattr(node, "module", None) or ""), path.name
        assert "importlib" not in text, path.name


def test_sampling_imports_and_works_with_the_frameworks_blocked() -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "sys.modules['tensorflow'] = None\n"
        "import numpy as np\n"
        "import dpledger.sampling as s\n"
        "scheme = s.ShuffleScheme(population_size=10, batch_size=4)\n"
        "sampler = s.PoissonSampler(population_size=5, sampling_probability=0.5,\n"
        "                           generator=np.random.default_rng(0))\n"
        "print(scheme.steps_per_epoch, sampler.sample().size <= 5)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=PACKAGE.parent.parent,
    )
    assert out.stdout.split() == ["3", "True"]
