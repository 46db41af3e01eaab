"""Our wrapper passes every implementation-bug check of "Finding Private Bugs"."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from dpledger import PrivacyLedger
from dpledger.adapters.torch import DPOptimizer
from dpledger.checks import Verdict
from dpledger.checks.checker import CHECK_NAMES
from dpledger.checks.torch_step import assert_dp_sgd_correct, check_dp_optimizer

pytestmark = pytest.mark.statistical

Q, N = 0.5, 32  # the fixed denominator q·n = 16


def factory() -> nn.Module:
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))


def _wrap(model, opt, *, l2_norm_bound, noise_multiplier, generator, **kwargs) -> DPOptimizer:
    return DPOptimizer(
        opt,
        model=model,
        l2_norm_bound=l2_norm_bound,
        noise_multiplier=noise_multiplier,
        sampling_probability=Q,
        population_size=N,
        generator=generator,
        ledger=PrivacyLedger(),
        check_steps=0,
        **kwargs,
    )


@pytest.mark.parametrize("strategy", ["auto", "generic"])
def test_dp_sgd_wrapper_passes_every_check_with_the_fixed_denominator(strategy):
    def step(model, x, y, *, l2_norm_bound, noise_multiplier, lr, generator):
        dp = _wrap(
            model,
            torch.optim.SGD(model.parameters(), lr=lr),
            l2_norm_bound=l2_norm_bound,
            noise_multiplier=noise_multiplier,
            generator=generator,
            strategy=strategy,
        )
        try:
            F.mse_loss(model(x), y).backward()
            dp.step()
        finally:
            dp.detach()

    report = assert_dp_sgd_correct(step, factory, loss="mse", input_shape=(10,), denominator=Q * N)
    assert report.verdicts == dict.fromkeys(CHECK_NAMES, Verdict.PASS)


@pytest.mark.slow
def test_dp_adam_wrapper_passes_the_checks_for_stateful_optimizers():
    def make_step(model):
        dp = _wrap(
            model,
            torch.optim.Adam(model.parameters(), lr=1e-3),
            l2_norm_bound=1.0,
            noise_multiplier=1.0,
            generator=torch.Generator(),
        )

        def step(model, x, y, *, l2_norm_bound, noise_multiplier, lr, generator):
            dp.l2_norm_bound, dp.noise_multiplier, dp.generator = (
                l2_norm_bound,
                noise_multiplier,
                generator,
            )
            for group in dp.param_groups:
                group["lr"] = lr
            dp.zero_grad()
            F.mse_loss(model(x), y).backward()
            dp.step()

        return step

    report = check_dp_optimizer(
        make_step, factory, loss="mse", input_shape=(10,), lr=1e-3, denominator=Q * N
    )
    assert report["noise_magnitude"].verdict is Verdict.SKIPPED
    assert not report.failed and not report.inconclusive, report.summary()
