"""The per-step bias recorder: what it keeps, its means, its bad inputs, and a DPOptimizer run."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dpledger.diagnostics.bias import ClippingBiasRecorder, clipping_bias, clipping_bias_from_sums
from dpledger.errors import InvalidParameterError

# Step 0: ‖g1‖ = 5 clipped to C = 1 and ‖g2‖ = 0.5 kept (bias (−1.2, −1.6), norm 2, one of two
# clipped). Step 1: both gradients within C (no bias, nothing clipped).
STEP0 = clipping_bias(np.array([[3.0, 4.0], [0.0, 0.5]]), l2_norm_bound=1.0)
STEP1 = clipping_bias(np.array([[0.3, 0.4], [0.0, 0.5]]), l2_norm_bound=1.0)


def test_means_over_steps_by_hand():
    recorder = ClippingBiasRecorder()
    recorder(0, STEP0)
    recorder(1, STEP1)
    assert len(recorder) == 2
    assert recorder.steps == (0, 1)
    means = recorder.means()
    assert means["bias_norm"] == pytest.approx((2.0 + 0.0) / 2)
    assert means["fraction_clipped"] == pytest.approx((0.5 + 0.0) / 2)
    assert means["magnitude_error"] == pytest.approx((1.9125 / 7.3125 + 1.0) / 2)
    assert means["directional_error_norm"] == pytest.approx(STEP0.directional_error_norm / 2)
    assert means["cosine"] == pytest.approx((STEP0.cosine + 1.0) / 2)
    assert means["mean_example_norm"] == pytest.approx((2.75 + 0.5) / 2)
    assert means["max_example_norm"] == pytest.approx((5.0 + 0.5) / 2)
    np.testing.assert_allclose(recorder.values("bias_norm"), [2.0, 0.0], atol=1e-15)
    assert set(recorder.names) == set(STEP0.scalars())


def test_a_metric_missing_on_some_steps_is_nan_there_and_left_out_of_its_mean():
    without_norms = clipping_bias_from_sums(
        unclipped_sum=[3.0, 4.5], clipped_sum=[0.6, 1.3], num_examples=2, num_clipped=1
    )
    recorder = ClippingBiasRecorder()
    recorder(0, without_norms)
    recorder(1, STEP1)
    values = recorder.values("mean_example_norm")
    assert math.isnan(values[0]) and values[1] == pytest.approx(0.5)
    assert recorder.means()["mean_example_norm"] == pytest.approx(0.5)
    assert recorder.means()["bias_norm"] == pytest.approx(without_norms.bias_norm / 2)


def test_an_empty_recorder():
    recorder = ClippingBiasRecorder()
    assert len(recorder) == 0 and recorder.steps == () and recorder.names == ()
    assert recorder.means() == {}
    with pytest.raises(InvalidParameterError, match="no step recorded yet"):
        recorder.values("bias_norm")


@pytest.mark.parametrize("step", [-1, 1.0, True, "0", None])
def test_bad_step(step):
    with pytest.raises(InvalidParameterError, match="step"):
        ClippingBiasRecorder()(step, STEP0)


def test_bad_metrics_and_unknown_name():
    recorder = ClippingBiasRecorder()
    with pytest.raises(InvalidParameterError, match="metrics"):
        recorder(0, {"bias_norm": 1.0})
    recorder(0, STEP0)
    with pytest.raises(InvalidParameterError, match="'bias_norm'"):
        recorder.values("bias")
    assert len(recorder) == 1


def test_records_every_step_of_a_dp_optimizer():
    torch = pytest.importorskip("torch")
    from dpledger.adapters.torch import DPOptimizer

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    recorder = ClippingBiasRecorder()
    optimizer = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        l2_norm_bound=0.1,
        noise_multiplier=1.0,
        sampling_probability=0.5,
        population_size=16,
        seed=0,
        bias_callback=recorder,
    )
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    for _ in range(3):
        optimizer.zero_grad()
        optimizer.backward(torch.nn.functional.cross_entropy(model(x), y))
        optimizer.step()
    assert recorder.steps == (0, 1, 2)
    # C = 0.1 is far below these gradients' norms: every record is clipped on every step.
    np.testing.assert_array_equal(recorder.values("fraction_clipped"), [1.0, 1.0, 1.0])
    assert all(v > 0 for v in recorder.values("bias_norm"))
