"""The PyTorch convenience: hand-written correct and buggy DP steps, DP-Adam, Opacus."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dpledger.checks import Verdict  # noqa: E402
from dpledger.checks.checker import CHECK_NAMES  # noqa: E402
from dpledger.checks.torch_step import (  # noqa: E402
    TorchStepHarness,
    assert_dp_sgd_correct,
    check_dp_optimizer,
    check_dp_sgd,
    default_mlp,
)
from dpledger.errors import InvalidParameterError  # noqa: E402
from tests.checks.torch_steps import make_adam_step, make_dp_sgd_step, mlp  # noqa: E402

pytestmark = pytest.mark.statistical

EXPECTED_FAILURES = {
    "no_clip": {"clipping_applied"},
    "clip_mean": {"per_example_clipping"},
    "uncalibrated": {"noise_calibrated", "noise_magnitude"},
    "noise_over_batch": {"noise_magnitude"},
}
ALL_PASS = dict.fromkeys(CHECK_NAMES, Verdict.PASS)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # tiny models: intra-op threads only add overhead (about 10x for cross-entropy under load)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def factory():
    return mlp(10, 3)


def run(bug=None, *, loss="mse", **kw):
    kw.setdefault("seed", 0)
    step = make_dp_sgd_step(loss=loss, bug=bug, denominator=kw.pop("step_denominator", None))
    return check_dp_sgd(step, factory, loss=loss, input_shape=(10,), **kw)


@pytest.mark.parametrize("seed", [0, 1])
def test_correct_step_passes_every_check(seed):
    report = run(seed=seed)
    assert report.verdicts == ALL_PASS, report.summary()
    assert report.settings["dtype"] == "torch.float64"


@pytest.mark.parametrize("bug", sorted(EXPECTED_FAILURES))
def test_each_bug_is_flagged_by_its_checks_only(bug):
    report = run(bug)
    assert set(report.failed) == EXPECTED_FAILURES[bug], report.summary()


@pytest.mark.parametrize("bug", [None, "clip_mean", "noise_over_batch"])
def test_cross_entropy_with_soft_labels(bug):
    report = run(bug, loss="cross_entropy")
    assert set(report.failed) == EXPECTED_FAILURES.get(bug, set()), report.summary()
    if bug is None:
        assert report.verdicts == ALL_PASS
        assert report["per_example_clipping"].details["filler_update_ratio"] < 1e-6


def test_hard_labels_leave_a_residual_gradient_and_the_per_example_check_says_so():
    report = run(loss="cross_entropy", labels="hard")
    result = report["per_example_clipping"]
    assert result.verdict is Verdict.INCONCLUSIVE
    assert "labels='soft'" in result.reason
    assert result.details["filler_residual_logit_gradient_mean"] > 0
    assert not report.failed


def test_fixed_denominator_step():
    report = run(step_denominator=16, denominator=16)
    assert report.verdicts == ALL_PASS, report.summary()
    bad = run("noise_over_batch", step_denominator=16, denominator=16)
    assert bad.failed == ("noise_magnitude",)


@pytest.mark.parametrize("bug", [None, "noise_over_batch"])
def test_float32_model(bug):
    report = run(bug, dtype=torch.float32)
    assert set(report.failed) == EXPECTED_FAILURES.get(bug, set()), report.summary()
    assert not report.inconclusive


@pytest.mark.slow
@pytest.mark.parametrize("bug", [None, "no_clip", "clip_mean", "uncalibrated"])
def test_dp_adam_after_warm_up(bug):
    report = check_dp_optimizer(
        make_adam_step(loss="mse", bug=bug), factory, loss="mse", input_shape=(10,), lr=1e-3
    )
    assert report["noise_magnitude"].verdict is Verdict.SKIPPED
    expected = EXPECTED_FAILURES.get(bug, set()) - {"noise_magnitude"}
    assert set(report.failed) == expected, report.summary()
    if bug is None:
        assert not report.inconclusive
        assert report.settings["warmup_steps"] == 5
        assert "appendix-B" in report["noise_calibrated"].details["noise_multiplier_source"]


@pytest.mark.filterwarnings("ignore:Full backward hook")
def test_opacus_dp_optimizer_passes_every_check():
    opacus = pytest.importorskip("opacus")
    expected_batch_size = 16

    def make_step(model):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gsm = opacus.GradSampleModule(model, loss_reduction="mean")
            opt = opacus.optimizers.DPOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.01),
                noise_multiplier=1.0,
                max_grad_norm=1.0,
                expected_batch_size=expected_batch_size,
                loss_reduction="mean",
            )

        def step(model, x, y, *, l2_norm_bound, noise_multiplier, lr, generator):
            opt.noise_multiplier, opt.max_grad_norm, opt.generator = (
                noise_multiplier,
                l2_norm_bound,
                generator,
            )
            for group in opt.param_groups:
                group["lr"] = lr
            opt.zero_grad()
            torch.nn.functional.mse_loss(gsm(x), y).backward()
            opt.step()

        return step

    # Opacus divides by the expected batch size: a fixed denominator
    report = check_dp_optimizer(
        make_step,
        factory,
        loss="mse",
        input_shape=(10,),
        plain_sgd=True,
        warmup_steps=0,
        denominator=expected_batch_size,
    )
    assert report.verdicts == ALL_PASS, report.summary()


def test_assert_helper_passes_silently_and_fails_with_the_report():
    report = assert_dp_sgd_correct(make_dp_sgd_step(), factory, loss="mse", input_shape=(10,))
    assert report.passed
    with pytest.raises(AssertionError) as info:
        assert_dp_sgd_correct(
            make_dp_sgd_step(bug="clip_mean"), factory, loss="mse", input_shape=(10,)
        )
    text = str(info.value)
    assert "failed checks: per_example_clipping" in text
    assert "[        FAIL] per_example_clipping" in text


def test_harness_never_changes_the_starting_model_or_the_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    harness = TorchStepHarness(
        lambda m: make_dp_sgd_step(),
        factory,
        input_shape=(10,),
        loss="mse",
        lr=0.1,
        init_seed=5,
    )
    assert torch.equal(torch.rand(3), expected)  # the global generator was not consumed
    x = np.random.default_rng(0).standard_normal((4, 10))
    y = harness.predict(x)
    first = harness.run(x, y + 1.0, l2_norm_bound=1.0, noise_multiplier=1.0, seed=1)
    second = harness.run(x, y + 1.0, l2_norm_bound=1.0, noise_multiplier=1.0, seed=1)
    np.testing.assert_array_equal(first.params_before, second.params_before)
    np.testing.assert_array_equal(first.params_after, second.params_after)
    assert not np.array_equal(first.params_after, first.params_before)
    np.testing.assert_array_equal(harness.predict(x), y)
    # the same init seed gives the same model
    again = TorchStepHarness(
        lambda m: make_dp_sgd_step(),
        factory,
        input_shape=(10,),
        loss="mse",
        lr=0.1,
        init_seed=5,
    )
    np.testing.assert_array_equal(again.predict(x), y)
    assert first.losses_before.dtype == np.float64


def test_default_mlp_shapes():
    model = default_mlp((2, 5), 4)
    assert model(torch.zeros(3, 2, 5)).shape == (3, 4)


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        ({"dtype": torch.int32}, "dtype"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"lr": 0.0}, "lr"),
        ({"loss": "hinge"}, "loss"),
        ({"model_factory": lambda: object()}, "model_factory"),
        ({"model_factory": 3}, "model_factory"),
        ({"make_step": None}, "make_step"),
    ],
)
def test_harness_rejects_bad_arguments(kwargs, parameter):
    args = {
        "make_step": lambda m: make_dp_sgd_step(),
        "model_factory": factory,
        "input_shape": (10,),
        "loss": "mse",
        "lr": 0.01,
        **kwargs,
    }
    make_step, model_factory = args.pop("make_step"), args.pop("model_factory")
    with pytest.raises(InvalidParameterError) as info:
        TorchStepHarness(make_step, model_factory, **args)
    assert info.value.parameter == parameter


def test_check_dp_sgd_rejects_a_non_callable_step():
    with pytest.raises(InvalidParameterError, match="step"):
        check_dp_sgd("not a function", factory, loss="mse", input_shape=(10,))


def test_models_with_integer_buffers_are_evaluated_without_casting_them():
    class Counted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp(10, 3)
            self.register_buffer("calls", torch.zeros((), dtype=torch.long))

        def forward(self, x):
            assert self.calls.dtype == torch.long
            return self.net(x)

    report = check_dp_sgd(
        make_dp_sgd_step(), Counted, loss="mse", input_shape=(10,), checks=["clipping_applied"]
    )
    assert report.verdicts == {"clipping_applied": Verdict.PASS}
