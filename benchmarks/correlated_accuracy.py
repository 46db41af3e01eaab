"""Test accuracy at equal ε: DP-SGD against tree aggregation and amplified BandMF (PyTorch).

Run from the repository root (about 3.5 minutes on a loaded 2-core CPU):

    PYTHONPATH=. python benchmarks/correlated_accuracy.py                    # 3 seeds
    PYTHONPATH=. python benchmarks/correlated_accuracy.py --seeds 1 --epochs 2   # smoke

Two tasks: scikit-learn's digits with the CNN of ``examples/torch_digits.py`` and a small text
model (an embedding and an LSTM) on generated token sequences, whose label is whether more
"positive" than "negative" tokens occur (no download). Three mechanisms, each trained for the
same T steps with the same expected batch size B, clip bound S = 1 and SGD learning rates
(every rate of ``--lrs`` is run and shown, none picked on the test set), with its noise
multiplier z calibrated to the same ε at δ = 1e-5 by a bisection over z on the PRV
accountant's certified upper bound of its own ledger:

* ``dpsgd``: Poisson sampling with q = B / n, independent noise (``make_private`` default);
* ``tree``: tree aggregation with Honaker's estimator, no sampling: the records split into
  P = round(n / B) fixed groups visited in turn (``noise=CorrelatedNoiseSpec("tree_honaker")``);
* ``bandmf``: BandMF with ``bands`` bands, amplified: P = bands groups, each step
  Poisson-samples its group with q = B·P / n (Choquette-Choo et al. 2023, "Amplified Banded
  Matrix Factorization").

After training, ε is recomputed from the run's ledger (the number in the table). It also
reports the mean optimizer step time of each mechanism (from the same runs: a loaded machine
makes these rough), the time of one noise vector of the model's size against an independent
draw, and the floats each generator holds between steps (O(bands × parameters) for BandMF).
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from scipy import optimize
from torch import nn
from torch.utils.data import TensorDataset

from dpledger import PrivacyLedger
from dpledger.accountants import calibrate_noise_multiplier, make_accountant
from dpledger.adapters.torch import make_private
from dpledger.mechanisms.correlated import CorrelatedNoiseSpec, noise_for
from dpledger.mechanisms.correlated.release import release_event

# The digits task is the example's: its CNN and its data split.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from torch_digits import DigitsCNN, digits

DELTA = 1e-5
MECHANISMS = ("dpsgd", "tree", "bandmf")


class TextLSTM(nn.Module):
    """Embedding (20 tokens, 16 dims), a one-layer LSTM (32 units), a linear classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.lstm = nn.LSTM(16, 32, batch_first=True)
        self.out = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.embed(x))
        return self.out(h[:, -1])


@dataclass(frozen=True)
class Task:
    name: str
    train: TensorDataset
    test: TensorDataset
    model: Callable[[], nn.Module]


def digits_task() -> Task:
    train, test = digits(0)
    return Task("digits CNN", train, test, DigitsCNN)


def text_task(n_train: int = 2000, n_test: int = 500, length: int = 16) -> Task:
    """Sequences of 16 tokens from 20; tokens 1–5 are positive, 6–10 negative, the rest
    neutral; the label is 1 when positive tokens outnumber negative ones (ties resampled)."""
    rng = np.random.default_rng(0)
    xs, ys = [], []
    while len(ys) < n_train + n_test:
        seq = rng.integers(0, 20, size=length)
        pos = int(((seq >= 1) & (seq <= 5)).sum())
        neg = int(((seq >= 6) & (seq <= 10)).sum())
        if pos != neg:
            xs.append(seq)
            ys.append(int(pos > neg))
    x = torch.tensor(np.array(xs), dtype=torch.int64)
    y = torch.tensor(ys, dtype=torch.int64)
    return Task(
        "text LSTM",
        TensorDataset(x[:n_train], y[:n_train]),
        TensorDataset(x[n_train:], y[n_train:]),
        TextLSTM,
    )


def _release_epsilon(spec: CorrelatedNoiseSpec, z: float, n: int) -> float:
    """ε (PRV upper bound) of the release a run of ``spec`` records, with S = 1, σ = z."""
    schema, q = spec.scheme(population_size=n, seed=0).participation()
    ledger = PrivacyLedger()
    ledger.record_correlated_release(
        release_event(
            spec.factorization(), schema, l2_norm_bound=1.0, noise_stddev=z, sampling_probability=q
        )
    )
    return make_accountant("prv").epsilon(ledger, delta=DELTA).epsilon


def calibrate(spec: CorrelatedNoiseSpec, epsilon: float, n: int) -> float:
    """The z whose release has ε = ``epsilon`` (bisection on log z, to 0.1%)."""

    def gap(log_z: float) -> float:
        return _release_epsilon(spec, math.exp(log_z), n) - epsilon

    log_z = optimize.brentq(gap, math.log(0.2), math.log(200.0), xtol=1e-3)
    z = math.exp(log_z) * 1.001  # the upper end: ε(z) ≤ target
    assert _release_epsilon(spec, z, n) <= epsilon * (1 + 1e-9)
    return z


def specs(n: int, batch: int, steps: int, bands: int) -> dict[str, CorrelatedNoiseSpec]:
    period = round(n / batch)
    return {
        "tree": CorrelatedNoiseSpec(strategy="tree_honaker", num_steps=steps, period=period),
        "bandmf": CorrelatedNoiseSpec(
            strategy="bandmf",
            num_steps=steps,
            period=bands,
            bands=bands,
            amplified=True,
            sampling_probability=batch * bands / n,
        ),
    }


