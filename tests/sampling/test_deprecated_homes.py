"""The NumPy Poisson sampler's former home still works for one release, with a warning."""

from __future__ import annotations

import importlib
import sys

import pytest

import dpledger.mechanisms
from dpledger.sampling import PoissonSampler


def test_mechanisms_poisson_sampler_warns_and_is_the_same_class() -> None:
    with pytest.warns(DeprecationWarning, match="dpledger.sampling"):
        former = dpledger.mechanisms.PoissonSampler
    assert former is PoissonSampler
    assert "PoissonSampler" not in dpledger.mechanisms.__all__


def test_mechanisms_sampling_module_warns() -> None:
    sys.modules.pop("dpledger.mechanisms.sampling", None)
    with pytest.warns(DeprecationWarning, match="dpledger.sampling"):
        module = importlib.import_module("dpledger.mechanisms.sampling")
    assert module.PoissonSampler is PoissonSampler
