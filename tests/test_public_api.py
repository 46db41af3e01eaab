"""The public face: each package's ``__all__`` lists what its users call, within a budget.

A package exports its entry points, the classes users construct or catch and the results they
read; everything else stays importable from the module that defines it. The count is static (the
``__all__`` literal of every package's ``__init__.py``), so it covers the framework adapters
without importing PyTorch or TensorFlow.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "dpledger"
MAX_PACKAGE_LEVEL_NAMES = 120
FRAMEWORKS = {"dpledger.adapters.torch": "torch", "dpledger.adapters.tensorflow": "tensorflow"}


def _package_exports() -> dict[str, list[str]]:
    """``{package: __all__}`` for every package under ``dpledger/``, read from its source."""
    exports = {}
    for init in sorted(PACKAGE_ROOT.rglob("__init__.py")):
        package = ".".join(init.parent.relative_to(PACKAGE_ROOT.parent).parts)
        names = None
        for node in ast.parse(init.read_text(encoding="utf-8")).body:
            target = node.target if isinstance(node, ast.AnnAssign) else None
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target = node.targets[0]
            if isinstance(target, ast.Name) and target.id == "__all__":
                assert node.value is not None, f"{package}: __all__ without a value"
                names = ast.literal_eval(node.value)
        assert names is not None, f"{package} has no __all__ (a literal list of names)"
        exports[package] = list(names)
    return exports


EXPORTS = _package_exports()


def test_the_walk_finds_every_package() -> None:
    assert {"dpledger", "dpledger.ledger", "dpledger.adapters.torch"} <= set(EXPORTS)
    assert len(EXPORTS) >= 15


def test_package_level_names_stay_within_budget() -> None:
    counts = {package: len(names) for package, names in EXPORTS.items()}
    total = sum(counts.values())
    assert total <= MAX_PACKAGE_LEVEL_NAMES, f"{total} package-level names: {counts}"
    for package, names in EXPORTS.items():
        assert len(set(names)) == len(names), f"{package}: a name listed twice in __all__"


@pytest.mark.parametrize("package", sorted(EXPORTS))
def test_every_exported_name_is_importable_from_its_package(package: str) -> None:
    for prefix, framework in FRAMEWORKS.items():
        if package.startswith(prefix):
            pytest.importorskip(framework)
    module = importlib.import_module(package)
    assert list(module.__all__) == EXPORTS[package]
    for name in module.__all__:
        namespace: dict[str, object] = {}
        exec(f"from {package} import {name}", namespace)
        assert namespace[name] is getattr(module, name)


@pytest.mark.parametrize(
    ("package", "name", "home"),
    [
        ("dpledger", "LedgerError", "dpledger.errors"),
        ("dpledger", "CompressedLedger", "dpledger.ledger.steps"),
        ("dpledger.ledger", "step_noise_multiplier", "dpledger.ledger.steps"),
        ("dpledger.mechanisms", "allocate", "dpledger.mechanisms.allocation"),
        ("dpledger.sampling", "PendingDraws", "dpledger.sampling.draws"),
        ("dpledger.adapters.torch", "expand_factors", "dpledger.adapters.torch.factors"),
        ("dpledger.adapters.torch", "split_batch", "dpledger.adapters.torch.virtual_batches"),
        (
            "dpledger.adapters.torch",
            "squared_norms_of",
            "dpledger.adapters.torch.functional_gradients",
        ),
        ("dpledger.adapters.torch", "unregister_layer_rule", "dpledger.adapters.torch.registry"),
        ("dpledger.adapters.torch", "NoiseStreamEndError", "dpledger.errors"),
        ("dpledger.adapters.tensorflow", "DenseRule", "dpledger.adapters.tensorflow.layer_rules"),
        ("dpledger.adapters.tensorflow", "LayerCall", "dpledger.adapters.tensorflow.registry"),
    ],
)
def test_internals_stay_in_their_module_not_in_the_package(
    package: str, name: str, home: str
) -> None:
    for prefix, framework in FRAMEWORKS.items():
        if package.startswith(prefix):
            pytest.importorskip(framework)
    module = importlib.import_module(package)
    assert name not in module.__all__
    assert not hasattr(module, name), f"{package}.{name} is still in the package namespace"
    assert hasattr(importlib.import_module(home), name)


def test_the_top_level_package_re_exports_few_errors() -> None:
    """``dpledger.errors`` holds the whole hierarchy; the top level keeps the two most code
    catches (the base and invalid parameters)."""
    import dpledger
    from dpledger import errors

    reexported = {name for name in dpledger.__all__ if hasattr(errors, name)}
    assert reexported == {"DPLedgerError", "InvalidParameterError"}