def accuracy(model: nn.Module, data: TensorDataset) -> float:
    model.eval()
    with torch.no_grad():
        x, y = data.tensors
        return float((model(x).argmax(1) == y).float().mean())


def train_one(
    task: Task,
    mechanism: str,
    z: float,
    spec: CorrelatedNoiseSpec | None,
    q: float,
    seed: int,
    lr: float,
) -> tuple[float, float, float]:
    """(test accuracy, ε of the run's ledger, mean step seconds)."""
    torch.manual_seed(seed)
    model = task.model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    if spec is None:
        steps = None
        model, dp, loader = make_private(
            model, opt, task.train, l2_norm_bound=1.0, noise_multiplier=z,
            sampling_probability=q, seed=seed,
        )  # fmt: skip
    else:
        model, dp, loader = make_private(
            model, opt, task.train, l2_norm_bound=1.0, noise_multiplier=z, noise=spec, seed=seed
        )
        steps = spec.num_steps
    total = steps if steps is not None else TOTAL_STEPS[task.name]
    taken, seconds = 0, 0.0
    while taken < total:
        for x, y in loader:
            model.train()
            start = time.perf_counter()
            dp.zero_grad()
            F.cross_entropy(model(x), y).backward()
            dp.step()
            seconds += time.perf_counter() - start
            taken += 1
            if taken == total:
                break
    assert dp.ledger is not None
    eps = make_accountant("prv").epsilon(dp.ledger, delta=DELTA).epsilon
    return accuracy(model, task.test), eps, seconds / taken


TOTAL_STEPS: dict[str, int] = {}
TIMING_STEPS = 128  # the stream length of the noise timing (its optimised BLT exists)


def noise_timing(dim: int, steps: int, bands: int, repeats: int = 30) -> list[tuple]:
    """(generator, seconds per noise vector, ratio to independent, floats held / dim)."""
    rng = np.random.default_rng(0)
    rows = []

    def timed(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    base = timed(lambda: rng.standard_normal(dim))
    rows.append(("independent", base, 1.0, 0.0))
    for name, spec in (
        ("tree_honaker", CorrelatedNoiseSpec(strategy="tree_honaker", num_steps=steps, period=1)),
        (
            f"bandmf (b={bands})",
            CorrelatedNoiseSpec(strategy="bandmf", num_steps=steps, period=1, bands=bands),
        ),
        (
            "blt (4 buffers)",
            CorrelatedNoiseSpec(strategy="blt", num_steps=steps, period=1, buffers=4),
        ),
    ):
        gen = noise_for(spec.factorization(), dim=dim, noise_stddev=1.0, seed=0)
        held = 0
        for _ in range(min(steps, 2 * bands)):  # fill the buffers
            gen.next()
            held = max(held, gen.buffer_floats())
        t = timed(gen.next) if gen.num_steps - gen.step >= repeats else float("nan")
        rows.append((name, t, t / base, max(held, gen.buffer_floats()) / dim))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--epsilon", type=float, default=4.0)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--bands", type=int, default=8)
    parser.add_argument("--lrs", default="1.0,0.25", help="SGD learning rates, each run")
    args = parser.parse_args()
    lrs = [float(v) for v in args.lrs.split(",")]
    torch.set_num_threads(1)
    print(
        f"# machine: {platform.machine()}, {platform.processor() or 'cpu'}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} torch thread"
    )
    print(
        f"# ε = {args.epsilon}, δ = {DELTA}, B = {args.batch}, S = 1, SGD (lr {args.lrs}), "
        f"{args.seeds} seeds"
    )
    for task in (digits_task(), text_task()):
        n = len(task.train)
        q = args.batch / n
        total = args.epochs * round(n / args.batch)
        TOTAL_STEPS[task.name] = total
        corr = specs(n, args.batch, total, args.bands)
        z = {
            "dpsgd": calibrate_noise_multiplier(
                target_epsilon=args.epsilon, delta=DELTA, sampling_probability=q, steps=total
            ).value,
            **{k: calibrate(s, args.epsilon, n) for k, s in corr.items()},
        }
        d = sum(p.numel() for p in task.model().parameters())
        print(f"\n## {task.name}: n = {n}, d = {d}, T = {total} steps ({args.epochs} epochs)")
        print(
            "| mechanism | lr | z | ε (run's ledger, PRV) | test accuracy (mean ± sd) | step ms |"
        )
        print("| --- | --- | --- | --- | --- | --- |")
        for mech in MECHANISMS:
            for lr in lrs:
                results = [
                    train_one(task, mech, z[mech], corr.get(mech), q, seed, lr)
                    for seed in range(args.seeds)
                ]
                accs = [r[0] for r in results]
                sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
                shown = ", ".join(f"{a:.3f}" for a in accs)
                print(
                    f"| {mech} | {lr:g} | {z[mech]:.3f} | {max(r[1] for r in results):.3f} | "
                    f"{statistics.mean(accs):.3f} ± {sd:.3f} ({shown}) "
                    f"| {1e3 * statistics.mean(r[2] for r in results):.1f} |"
                )
        print(f"\nnoise of one step, d = {d}, T = {TIMING_STEPS} (loaded machine: rough)")
        print("| generator | µs per step | × independent | floats held / d |")
        print("| --- | --- | --- | --- |")
        for name, t, ratio, held in noise_timing(d, TIMING_STEPS, args.bands):
            print(f"| {name} | {1e6 * t:.0f} | {ratio:.1f} | {held:.0f} |")


if __name__ == "__main__":
    main()
