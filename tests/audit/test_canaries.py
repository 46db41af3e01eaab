"""Tests of the canaries and their scores (framework-free)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from dpledger.audit.canaries import (
    GradientCanary,
    InputCanary,
    dirac_gradient_canary,
    loss_score,
    mislabeled_canary,
    out_of_distribution_canary,
)
from dpledger.errors import InvalidParameterError

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_canaries_module_imports_no_framework():
    code = (
        "import sys\nimport dpledger.audit.canaries\n"
        "print(','.join(m for m in ('torch', 'tensorflow', 'matplotlib') if m in sys.modules))\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip() == ""


# ------------------------------------------------------------------ input canaries


def test_out_of_distribution_canary_lights_the_always_zero_features():
    x = np.array([[0.0, 1.0, 0.0, 2.0], [0.0, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 3.0]])
    canary = out_of_distribution_canary(x, label=3, magnitude=5.0)
    assert isinstance(canary, InputCanary)
    np.testing.assert_array_equal(canary.features, [5.0, 0.0, 5.0, 0.0])
    assert canary.active_features == (0, 2)
    assert canary.label == 3 and canary.kind == "out_of_distribution"
    assert canary.num_features == 4
    assert not canary.features.flags.writeable
    one = out_of_distribution_canary(x, label=0, magnitude=1.0, max_features=1)
    np.testing.assert_array_equal(one.features, [1.0, 0.0, 0.0, 0.0])


def test_out_of_distribution_canary_on_digits_uses_the_blank_pixels():
    from sklearn.datasets import load_digits

    x = load_digits().data / 16.0
    canary = out_of_distribution_canary(x, label=0, magnitude=8.0)
    assert canary.active_features == (0, 32, 39)
    # Every digit is orthogonal to the canary: a linear layer's weights on its pixels get no
    # gradient from the data.
    assert np.all(x @ canary.features == 0.0)


def test_out_of_distribution_canary_bad_inputs():
    x = np.ones((3, 2))
    with pytest.raises(InvalidParameterError) as info:
        out_of_distribution_canary(x, label=0, magnitude=1.0)
    assert info.value.parameter == "features" and "mislabeled_canary" in str(info.value)
    z = np.zeros((3, 2))
    for kwargs, name in [
        ({"label": -1, "magnitude": 1.0}, "label"),
        ({"label": True, "magnitude": 1.0}, "label"),
        ({"label": 0, "magnitude": 0.0}, "magnitude"),
        ({"label": 0, "magnitude": float("inf")}, "magnitude"),
        ({"label": 0, "magnitude": 1.0, "max_features": 0}, "max_features"),
    ]:
        with pytest.raises(InvalidParameterError) as info:
            out_of_distribution_canary(z, **kwargs)
        assert info.value.parameter == name
    for bad in (np.zeros(3), np.zeros((0, 2)), np.array([[np.nan, 0.0]]), "x"):
        with pytest.raises(InvalidParameterError) as info:
            out_of_distribution_canary(bad, label=0, magnitude=1.0)
        assert info.value.parameter == "features"


def test_mislabeled_canary_copies_a_record_with_another_label():
    x = np.arange(6.0).reshape(3, 2)
    y = np.array([0, 1, 2])
    canary = mislabeled_canary(x, y, index=1, label=0)
    np.testing.assert_array_equal(canary.features, [2.0, 3.0])
    assert canary.label == 0 and canary.kind == "mislabeled" and canary.active_features == ()
    with pytest.raises(InvalidParameterError) as info:
        mislabeled_canary(x, y, index=1, label=1)
    assert info.value.parameter == "label"
    for index in (3, -1, 1.0, True):
        with pytest.raises(InvalidParameterError) as info:
            mislabeled_canary(x, y, index=index, label=0)
        assert info.value.parameter == "index"
    with pytest.raises(InvalidParameterError) as info:
        mislabeled_canary(x, y[:2], index=0, label=1)
    assert info.value.parameter == "labels"


def test_loss_score_is_the_negative_loss():
    assert loss_score(2.5) == -2.5
    assert loss_score(np.float32(0.25)) == -0.25
    for bad in (float("nan"), float("inf")):
        with pytest.raises(InvalidParameterError) as info:
            loss_score(bad)
        assert info.value.parameter == "loss"


# ------------------------------------------------------------------ gradient canaries


def test_gradient_canary_score_is_the_movement_against_its_direction():
    g = np.array([3.0, 0.0, -4.0])
    canary = GradientCanary(gradient=g)
    assert canary.norm == 5.0 and canary.num_parameters == 3
    np.testing.assert_allclose(canary.direction, [0.6, 0.0, -0.8])
    before = np.array([1.0, 2.0, 3.0])
    after = before - 0.5 * canary.direction + np.array([0.0, 7.0, 0.0])  # a step along −ĝ
    assert canary.score(before, after) == pytest.approx(0.5, rel=1e-12)
    assert canary.score(before, after, unit=0.25) == pytest.approx(2.0, rel=1e-12)
    # Moving along +ĝ (away from the canary) scores negative.
    assert canary.score(before, before + canary.direction) == pytest.approx(-1.0, rel=1e-12)


def test_gradient_canary_clip_bound_and_bad_inputs():
    canary = GradientCanary(gradient=[0.0, 2.0])
    canary.check_clip_bound(2.0)
    canary.check_clip_bound(1.0)
    with pytest.raises(InvalidParameterError) as info:
        canary.check_clip_bound(2.5)
    assert info.value.parameter == "l2_norm_bound"
    with pytest.raises(InvalidParameterError) as info:
        GradientCanary(gradient=[0.0, 0.0])
    assert info.value.parameter == "gradient"
    for bad in ([], [np.inf], "g"):
        with pytest.raises(InvalidParameterError) as info:
            GradientCanary(gradient=bad)
        assert info.value.parameter == "gradient"
    with pytest.raises(InvalidParameterError) as info:
        canary.score([0.0, 0.0, 0.0], [0.0, 0.0])
    assert info.value.parameter == "initial_parameters"
    with pytest.raises(InvalidParameterError) as info:
        canary.score([0.0, 0.0], [0.0])
    assert info.value.parameter == "final_parameters"
    with pytest.raises(InvalidParameterError) as info:
        canary.score([0.0, 0.0], [0.0, 0.0], unit=0.0)
    assert info.value.parameter == "unit"
    with pytest.raises(InvalidParameterError) as info:
        canary.score([0.0, 0.0], [0.0, np.nan])
    assert info.value.parameter == "final_parameters"


def test_dirac_gradient_canary():
    canary = dirac_gradient_canary(num_parameters=5, index=3, norm=7.0, sign=-1)
    np.testing.assert_array_equal(canary.gradient, [0.0, 0.0, 0.0, -7.0, 0.0])
    assert canary.norm == 7.0
    before = np.zeros(5)
    after = np.array([0.0, 0.0, 0.0, 0.125, 9.0])  # descent along −g raises coordinate 3
    assert canary.score(before, after) == 0.125
    for kwargs, name in [
        ({"num_parameters": 0, "index": 0, "norm": 1.0}, "num_parameters"),
        ({"num_parameters": 5, "index": 5, "norm": 1.0}, "index"),
        ({"num_parameters": 5, "index": -1, "norm": 1.0}, "index"),
        ({"num_parameters": 5, "index": 0, "norm": -1.0}, "norm"),
        ({"num_parameters": 5, "index": 0, "norm": 1.0, "sign": 0.5}, "sign"),
        ({"num_parameters": 5, "index": 0, "norm": 1.0, "sign": True}, "sign"),
    ]:
        with pytest.raises(InvalidParameterError) as info:
            dirac_gradient_canary(**kwargs)
        assert info.value.parameter == name
