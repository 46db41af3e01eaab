"""Smoke test of the clipping study (benchmarks/clipping_study.py) in its ``--quick`` mode."""

from __future__ import annotations

import math
import runpy
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

from dpledger.accountants import PrvAccountant  # noqa: E402

pytestmark = pytest.mark.slow  # the module's fixture runs the clipping study

STUDY = Path(__file__).resolve().parents[2] / "benchmarks" / "clipping_study.py"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    module = runpy.run_path(str(STUDY))
    out = tmp_path_factory.mktemp("study")
    threads = torch.get_num_threads()
    try:
        result = module["main"](["--quick", "--out-dir", str(out)])
    finally:
        torch.set_num_threads(threads)
    return module, result, out


def test_the_table_has_every_method_with_finite_metrics(quick):
    module, result, _ = quick
    methods = module["METHODS"]
    assert set(methods) == {"flat", "global", "automatic", "bam", "non-private"}
    assert list(result.summaries) == list(methods)
    table = module["results_table"](result.summaries)
    for method in methods:
        assert f"| {method} | " in table
        summary = result.summaries[method]
        assert summary.diverged == 0
        for key in ("accuracy", "nll", "ece", "mce"):
            assert math.isfinite(summary.mean[key]) and math.isfinite(summary.std[key])
        assert 0.0 <= summary.mean["accuracy"] <= 1.0
        assert 0.0 <= summary.mean["ece"] <= summary.mean["mce"] <= 1.0
        # 15 equal-width bins on every run's test predictions.
        for run in result.final[method]:
            assert len(run.metrics.reliability.count) == 15
            assert run.metrics.reliability.count.sum() == len(run.probabilities)
    bias = module["bias_table"](result.summaries)
    for method in module["DP_METHODS"]:
        means = result.summaries[method].mean
        for key in ("bias_norm", "magnitude_error", "directional_error_norm", "cosine"):
            assert math.isfinite(means[key])
        assert f"| {method} | " in bias
        for run in result.final[method]:
            # One bias record per step (an empty Poisson batch, probability 0.95^1149, has none).
            assert len(run.bias_curves["bias_norm"]) == result.steps
    assert math.isfinite(result.summaries["bam"].mean["vs_plain_bias_norm"])
    assert result.summaries["non-private"].epsilon is None


def test_every_dp_run_replays_to_the_same_epsilon(quick):
    module, result, _ = quick
    accountant = PrvAccountant()
    epsilons = {}
    for method in module["DP_METHODS"]:
        assert result.summaries[method].epsilon is not None
        for run in result.final[method]:
            ledger = run.ledger
            assert ledger.num_steps == result.steps
            # S in the ledger is the bound the method's clipping enforced.
            assert {q.l2_norm_bound for step in ledger.steps() for q in step.queries} == {
                run.config.bound
            }
            epsilons[(method, run.seed)] = accountant.epsilon(ledger, delta=module["DELTA"]).epsilon
    reference = next(iter(epsilons.values()))
    for key, eps in epsilons.items():
        assert math.isclose(eps, reference, rel_tol=1e-9), key
        assert eps <= module["TARGET_EPSILON"]
        assert eps == pytest.approx(result.epsilons[key[0]][0], rel=1e-12)


def test_the_plots_are_written(quick):
    _, _, out = quick
    for name in ("clipping_study_reliability.png", "clipping_study_bias.png"):
        path = out / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
