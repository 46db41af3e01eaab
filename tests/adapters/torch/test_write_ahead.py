"""Write-ahead: a step's events are in the ledger file before the step changes a parameter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch.utils.data import TensorDataset

from dpledger import PrivacyLedger
from dpledger.adapters.torch import make_private
from dpledger.mechanisms.correlated import CorrelatedNoiseSpec
from tests.killed_runs import run_until_killed

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
@pytest.mark.parametrize("steps", [7, 23, 41])
def test_a_run_killed_after_a_weights_only_checkpoint_keeps_every_applied_step(
    tmp_path: Path, steps: int
) -> None:
    ledger_path, weights = tmp_path / "run.dpl", tmp_path / "model.pt"
    run_until_killed(
        HERE / "killed_after_checkpoint.py", str(ledger_path), str(weights), str(steps)
    )
    assert set(torch.load(weights)) == {"weight", "bias"}  # the checkpoint was saved
    ledger = PrivacyLedger.load(ledger_path)
    # the saved model embodies `steps` steps; each was written before it was applied
    assert ledger.num_steps == steps
    assert ledger.closed_cleanly is False


def _events_on_disk(path: Path) -> list[str]:
    """The kinds of the event lines the file holds now, read through a separate open() (the
    notes, e.g. the noise's provenance, are no events)."""
    with open(path, encoding="utf-8") as fp:
        lines = fp.read().splitlines()
    kinds = [line.split('"kind":"', 1)[1].split('"', 1)[0] for line in lines[1:]]
    return [kind for kind in kinds if kind != "note"]


def test_every_optimizer_step_is_in_the_file_when_step_returns(tmp_path: Path) -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    path = tmp_path / "run.dpl"
    model, optimizer, loader = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        sampling_probability=0.25,
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        ledger=PrivacyLedger(path),  # default buffer_size and flush_interval
        seed=0,
        groups="per_layer",
    )
    for taken, (x, y) in enumerate(loader, start=1):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        kinds = _events_on_disk(path)
        assert kinds.count("sample") == taken
        assert kinds.count("sum_query") == 2 * taken  # one query per layer
    assert taken == 4


def test_every_correlated_noise_step_is_in_the_file_when_step_returns(tmp_path: Path) -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(24, 3), torch.randn(24))
    model = torch.nn.Linear(3, 1)
    path = tmp_path / "run.dpl"
    model, optimizer, loader = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        noise=CorrelatedNoiseSpec(strategy="bandmf", num_steps=8, period=4, bands=2),
        ledger=PrivacyLedger(path),  # default buffer_size and flush_interval
        seed=0,
    )
    taken = 0
    for x, y in loader:
        optimizer.zero_grad()
        F.mse_loss(model(x).squeeze(-1), y).backward()
        optimizer.step()
        taken += 1
        assert _events_on_disk(path) == ["correlated_release"] + ["stream_step"] * taken
    assert taken == 4
