"""Shared helpers for the mechanisms tests."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dpledger import PrivacyLedger


def exact_norm(x: np.ndarray) -> float:
    """L2 norm by math.hypot: an independent, overflow- and underflow-safe oracle."""
    return math.hypot(*np.asarray(x, dtype=np.float64).ravel().tolist())


def exact_record_norms(x: np.ndarray) -> np.ndarray:
    """Per-record norms (leading axis) by :func:`exact_norm`."""
    a = np.asarray(x)
    return np.array([exact_norm(a[i]) for i in range(a.shape[0])])


def rounding_allowance(dtype: np.dtype, size: int) -> float:
    """Relative slack for a clipped norm: (d + 8)·eps of the dtype (norm, factor, product)."""
    return (size + 8) * float(np.finfo(dtype).eps)


@pytest.fixture
def ledger() -> PrivacyLedger:
    """An in-memory ledger with one open step (q = 0.01, n = 10 000)."""
    led = PrivacyLedger()
    led.record_sample(sampling_probability=0.01, population_size=10_000)
    return led


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240611)
