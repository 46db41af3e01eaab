"""Train a small CNN on scikit-learn's handwritten digits with DP-SGD and account for it.

The model, the optimizer and the data are made private in one call (``make_private``): every
step draws a Poisson sample (each training image with probability q), clips each example's
gradient to C, adds Gaussian noise and records the sampling event and the sum query in a ledger
file. The noise multiplier is calibrated so that the planned run spends at most the target ε at
δ = 1e-5. At the end the script prints the test accuracy and the ε that every accountant
computes by replaying the ledger file — the only input accounting needs.

    python examples/torch_digits.py [--ledger torch_digits.dpl] [--optimizer sgd|adam|adamw]
    dpledger epsilon torch_digits.dpl --delta 1e-5      # the same numbers from the command line
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

from dpledger import DPLedgerError, PrivacyLedger
from dpledger.accountants import make_accountant
from dpledger.accountants.base import ACCOUNTANT_MODULES, SCHEME_SPECIFIC_ACCOUNTANTS
from dpledger.adapters.torch import make_private

DELTA = 1e-5
SETTINGS = {
    # the wrapped optimizer's settings
    "sgd": {"lr": 1.0},
    "adam": {"lr": 4e-3},
    "adamw": {"lr": 4e-3, "weight_decay": 1e-4},
}


class DigitsCNN(nn.Module):
    """Two 3×3 convolutions with GroupNorm, max-pooling, two linear layers (about 10k weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.norm1 = nn.GroupNorm(4, 16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.norm2 = nn.GroupNorm(4, 32)
        self.fc1 = nn.Linear(32 * 2 * 2, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.norm1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.norm2(self.conv2(x))), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def digits(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """The 1797 8×8 digits, pixels scaled to [0, 1], split 80/20 at random."""
    data = load_digits()
    x = torch.tensor(data.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    split = int(0.8 * len(y))
    return TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:])


@dataclass(frozen=True)
class DemoResult:
    """What a training run produced."""

    accuracy: float
    noise_multiplier: float
    steps: int
    ledger_path: Path
    seconds: float


def train(
    ledger_path: str | Path,
    *,
    optimizer: str = "sgd",
    target_epsilon: float = 4.0,
    epochs: int = 15,
    sampling_probability: float = 0.05,
    l2_norm_bound: float = 1.0,
    seed: int = 0,
    noise_seed: int | None = None,
) -> DemoResult:
    """Train the CNN with DP and return its test accuracy; the ledger is written to the path.

    ``seed`` seeds the data split and the model's initialisation; the noise and the batches
    come from the operating system unless ``noise_seed`` is given (for tests and research:
    the ledger then records a caller-given seed and ``dpledger epsilon`` flags it).
    """
    start = time.perf_counter()
    torch.manual_seed(seed)
    train_set, test_set = digits(seed)
    model = DigitsCNN()
    settings = dict(SETTINGS[optimizer])
    lr = settings.pop("lr")
    base = {
        "sgd": torch.optim.SGD,
        "adam": torch.optim.Adam,
        "adamw": torch.optim.AdamW,
    }[optimizer](model.parameters(), lr=lr, **settings)
    path = Path(ledger_path)
    if path.exists():
        path.unlink()  # the demo starts over; a real run resumes: PrivacyLedger(path, resume=True)
    ledger = PrivacyLedger(path, metadata={"example": "torch_digits", "optimizer": optimizer})
    model, dp_optimizer, loader = make_private(
        model,
        base,
        train_set,
        sampling_probability=sampling_probability,
        l2_norm_bound=l2_norm_bound,
        target_epsilon=target_epsilon,
        delta=DELTA,
        epochs=epochs,
        ledger=ledger,
        seed=noise_seed,  # None: noise and batches from the OS
    )
    for _ in range(epochs):
        model.train()
        for x, y in loader:
            dp_optimizer.zero_grad()
            dp_optimizer.backward(F.cross_entropy(model(x), y))  # or loss.backward()
            dp_optimizer.step()
    ledger.close()
    model.eval()
    x_test, y_test = test_set.tensors
    with torch.no_grad():
        accuracy = float((model(x_test).argmax(1) == y_test).float().mean())
    return DemoResult(
        accuracy=accuracy,
        noise_multiplier=dp_optimizer.noise_multiplier,
        steps=ledger.num_steps,
        ledger_path=path,
        seconds=time.perf_counter() - start,
    )


@dataclass(frozen=True)
class EpsilonRow:
    """One accountant's answer for the ledger, or why there is none."""

    accountant: str
    epsilon: float | None
    kind: str
    note: str = ""


def epsilon_table(ledger_path: str | Path, *, delta: float = DELTA) -> list[EpsilonRow]:
    """ε at δ of the ledger file from every accountant dpledger knows (``ACCOUNTANT_MODULES``)."""
    ledger = PrivacyLedger.load(ledger_path)
    rows = []
    for name in ACCOUNTANT_MODULES:
        if name in SCHEME_SPECIFIC_ACCOUNTANTS:  # for one sampling scheme, not this Poisson run
            continue
        try:
            accountant = make_accountant(name)
        except ImportError as err:
            rows.append(EpsilonRow(name, None, "-", f"not available here ({err})"))
            continue
        try:
            result = accountant.epsilon(ledger, delta=delta)
        except DPLedgerError as err:  # an accountant that cannot analyse this ledger says why
            rows.append(EpsilonRow(name, None, "-", f"cannot analyse this ledger ({err})"))
            continue
        rows.append(EpsilonRow(name, result.epsilon, result.kind.value))
    return rows


def main(argv: list[str] | None = None) -> list[EpsilonRow]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ledger", default="torch_digits.dpl", help="ledger file to write")
    parser.add_argument("--optimizer", choices=sorted(SETTINGS), default="sgd")
    parser.add_argument("--target-epsilon", type=float, default=4.0)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0, help="seeds the data and the model")
    parser.add_argument(
        "--noise-seed",
        type=int,
        default=None,
        help="seeds the noise and the batches, for tests only (default: the OS's entropy)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # a model this small gains nothing from intra-op threads
    result = train(
        args.ledger,
        optimizer=args.optimizer,
        target_epsilon=args.target_epsilon,
        epochs=args.epochs,
        seed=args.seed,
        noise_seed=args.noise_seed,
    )
    print(
        f"DP-{args.optimizer.upper()} on digits: {result.steps} steps, noise multiplier "
        f"{result.noise_multiplier:.3f}, {result.seconds:.1f} s"
    )
    print(f"test accuracy: {result.accuracy:.3f}")
    print(f"ledger: {result.ledger_path}")
    print(f"\nε at δ = {DELTA:g}, replayed from the ledger file:")
    rows = epsilon_table(result.ledger_path)
    for row in rows:
        if row.epsilon is None:
            print(f"  {row.accountant:4s}  {'-':>8s}  {row.note}")
        else:
            print(f"  {row.accountant:4s}  {row.epsilon:8.4f}  {row.kind}")
    return rows


if __name__ == "__main__":
    main()
