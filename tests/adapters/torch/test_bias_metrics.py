"""Per-step clipping-bias metrics from the fast path's norms and sums (NOT private)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from dpledger import PrivacyLedger
from dpledger.adapters.torch import DPOptimizer
from dpledger.diagnostics.bias import ClippingBias, clipping_bias
from tests.adapters.torch.dp_helpers import batch, per_example, small_cnn

C, Q, N = 3.2, 0.1, 120


def _dp(model, callback=None):
    return DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        l2_norm_bound=C,
        noise_multiplier=1.0,
        sampling_probability=Q,
        population_size=N,
        ledger=PrivacyLedger(),
        seed=0,
        bias_callback=callback,
    )


@pytest.mark.parametrize("chunks", [1, 3])
def test_metrics_match_the_reference_computed_from_per_example_gradients(chunks):
    x, y = batch(11, seed=3)
    model, ref = small_cnn(), small_cnn()
    seen: list[tuple[int, ClippingBias]] = []
    dp = _dp(model, lambda step, metrics: seen.append((step, metrics)))
    size = -(-len(y) // chunks)
    for k in range(0, len(y), size):
        F.cross_entropy(model(x[k : k + size]), y[k : k + size]).backward()
        if k + size < len(y):
            dp.virtual_step()
    dp.step()
    grads = per_example(ref, x, y)
    want = clipping_bias([g.numpy() for g in grads.values()], l2_norm_bound=C, denominator=Q * N)
    ((step, got),) = seen
    assert step == 0 and 0 < want.fraction_clipped < 1
    assert got.num_examples == 11 and got.denominator == Q * N
    for key, value in want.scalars().items():
        assert got.scalars()[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_metrics_off_costs_no_extra_pass_and_never_calls_back(monkeypatch):
    calls = {"sum": 0}
    x, y = batch(6)
    for callback, passes in ((None, 1), (lambda s, m: None, 2)):
        model = small_cnn()
        dp = _dp(model, callback)
        original = dp.engine.clipped_sum

        def counting(factors, original=original):
            calls["sum"] += 1
            return original(factors)

        monkeypatch.setattr(dp.engine, "clipped_sum", counting)
        calls["sum"] = 0
        F.cross_entropy(model(x), y).backward()
        dp.step()
        assert calls["sum"] == passes


def test_an_empty_step_reports_nothing():
    seen = []
    model = small_cnn()
    dp = _dp(model, lambda s, m: seen.append(m))
    dp.empty_step()
    assert seen == [] and dp.ledger.num_steps == 1
