"""Tests of the audit plots (drawn off-screen)."""

from __future__ import annotations

import numpy as np
import pytest

matplotlib = pytest.importorskip(
    "matplotlib", reason="matplotlib (the plot extra) is not installed"
)
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dpledger.audit.audit_game import run_distinguishing_game  # noqa: E402
from dpledger.audit.audit_plots import plot_bound_versus_runs, plot_score_distributions  # noqa: E402
from dpledger.audit.threshold_selection import HeldOutSplit  # noqa: E402
from dpledger.errors import InvalidParameterError  # noqa: E402
from tests.audit import gaussian_mechanism as gm  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def test_score_distributions_with_threshold(tmp_path):
    game = run_distinguishing_game(gm.buggy_noisy_sum, runs_per_side=50, seed=0)
    bound = game.epsilon_lower_bound(delta=1e-5, confidence=0.95, selection=HeldOutSplit())
    ax = plot_score_distributions(
        game.scores_with_canary, game.scores_without_canary, threshold=bound.threshold, bins=20
    )
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[0].startswith("without canary (50 runs)")
    assert labels[1].startswith("with canary (50 runs)")
    assert labels[2].startswith("threshold")
    assert len(ax.patches) == 40  # two histograms of 20 bins
    ax.figure.savefig(tmp_path / "scores.png")
    assert (tmp_path / "scores.png").stat().st_size > 0
    with pytest.raises(InvalidParameterError):
        plot_score_distributions([1.0], [0.0], bins=0)


def test_bound_versus_runs_plot():
    game = run_distinguishing_game(gm.buggy_noisy_sum, runs_per_side=60, seed=1)
    curve = game.bound_versus_runs(
        [20, 40, 60], delta=1e-5, confidence=0.95, selection=HeldOutSplit()
    )
    ax = plot_bound_versus_runs(curve, claimed_epsilon=2.0)
    line = ax.get_lines()[0]
    np.testing.assert_allclose(line.get_xdata(), [20, 40, 60])
    np.testing.assert_allclose(line.get_ydata(), [b.epsilon for _, b in curve])
    assert ax.get_lines()[1].get_ydata()[0] == 2.0  # the claim
    with pytest.raises(InvalidParameterError):
        plot_bound_versus_runs([])
