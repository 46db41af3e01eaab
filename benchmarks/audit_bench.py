"""Time a black-box privacy audit of the PyTorch adapter: 1,000 training runs on the digits.

The audit is the one of ``examples/audit_digits.py`` (``dpledger.audit.torch_audit``): multinomial
logistic regression on the 1797 digits (plus the canary in half of the runs), 30 DP-SGD steps with
Poisson sampling at q = 0.1 (expected batch ≈ 180), z calibrated to ε = 2 (RDP) at δ = 1e-5,
scored by the loss on an out-of-distribution canary. ``run_distinguishing_game`` runs the 1,000
runs (500 per side) in ``--workers`` spawned processes, each with one torch thread, and the
Clopper–Pearson bound (held-out split) is compared with the ledger's PRV ε. The same is done for
the optimizer with the batch-size noise bug.

Then, to show what limits the audit, one training run is timed inline (medians over interleaved
repeats) three ways on the same Poisson batches:

* ``dpledger``: the audit's run (``DPOptimizer`` around ``torch.optim.SGD``: per-example norms,
  clipping, float64 noise, the ledger's events, the fixed-denominator average);
* ``non-private``: the same loop with plain SGD (forward, backward, step): the floor;
* ``opacus``: Opacus's ``GradSampleModule`` and ``DPOptimizer`` (hooks mode, Poisson batches given
  to it, ``expected_batch_size`` = q·n), when Opacus is installed;

and the run is split into its fixed cost (building the model, sampler and optimizer) and its cost
per step (from runs of 1 and of 30 steps); the start-up of the worker processes (spawn, importing
torch and dpledger) is timed separately.

Run: ``PYTHONPATH=. python benchmarks/audit_bench.py`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import functools
import multiprocessing
import os
import platform
import statistics
import subprocess
import time
import warnings
from typing import Any

import attrs
import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from dpledger.accountants import make_accountant
from dpledger.audit import HeldOutSplit, audit_verdict, run_distinguishing_game
from dpledger.audit.torch_audit import (
    BlackBoxDigitsAudit,
    representative_ledger,
    run_black_box_digits,
    train_black_box_digits,
)

DELTA = 1e-5
CONFIDENCE = 0.95


def machine() -> str:
    try:
        model = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout.split(
            "Model name:"
        )[1]
        model = model.splitlines()[0].strip()
    except (OSError, IndexError):
        model = platform.processor() or platform.machine()
    try:
        import opacus

        peer = f"opacus {opacus.__version__}"
    except ImportError:  # pragma: no cover - depends on the environment
        peer = "opacus not installed"
    return (
        f"{model}, nproc {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}; "
        f"python {platform.python_version()}, torch {torch.__version__}, "
        f"numpy {np.__version__}, {peer}"
    )


# ---------------------------------------------------------------------------------- the audit
def audit(config: BlackBoxDigitsAudit, *, runs: int, workers: int, seed: int) -> dict[str, Any]:
    """Run the game with ``runs`` runs in all; time it and bound it."""
    start = time.perf_counter()
    game = run_distinguishing_game(
        functools.partial(train_black_box_digits, config=config),
        runs_per_side=runs // 2,
        seed=seed,
        workers=workers,
        chunk_size=10,
        progress=False,
    )
    wall = time.perf_counter() - start
    bound = game.epsilon_lower_bound(
        delta=DELTA, confidence=CONFIDENCE, selection=HeldOutSplit(seed=seed)
    )
    verdict = audit_verdict(bound, representative_ledger(config), accountant="prv")
    run_seconds = [r.seconds for r in (*game.runs_with_canary, *game.runs_without_canary)]
    return {
        "wall": wall,
        "median_run": statistics.median(run_seconds),
        "total_run": sum(run_seconds),
        "verdict": verdict,
        "counts": bound.counts,
    }


def _start_worker(_: int) -> float:
    """What a spawned worker does before its first run: import, load the digits."""
    start = time.perf_counter()
    from dpledger.audit import torch_audit

    torch_audit.digits_records()
    return time.perf_counter() - start


def worker_start_up(workers: int) -> float:
    """Seconds from creating a spawn pool to every worker having imported the audit code."""
    start = time.perf_counter()
    context = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        list(pool.map(_start_worker, range(workers)))
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------- one run, 3 ways
def _batches(config: BlackBoxDigitsAudit, seed: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    from dpledger.audit.torch_audit import _digits_tensors

    x, y = _digits_tensors(config.num_records)
    generator = torch.Generator().manual_seed(seed)
    batches = [
        (torch.rand(len(y), generator=generator) < config.sampling_probability).nonzero().view(-1)
        for _ in range(config.steps)
    ]
    return x, y, batches


def non_private_run(config: BlackBoxDigitsAudit, seed: int) -> None:
    x, y, batches = _batches(config, seed)
    model = nn.Linear(64, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate)
    for b in batches:
        optimizer.zero_grad()
        F.cross_entropy(model(x[b]), y[b]).backward()
        optimizer.step()


def opacus_run(config: BlackBoxDigitsAudit, seed: int) -> None:
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer as OpacusDPOptimizer

    x, y, batches = _batches(config, seed)
    model = GradSampleModule(nn.Linear(64, 10))
    optimizer = OpacusDPOptimizer(
        torch.optim.SGD(model.parameters(), lr=config.learning_rate),
        noise_multiplier=config.noise_multiplier,
        max_grad_norm=config.max_grad_norm,
        expected_batch_size=round(config.sampling_probability * len(y)),
    )
    for b in batches:
        optimizer.zero_grad()
        F.cross_entropy(model(x[b]), y[b]).backward()
        optimizer.step()


def dpledger_run(config: BlackBoxDigitsAudit, seed: int) -> None:
    run_black_box_digits(config, include_canary=True, seed=seed)


def time_runs(functions: dict[str, Any], repeats: int) -> dict[str, float]:
    for f in functions.values():
        f(0)
    times: dict[str, list[float]] = {k: [] for k in functions}
    for r in range(repeats):
        for k, f in functions.items():  # interleaved: load drifts hit every row alike
            start = time.perf_counter()
            f(r + 1)
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1000, help="runs in all (half per side)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30, help="repeats of the inline timings")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-buggy", action="store_true", help="skip the buggy optimizer's audit")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # Opacus's hooks warn on every backward that the input needs no gradient (it does not).
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    print(machine())
    config = BlackBoxDigitsAudit.for_target_epsilon(target_epsilon=2.0, delta=DELTA)
    claim = make_accountant("prv").epsilon(config.claimed_ledger(), delta=DELTA).epsilon
    print(
        f"\n## Black-box audit: {args.runs} runs ({args.runs // 2} per side), "
        f"{args.workers} spawned workers, 1 torch thread each"
    )
    print(
        f"digits logistic regression, q = {config.sampling_probability}, T = {config.steps}, "
        f"z = {config.noise_multiplier:.4f}; claimed ε = {claim:.3f} (PRV) at δ = {DELTA:g}"
    )
    implementations = ["correct"] if args.no_buggy else ["correct", "batch_size_bug"]
    print(f"{'optimizer':16s} {'wall s':>8s} {'ms/run':>8s} {'runs/s':>8s}  bound, verdict")
    for k, implementation in enumerate(implementations):
        audited = attrs.evolve(config, implementation=implementation)
        r = audit(audited, runs=args.runs, workers=args.workers, seed=args.seed + k)
        v = r["verdict"]
        print(
            f"{implementation:16s} {r['wall']:8.1f} {r['median_run'] * 1e3:8.1f} "
            f"{args.runs / r['wall']:8.1f}  ε ≥ {v.lower_bound:.3f} ({r['counts']}): {v.status}"
        )
    print(
        f"worker start-up (spawn, import torch + dpledger, load digits): "
        f"{worker_start_up(args.workers):.1f} s for {args.workers} workers"
    )

    print(f"\n## One training run inline (median of {args.repeats} interleaved repeats)")
    functions = {
        "dpledger": functools.partial(dpledger_run, config),
        "non-private": functools.partial(non_private_run, config),
    }
    try:
        import opacus  # noqa: F401

        functions["opacus"] = functools.partial(opacus_run, config)
    except ImportError:  # pragma: no cover - depends on the environment
        pass
    med = time_runs(functions, args.repeats)
    base = med["non-private"]
    print(f"{'run':16s} {'ms/run':>8s} {'x non-private':>14s} {'x opacus':>9s}")
    for name, seconds in med.items():
        rel = f"{seconds / med['opacus']:9.2f}" if "opacus" in med else f"{'-':>9s}"
        print(f"{name:16s} {seconds * 1e3:8.1f} {seconds / base:14.2f} {rel}")
    one = attrs.evolve(config, steps=1)
    split = time_runs(
        {
            "1 step": functools.partial(dpledger_run, one),
            f"{config.steps} steps": functools.partial(dpledger_run, config),
        },
        args.repeats,
    )
    per_step = (split[f"{config.steps} steps"] - split["1 step"]) / (config.steps - 1)
    fixed = split["1 step"] - per_step
    print(
        f"dpledger run = {fixed * 1e3:.1f} ms fixed (model, sampler, optimizer) + "
        f"{config.steps} × {per_step * 1e3:.2f} ms per step"
    )


if __name__ == "__main__":
    main()
