"""A make_private run that saves ``model.state_dict()`` after step k and is then killed.

    python killed_after_checkpoint.py LEDGER WEIGHTS K

Trains a tiny linear model with Poisson batches (q = 1/8 of 64 records) for exactly K optimizer
steps, saves the weights alone with ``torch.save`` and kills itself with SIGKILL (see
``tests/killed_runs.py``).
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.nn.functional as F  # noqa: N812
from torch.utils.data import TensorDataset

from dpledger import PrivacyLedger
from dpledger.adapters.torch import make_private


def main(ledger_path: str, weights_path: str, steps: int) -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    model = torch.nn.Linear(4, 2)
    model, optimizer, loader = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        sampling_probability=0.125,
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        ledger=PrivacyLedger(ledger_path),  # default buffering
        seed=0,
    )
    taken = 0
    while True:
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            taken += 1
            if taken == steps:
                torch.save(model.state_dict(), weights_path)  # the weights alone
                os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
