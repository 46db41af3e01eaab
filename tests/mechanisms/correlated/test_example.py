"""The NumPy BandMF example runs end to end: training, the ledger's release, ε."""

from __future__ import annotations

import math
import pathlib
import runpy

import pytest

EXAMPLE = pathlib.Path(__file__).parents[3] / "examples" / "numpy_correlated_noise.py"


def test_numpy_correlated_noise_example(capsys: pytest.CaptureFixture[str]) -> None:
    """Reference for μ: the example's release is k = 10 cyclic participations of a C with
    7 bands ≤ the period 7, so sens(C) = √10 · ‖c‖ (orthogonal columns), μ = sens·S/σ."""
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    out = capsys.readouterr().out
    assert "banded_toeplitz over T=70 steps, cyclic participation (k=10, separation 7)" in out
    from dpledger.mechanisms.correlated import optimize_banded_toeplitz

    coeffs = optimize_banded_toeplitz(num_steps=70, bands=7).params["coefficients"]
    mu = math.sqrt(10) * math.hypot(*coeffs) * 1.0 / 12.0
    assert f"mu = sens(C)·S/σ = {mu:.4f}" in out
    accuracy = float(out.split("test accuracy after 70 BandMF steps: ")[1].split()[0])
    assert accuracy > 0.85  # as the DP-SGD example: noisy steps still learn this easy task
    assert "(pld, upper_bound)" in out and "(rdp, upper_bound)" in out
