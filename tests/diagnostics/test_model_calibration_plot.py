"""Tests of the reliability diagram of the model-calibration metrics (drawn off-screen)."""

from __future__ import annotations

import numpy as np
import pytest

matplotlib = pytest.importorskip(
    "matplotlib", reason="matplotlib (the plot extra) is not installed"
)
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dpledger.diagnostics.model_calibration import (  # noqa: E402
    model_calibration_metrics,
    plot_reliability_diagram,
)
from dpledger.errors import InvalidParameterError  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def test_reliability_diagram():
    probs = np.array([[0.95, 0.05], [0.85, 0.15], [0.25, 0.75], [0.35, 0.65]])
    m = model_calibration_metrics(probs, np.array([0, 1, 1, 1]), num_bins=10)
    ax = plot_reliability_diagram(m)
    heights = sorted(p.get_height() for p in ax.patches)
    assert heights == [0.0, 1.0, 1.0, 1.0]  # one bar per non-empty bin: its accuracy
    assert "ECE 0.375" in ax.get_title()
    with pytest.raises(InvalidParameterError):
        plot_reliability_diagram("not metrics")  # type: ignore[arg-type]
