"""The names and module paths that moved out of ``dpledger.audit`` still work for one release,
with a DeprecationWarning naming the new location."""

from __future__ import annotations

import importlib
import sys

import pytest

import dpledger.audit
import dpledger.checks
import dpledger.diagnostics


@pytest.mark.parametrize("old_name", sorted(dpledger.audit.MOVED_NAMES))
def test_old_name_warns_and_is_the_moved_object(old_name):
    module, new_name = dpledger.audit.MOVED_NAMES[old_name]
    with pytest.warns(DeprecationWarning, match=rf"{module}\.{new_name}"):
        obj = getattr(dpledger.audit, old_name)
    assert obj is getattr(importlib.import_module(module), new_name)


def test_from_import_of_an_old_name_warns():
    with pytest.warns(DeprecationWarning, match="dpledger.checks.run_checks"):
        from dpledger.audit import run_checks
    assert run_checks is dpledger.checks.run_checks


def test_moved_names_are_not_in_all_and_unknown_names_raise():
    assert not set(dpledger.audit.MOVED_NAMES) & set(dpledger.audit.__all__)
    with pytest.raises(AttributeError):
        dpledger.audit.no_such_name  # noqa: B018


OLD_MODULES = {
    "dpledger.audit.bias": ("dpledger.diagnostics.bias", {"clipping_bias": "clipping_bias"}),
    "dpledger.audit.calibration_metrics": (
        "dpledger.diagnostics.model_calibration",
        {
            "calibration_metrics": "model_calibration_metrics",
            "CalibrationMetrics": "ModelCalibrationMetrics",
        },
    ),
    "dpledger.audit.calibration_torch": (
        "dpledger.diagnostics.model_calibration_torch",
        {"model_calibration": "model_calibration"},
    ),
    "dpledger.audit.checks": (
        "dpledger.checks",
        {"run_checks": "run_checks", "CheckConfig": "CheckConfig"},
    ),
    "dpledger.audit.checks_torch": (
        "dpledger.checks.torch_step",
        {"check_dp_sgd": "check_dp_sgd"},
    ),
    "dpledger.audit.commands": ("dpledger.checks.commands", {"register": "register"}),
    "dpledger.audit.check_report": ("dpledger.checks.report", {"CheckReport": "CheckReport"}),
    "dpledger.audit.synthetic_data": (
        "dpledger.checks.synthetic_data",
        {"ordinary_batch": "ordinary_batch"},
    ),
}


@pytest.mark.parametrize("old_module", sorted(OLD_MODULES))
def test_old_module_path_warns_and_reexports(old_module):
    new_module, names = OLD_MODULES[old_module]
    sys.modules.pop(old_module, None)
    with pytest.warns(DeprecationWarning, match=new_module.replace(".", r"\.")):
        old = importlib.import_module(old_module)
    new = importlib.import_module(new_module)
    for old_name, new_name in names.items():
        assert getattr(old, old_name) is getattr(new, new_name)
