"""Correlated noise under tf.distribute.MirroredStrategy on two logical CPUs (in a subprocess,
see mirrored_correlated_run.py): the release runs once, on the sum over the replicas."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def results() -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("mirrored_correlated_run.py"))],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


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
