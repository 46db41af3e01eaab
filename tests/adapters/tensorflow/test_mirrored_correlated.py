"""Correlated noise under tf.distribute.MirroredStrategy on two logical CPUs (in a subprocess,
see mirrored_correlated_run.py): the release runs once, on the sum over the replicas."""

from __future__ import annotations

import numpy as np
import pytest

from tests.adapters.tensorflow.subprocess_run import json_of_script

pytestmark = (
    pytest.mark.slow
)  # the module's fixture runs a MirroredStrategy training script in a subprocess


@pytest.fixture(scope="module")
def results() -> dict:
    return json_of_script("mirrored_correlated_run.py")


def test_mirrored_run_matches_the_single_device_run_with_the_same_noise(results):
    """Reference: the single-device run with the same seeds, which adds the same core noise
    w_t (one draw per step, not one per replica) to the same clipped sums."""
    assert results["replicas"] == 2
    single, mirrored = np.array(results["single_update"]), np.array(results["mirrored_update"])
    assert np.max(np.abs(single)) > 0
    # float32 weights: a few ulps of the weights, plus sums taken in another order per replica
    atol = 8 * np.finfo(np.float32).eps * results["weight_scale"] + 1e-5 * np.max(np.abs(single))
    np.testing.assert_allclose(mirrored, single, rtol=0, atol=atol)
    assert results["replicas_equal"]


def test_one_release_in_the_ledger_and_one_update_per_step(results):
    assert results["releases"] == 1 and results["same_release"]
    assert results["ledger_steps"] == 0
    # one stream step per step, recorded on the chief as the release is, as in one process
    assert results["stream_steps"] == [[0, t] for t in range(4)]
    assert results["single_stream_steps"] == 4
    assert results["iterations"] == 4
