"""A ledger with known q, z and steps, written once for the report tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpledger import PrivacyLedger

Q = 0.01
STEPS = 300
KERNEL = (1.0, 1.5)  # (C, σ̃) of the "dense/kernel" query
BIAS = (0.5, 0.75)  # (C, σ̃) of the "dense/bias" query
Z_EFF = (sum((c / s) ** 2 for c, s in (KERNEL, BIAS))) ** -0.5
DELTA = 1e-5


def write_ledger(path: Path) -> Path:
    """STEPS Poisson steps at q = Q, each with the kernel and bias queries."""
    with PrivacyLedger(path, metadata={"model": "cnn", "dataset": "mnist"}) as ledger:
        for _ in range(STEPS):
            ledger.record_sample(sampling_probability=Q, population_size=60_000)
            ledger.record_sum_query(
                l2_norm_bound=KERNEL[0], noise_stddev=KERNEL[1], label="dense/kernel"
            )
            ledger.record_sum_query(l2_norm_bound=BIAS[0], noise_stddev=BIAS[1], label="dense/bias")
    return path


@pytest.fixture
def ledger_file(tmp_path: Path) -> Path:
    return write_ledger(tmp_path / "run.dpl")


@pytest.fixture(scope="module")
def shared_ledger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_ledger(tmp_path_factory.mktemp("report") / "run.dpl")
