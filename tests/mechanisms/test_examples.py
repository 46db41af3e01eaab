"""The NumPy example runs, and the docstring examples of the mechanisms hold."""

from __future__ import annotations

import doctest
import pathlib
import runpy

import pytest

import dpledger.mechanisms
from dpledger.mechanisms import grouped, sum_query

EXAMPLE = pathlib.Path(__file__).parents[2] / "examples" / "numpy_logistic_regression.py"


@pytest.mark.parametrize("module", [dpledger.mechanisms, sum_query, grouped])
def test_docstring_examples(module: object) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)  # type: ignore[arg-type]
    assert result.attempted > 0
    assert result.failed == 0


def test_numpy_logistic_regression_example(capsys: pytest.CaptureFixture[str]) -> None:
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    out = capsys.readouterr().out
    assert "steps: 60, events: 180" in out
    assert "run: q = 0.1407, z_eff = 1.5" in out
    accuracy = float(out.split("test accuracy after 60 DP steps: ")[1].split()[0])
    assert accuracy > 0.85  # a few noisy steps still learn this easy task
