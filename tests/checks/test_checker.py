"""The framework-free checks on hand-written NumPy DP-SGD steps (linear regression, MSE).

Every experiment is seeded, so each test is deterministic; the statistical ones compare with
oracles computed here (the large point's true gradient norm, the 1/B and k laws of the
per-example design, the noise scale a bug implies) with tolerances from the statistic's own
confidence interval.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from dpledger.checks import CheckConfig, DPSGDChecker, Verdict, run_checks
from dpledger.checks.checker import CHECK_NAMES
from dpledger.checks.step_harness import StepOutcome
from dpledger.errors import InvalidParameterError
from tests.checks.numpy_steps import NumpyLinearHarness

LR = 0.01

#: bug → the checks that must fail (all others must not fail)
EXPECTED_FAILURES = {
    "no_clip": {"clipping_applied"},
    "clip_mean": {"per_example_clipping"},
    "clip_sum": {"per_example_clipping"},
    "uncalibrated": {"noise_calibrated", "noise_magnitude"},
    "noise_over_batch": {"noise_magnitude"},
}


def check(harness, **kw):
    kw.setdefault("learning_rate", LR)
    kw.setdefault("seed", 0)
    return run_checks(harness, input_shape=(harness.dim,), loss="mse", **kw)


# ------------------------------------------------------------------ correct and buggy steps
@pytest.mark.statistical
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("denominator", [None, 16.0])
def test_correct_step_passes_every_check(seed, denominator):
    harness = NumpyLinearHarness(lr=LR, seed=seed, denominator=denominator)
    report = check(harness, seed=seed, denominator="batch" if denominator is None else denominator)
    assert report.verdicts == dict.fromkeys(CHECK_NAMES, Verdict.PASS), report.summary()
    assert report.passed


@pytest.mark.statistical
@pytest.mark.parametrize("bug", sorted(EXPECTED_FAILURES))
@pytest.mark.parametrize("seed", [0, 1])
def test_each_bug_fails_exactly_its_checks(bug, seed):
    report = check(NumpyLinearHarness(lr=LR, seed=seed, bug=bug), seed=seed)
    assert set(report.failed) == EXPECTED_FAILURES[bug], report.summary()
    assert not report.passed


@pytest.mark.statistical
@pytest.mark.parametrize("bug", sorted(EXPECTED_FAILURES))
def test_each_bug_fails_exactly_its_checks_with_a_fixed_denominator(bug):
    harness = NumpyLinearHarness(lr=LR, seed=5, bug=bug, denominator=16.0)
    report = check(harness, seed=5, denominator=16.0)
    assert set(report.failed) == EXPECTED_FAILURES[bug], report.summary()


def test_failure_reasons_name_the_bug():
    reasons = {bug: check(NumpyLinearHarness(lr=LR, bug=bug)) for bug in ("no_clip", "clip_mean")}
    assert "not clipped" in reasons["no_clip"]["clipping_applied"].reason
    assert "aggregate" in reasons["clip_mean"]["per_example_clipping"].reason
    assert "does not shrink with B" in reasons["clip_mean"]["per_example_clipping"].reason
    calib = check(NumpyLinearHarness(lr=LR, bug="uncalibrated"))["noise_calibrated"]
    assert "N(0, σ²)" in calib.reason
    small = check(NumpyLinearHarness(lr=LR, bug="noise_over_batch"))["noise_magnitude"]
    assert "divided by the batch size" in small.reason


# --------------------------------------------------------------------- statistics vs oracles
def test_gradient_norm_estimate_brackets_the_true_norm():
    harness = NumpyLinearHarness(lr=LR, seed=3)
    checker = DPSGDChecker(harness, input_shape=(5,), loss="mse", learning_rate=LR, seed=3)
    result = checker.clipping_applied()
    x, y = checker.pool.batch(1, num_large=1)
    true = float(np.linalg.norm(harness._grads(harness.theta0, x, y)[0]))
    estimate = result.details["gradient_norm_estimate"]
    knee = result.details["clip_norm_knee"]
    grid = np.asarray(checker.config.clip_norms)
    below = grid[grid < knee][-1]
    assert below <= true <= knee  # the knee brackets ‖g‖
    assert below <= estimate <= knee
    assert estimate == pytest.approx(true, rel=0.1)  # second-order terms of the loss change
    assert result.p_value < checker.config.alpha_slope


def test_per_example_curves_follow_one_over_b_and_k():
    # with C ≪ ‖g‖/B the update is (η/B)·k·C·g/‖g‖: its norm is exactly η·k·C/B, and to first
    # order the large point's loss change is ∝ k/B
    report = check(NumpyLinearHarness(lr=LR, seed=4), seed=4)
    result = report["per_example_clipping"]
    by_b, by_k, loss_by_b = result.curves
    c = result.details["clip_norm"]
    np.testing.assert_allclose(by_b.y, LR * c / by_b.x, rtol=1e-9)
    np.testing.assert_allclose(by_k.y, LR * by_k.x * c / CheckConfig().counts_batch, rtol=1e-9)
    ratio = loss_by_b.y[0] / loss_by_b.y[-1]
    assert ratio == pytest.approx(loss_by_b.x[-1] / loss_by_b.x[0], rel=1e-3)
    assert result.details["filler_update_ratio"] == 0.0


@pytest.mark.statistical
def test_magnitude_ratio_matches_the_scale_each_noise_bug_implies():
    cfg = CheckConfig()
    for bug, expected in (
        (None, lambda cs: 1.0),
        # noise N(0, σ²): standardised by σC, so the ratio² is the mean of 1/C² over the grid
        ("uncalibrated", lambda cs: math.sqrt(np.mean(1.0 / np.asarray(cs) ** 2))),
        # noise σC/B on a batch of B = noise_batch_size
        ("noise_over_batch", lambda cs: 1.0 / cfg.noise_batch_size),
    ):
        result = check(NumpyLinearHarness(lr=LR, seed=6, bug=bug), seed=6)["noise_magnitude"]
        target = expected(result.details["clip_norms"])
        lo, hi = result.details["scale_ratio_ci"]
        assert lo <= target <= hi, (bug, lo, target, hi)
        if bug != "uncalibrated":  # one scale for every C: theorem 1's distance ratio applies
            lo, hi = result.details["expected_distance_ratio_ci"]
            assert lo <= target <= hi, (bug, lo, target, hi)
        if bug is not None:
            assert result.verdict is Verdict.FAIL
            assert max(result.details["clip_norms"]) < 1 or min(result.details["clip_norms"]) > 1


@pytest.mark.statistical
def test_calibration_elasticity_is_one_for_correct_noise_and_zero_for_uncalibrated():
    for bug, target in ((None, 1.0), ("uncalibrated", 0.0)):
        details = check(NumpyLinearHarness(lr=LR, seed=7, bug=bug), seed=7)[
            "noise_calibrated"
        ].details
        assert abs(details["elasticity"] - target) < 4 * details["elasticity_stderr"]
        assert details["control_ratio"] < 1e-6  # σ = 0: nothing depends on C or the seed


def test_distance_grows_like_c_squared_is_not_calibrated():
    class SquaredNoise(NumpyLinearHarness):
        def run(self, x, y, *, l2_norm_bound, noise_multiplier, seed, num_steps=1):
            # σ' = σ·C makes the noise standard deviation σ·C²
            return super().run(
                x,
                y,
                l2_norm_bound=l2_norm_bound,
                noise_multiplier=noise_multiplier * l2_norm_bound,
                seed=seed,
                num_steps=num_steps,
            )

    report = check(SquaredNoise(lr=LR, seed=2), seed=2)
    calib = report["noise_calibrated"]
    assert calib.verdict is Verdict.FAIL and calib.details["elasticity"] > 1.5
    assert "C^2" in calib.reason or "C^1.9" in calib.reason or "C^2.0" in calib.reason
    assert report["noise_magnitude"].verdict is Verdict.FAIL


def test_a_step_that_ignores_the_noise_fails_both_noise_checks():
    class NoNoise(NumpyLinearHarness):
        def run(self, x, y, *, l2_norm_bound, noise_multiplier, seed, num_steps=1):
            return super().run(
                x,
                y,
                l2_norm_bound=l2_norm_bound,
                noise_multiplier=0.0,
                seed=seed,
                num_steps=num_steps,
            )

    report = check(NoNoise(lr=LR))
    assert report["noise_calibrated"].verdict is Verdict.FAIL
    assert "identical" in report["noise_calibrated"].reason
    assert report["noise_magnitude"].verdict is Verdict.FAIL
    assert report["noise_magnitude"].details["scale_ratio"] == 0.0


# -------------------------------------------------------------------- estimated η/D
def test_estimated_update_scale_passes_a_correct_step_with_any_denominator():
    for denominator in (None, 16.0):
        harness = NumpyLinearHarness(lr=LR, seed=8, denominator=denominator)
        report = check(harness, seed=8, learning_rate=None, denominator=denominator or "batch")
        assert report.passed and not report.inconclusive, report.summary()
        details = report["noise_magnitude"].details
        d = denominator or report.settings["config"]["noise_batch_size"]
        assert details["update_scale"] == pytest.approx(LR / d, rel=1e-9)
        assert "estimated" in details["update_scale_source"]


def test_estimated_scale_measures_noise_against_one_examples_clipped_contribution():
    # clipping the batch mean makes one example move the update by C, not C/B, so against that
    # sensitivity the noise σC/B is B times too small: the magnitude check fails as well
    report = check(NumpyLinearHarness(lr=LR, seed=9, bug="clip_mean"), seed=9, learning_rate=None)
    assert set(report.failed) == {"per_example_clipping", "noise_magnitude"}
    lo, hi = report["noise_magnitude"].details["scale_ratio_ci"]
    assert lo <= 1.0 / CheckConfig().noise_batch_size <= hi


def test_wrongly_declared_denominator_is_reported():
    # the step divides by 16 but is declared to divide by the batch size
    report = check(NumpyLinearHarness(lr=LR, seed=10, denominator=16.0), seed=10)
    per_example = report["per_example_clipping"]
    assert per_example.verdict is Verdict.INCONCLUSIVE
    assert "denominator" in per_example.reason
    magnitude = report["noise_magnitude"]
    assert magnitude.verdict is Verdict.FAIL
    lo, hi = magnitude.details["scale_ratio_ci"]
    assert lo <= CheckConfig().noise_batch_size / 16.0 <= hi


# ----------------------------------------------------------------- inconclusive and skipped
def test_a_learning_rate_too_small_to_resolve_is_inconclusive():
    report = check(NumpyLinearHarness(lr=1e-30), learning_rate=1e-30, checks=["clipping_applied"])
    result = report["clipping_applied"]
    assert result.verdict is Verdict.INCONCLUSIVE and "resolution" in result.reason


def test_a_grid_entirely_above_the_gradient_norm_fails_with_a_hint():
    cfg = CheckConfig(clip_norms=(1e6, 1e7, 1e8, 1e9))
    result = check(NumpyLinearHarness(lr=LR), config=cfg)["clipping_applied"]
    assert result.verdict is Verdict.FAIL
    assert "extend clip_norms downwards" in result.reason


def test_too_few_grid_points_below_the_knee_is_inconclusive():
    cfg = CheckConfig(clip_norms=(1.0, 1e3, 1e4, 1e5))  # ‖g‖ ≈ 1e2: one point below
    report = check(NumpyLinearHarness(lr=LR), config=cfg)
    assert report["clipping_applied"].verdict is Verdict.INCONCLUSIVE
    assert "extend clip_norms downwards" in report["clipping_applied"].reason
    # without a gradient-norm estimate the per-example check cannot certify a pass
    assert report["per_example_clipping"].verdict is Verdict.INCONCLUSIVE
    assert report["noise_magnitude"].verdict is Verdict.PASS  # learning_rate given


def test_explicit_per_example_clip_norm_decides_without_the_estimate():
    cfg = CheckConfig(clip_norms=(1.0, 1e3, 1e4, 1e5), per_example_clip_norm=1e-3)
    for bug, verdict in ((None, Verdict.PASS), ("clip_mean", Verdict.FAIL)):
        report = check(NumpyLinearHarness(lr=LR, bug=bug), config=cfg)
        assert report["per_example_clipping"].verdict is verdict


def test_no_unclipped_clip_norm_makes_the_noise_checks_inconclusive():
    cfg = CheckConfig(clip_norms=(1e-4, 1e-3, 1e-2))
    report = check(NumpyLinearHarness(lr=LR), config=cfg)
    for name in ("noise_calibrated", "noise_magnitude"):
        assert report[name].verdict is Verdict.INCONCLUSIVE
        assert "unclipped" in report[name].reason


def test_imprecise_elasticity_is_inconclusive():
    # two parameters and two seeds per C: the distances are too noisy to tell C¹ from C⁰
    cfg = CheckConfig(seeds_per_clip_norm=2)
    result = run_checks(
        NumpyLinearHarness(dim=1, lr=LR, seed=3),
        input_shape=(1,),
        loss="mse",
        learning_rate=LR,
        seed=3,
        config=cfg,
        checks=["noise_calibrated"],
    )["noise_calibrated"]
    assert result.verdict is Verdict.INCONCLUSIVE
    assert result.details["elasticity_stderr"] > cfg.elasticity_max_stderr


def test_non_plain_sgd_skips_the_magnitude_test_and_searches_sigma():
    report = check(NumpyLinearHarness(lr=LR), learning_rate=None, plain_sgd=False)
    assert report["noise_magnitude"].verdict is Verdict.SKIPPED
    assert "plain SGD" in report["noise_magnitude"].reason
    calib = report["noise_calibrated"]
    assert calib.verdict is Verdict.PASS
    assert "appendix-B" in calib.details["noise_multiplier_source"]


def test_float32_parameters_pass():
    report = check(NumpyLinearHarness(lr=LR, seed=3, dtype=np.float32), seed=3)
    assert report.passed and not report.inconclusive, report.summary()


# -------------------------------------------------------------------------- the checker
def test_checks_run_in_any_order_and_are_cached():
    harness = NumpyLinearHarness(lr=LR)
    checker = DPSGDChecker(harness, input_shape=(5,), loss="mse", learning_rate=LR)
    first = checker.noise_magnitude()
    assert checker.noise_magnitude() is first
    steps = checker.steps_run
    report = checker.run()
    assert report["noise_magnitude"] is first
    assert report.settings["steps_run"] == checker.steps_run > steps
    assert harness.calls == checker.steps_run  # one step per call


def test_same_seed_same_report_different_seed_different_noise():
    a = check(NumpyLinearHarness(lr=LR), seed=11).to_dict()
    b = check(NumpyLinearHarness(lr=LR), seed=11).to_dict()
    c = check(NumpyLinearHarness(lr=LR), seed=12).to_dict()
    for d in (a, b, c):
        d["settings"].pop("seconds")
    assert a == b
    assert a != c


def test_report_is_json_serialisable():
    report = check(NumpyLinearHarness(lr=LR, bug="clip_mean"))
    data = json.loads(json.dumps(report.to_dict()))
    assert data["failed"] == ["per_example_clipping"]
    assert [r["name"] for r in data["results"]] == list(CHECK_NAMES)


def test_run_rejects_unknown_check_names():
    checker = DPSGDChecker(NumpyLinearHarness(), input_shape=(5,), loss="mse")
    with pytest.raises(InvalidParameterError, match="checks"):
        checker.run(["clipping_applied", "nope"])
    with pytest.raises(InvalidParameterError, match="checks"):
        checker.run([])
    assert checker.run("clipping_applied").verdicts == {"clipping_applied": Verdict.PASS}


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        ({"input_shape": ()}, "input_shape"),
        ({"input_shape": (0,)}, "input_shape"),
        ({"input_shape": "abc"}, "input_shape"),
        ({"loss": "hinge"}, "loss"),
        ({"labels": "fuzzy"}, "labels"),
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"learning_rate": math.nan}, "learning_rate"),
        ({"denominator": "mean"}, "denominator"),
        ({"denominator": -1.0}, "denominator"),
        ({"plain_sgd": 1}, "plain_sgd"),
        ({"noise_multiplier": 0.0}, "noise_multiplier"),
        ({"seed": -1}, "seed"),
        ({"seed": True}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"config": {"alpha_slope": 0.1}}, "config"),
        ({"config": CheckConfig(noise_batch_size=64)}, "config.noise_batch_size"),
    ],
)
def test_checker_rejects_bad_arguments(kwargs, parameter):
    args = {"input_shape": (5,), "loss": "mse", **kwargs}
    with pytest.raises(InvalidParameterError) as info:
        DPSGDChecker(NumpyLinearHarness(), **args)
    assert info.value.parameter == parameter


def test_checker_rejects_a_harness_without_the_protocol():
    with pytest.raises(InvalidParameterError, match="harness"):
        DPSGDChecker(object(), input_shape=(5,), loss="mse")


class _BadHarness(NumpyLinearHarness):
    def __init__(self, mode, **kw):
        super().__init__(**kw)
        self.mode = mode

    def run(self, x, y, **kw):
        out = super().run(x, y, **kw)
        if self.mode == "type":
            return (out.params_before, out.params_after)
        if self.mode == "losses":
            return StepOutcome(
                out.params_before, out.params_after, out.losses_before[:0], out.losses_after[:0]
            )
        return StepOutcome(
            out.params_before, out.params_after[:-1], out.losses_before, out.losses_after
        )


@pytest.mark.parametrize(
    ("mode", "parameter"),
    [
        ("type", "harness.run"),
        ("losses", "StepOutcome.losses_before"),
        ("params", "StepOutcome.params_after"),
    ],
)
def test_a_harness_returning_malformed_outcomes_is_rejected(mode, parameter):
    checker = DPSGDChecker(_BadHarness(mode), input_shape=(5,), loss="mse")
    with pytest.raises(InvalidParameterError) as info:
        checker.clipping_applied()
    assert info.value.parameter == parameter


def test_a_harness_with_misshapen_predictions_is_rejected():
    class BadPredict(NumpyLinearHarness):
        def predict(self, x):
            return np.zeros((len(x) + 1, 1))

    with pytest.raises(InvalidParameterError, match=r"harness\.predict"):
        DPSGDChecker(BadPredict(), input_shape=(5,), loss="mse").clipping_applied()


@pytest.mark.slow
def test_core_modules_import_neither_torch_nor_tensorflow():
    code = (
        "import sys\n"
        "import dpledger.audit, dpledger.checks, dpledger.checks.synthetic_data\n"
        "import dpledger.checks.report, dpledger.checks.commands, dpledger.cli\n"
        "import dpledger.checks.clipping_applied, dpledger.checks.per_example_clipping\n"
        "import dpledger.checks.noise_calibrated, dpledger.checks.noise_magnitude\n"
        "dpledger.cli.build_parser()\n"
        "bad = [m for m in ('torch', 'tensorflow', 'keras', 'matplotlib') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    root = pathlib.Path(__file__).resolve().parents[2]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


@pytest.mark.statistical
def test_several_steps_per_model_in_the_calibration_check():
    # the paper trains T = 10 steps per model; the magnitude test still uses one-step runs
    cfg = CheckConfig(noise_steps=3)
    for bug, failed in ((None, set()), ("uncalibrated", {"noise_calibrated", "noise_magnitude"})):
        harness = NumpyLinearHarness(lr=LR, bug=bug)
        report = check(harness, config=cfg)
        assert set(report.failed) == failed, report.summary()
