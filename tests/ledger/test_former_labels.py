"""Ledger files written with the PyTorch adapter's former flat-clipping label ("gradients") load,
verify and replay to the same ε as the one label both adapters write now: labels never enter ε."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpledger import PrivacyLedger, verify_ledger
from dpledger.accountants import PldAccountant, RdpAccountant
from dpledger.mechanisms.config import FLAT_LABEL

FORMER_TORCH_LABEL = "gradients"
Q, N, STEPS, DELTA = 0.05, 1_000, 40, 1e-5


def _write(path: Path, label: str) -> None:
    """A flat-clipping run as the adapters record it: a sample, then one sum query per step."""
    with PrivacyLedger(path) as ledger:
        for step in range(STEPS):
            bound = 1.0 if step < STEPS // 2 else 0.5  # a clip bound changed mid-run
            ledger.record_sample(sampling_probability=Q, population_size=N)
            ledger.record_sum_query(l2_norm_bound=bound, noise_stddev=1.1 * bound, label=label)


def test_the_flat_label_is_the_keras_one() -> None:
    assert FLAT_LABEL == "gradient"


@pytest.mark.slow
@pytest.mark.parametrize("accountant", [RdpAccountant(), PldAccountant()], ids=["rdp", "pld"])
def test_a_file_with_the_former_label_replays_to_the_same_epsilon(tmp_path, accountant) -> None:
    former, current = tmp_path / "former.dpl", tmp_path / "current.dpl"
    _write(former, FORMER_TORCH_LABEL)
    _write(current, FLAT_LABEL)
    assert verify_ledger(former).ok
    old, new = PrivacyLedger.load(former), PrivacyLedger.load(current)
    assert old.labels == (FORMER_TORCH_LABEL,) and new.labels == (FLAT_LABEL,)
    assert old.num_steps == new.num_steps == STEPS
    assert accountant.epsilon(old, delta=DELTA).epsilon == (
        accountant.epsilon(new, delta=DELTA).epsilon
    )
