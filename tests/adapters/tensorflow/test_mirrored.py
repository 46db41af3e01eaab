"""tf.distribute.MirroredStrategy on two logical CPUs (in a subprocess, see mirrored_run.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.adapters.tensorflow.subprocess_run import json_of_script

# each test runs TensorFlow MirroredStrategy scripts in subprocesses (about 25 s of set-up)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results() -> dict:
    return json_of_script("mirrored_run.py")


@pytest.mark.parametrize("case", ["unclipped", "clipped"])
def test_sigma_zero_matches_a_single_device_run_on_the_union_batch(results, case):
    assert results["replicas"] == 2
    r = results[case]
    single, mirrored = np.array(r["single_update"]), np.array(r["mirrored_update"])
    assert np.max(np.abs(single)) > 0
    # the updates are differences of float32 weights: a few ulps of the weights, plus the
    # rounding of sums taken in a different order on the replicas
    atol = 4 * np.finfo(np.float32).eps * results["weight_scale"] + 1e-5 * np.max(np.abs(single))
    np.testing.assert_allclose(mirrored, single, rtol=0, atol=atol)
    assert r["replicas_equal"]
    assert len(r["steps"]) == 1  # one sampling event for the step, not one per replica


@pytest.mark.statistical
def test_one_noise_draw_of_the_full_variance(results):
    difference = np.array(results["noise"]["difference"])
    # SGD(lr = 1): the update's noise is N(0, (σC)²)/(q·n) per coordinate; two independent
    # draws (one per replica) would give √2 times that.
    expected = 2.0 * 0.05 / (0.1 * 100)
    m = difference.size
    assert abs(difference.std(ddof=1) - expected) < 4 * expected / math.sqrt(2 * m)
    assert results["noise"]["steps"] == [[[0.05, 0.1]]]  # (S, σ̃ = σ·S) once, JSON lists


def test_poisson_batches_record_one_step_per_executed_step(results):
    assert results["poisson"]["ledger_steps"] == results["poisson"]["iterations"] == 14
