"""Random allocation (balls-in-bins batches): dpledger's certified bound against the peers.

For each setting (k batches per epoch, noise multiplier z, epochs, δ) this prints, in one run on
one machine, the ε and the median seconds of:

* dpledger's ``random_allocation`` bound (certified, with amplification);
* the ``random-allocation`` package (Feldman & Shenfeld's accountant, PyPI 1.0.5, discretisation
  1e-4): its best provable bound (``allocation_epsilon_combined``: the smallest of its analytic,
  RDP, decomposition and recursive bounds; RDP orders 2..60 as in its paper experiments) and its
  lower bound (one epoch only), when the package is installed;
* dpledger's Monte-Carlo estimate (``balls_in_bins``, not certified) with its upper confidence
  bound;
* dpledger's no-amplification bound (the ``pld`` accountant, each epoch one Gaussian).

and the ratios of the peers' times and values to dpledger's. The first row is the setting of
google/differential-privacy pull request 414's ``test_random_allocation_basic`` (σ = 2, 10 of 100
steps, i.e. 10 epochs of 10 steps, δ = 1e-6; its stated ε is 2.4265).

Usage: ``PYTHONPATH=. python benchmarks/random_allocation_bench.py [--repeats 3]
[--mc-samples 200000] [--skip-package]``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

from dpledger import SamplingEvent
from dpledger.accountants import make_accountant
from dpledger.ledger.events import NeighboringRelation
from dpledger.ledger.steps import CompressedLedger, StepRun

N = 1_000_000
# (k, z, epochs, δ)
SETTINGS = [
    (10, 2.0, 10, 1e-6),
    (10, 1.0, 1, 1e-3),
    (100, 1.0, 1, 1e-4),
    (50, 0.8, 1, 1e-3),
    (10, 1.0, 5, 1e-3),
    (234, 1.1, 15, 1e-5),
]


def timed(fn: Callable[[], Any], repeats: int) -> tuple[Any, float]:
    """The value of ``fn()`` and the median seconds over ``repeats`` calls."""
    times, value = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - start)
    return value, statistics.median(times)


def ledger(k: int, z: float, epochs: int) -> CompressedLedger:
    """E epochs of k balls-in-bins steps at noise multiplier z."""
    runs = []
    for _ in range(epochs):
        start = SamplingEvent.balls_in_bins(k, N, epoch_start=True)
        runs.append(StepRun(1.0 / k, z, 1, sampling=start))
        if k > 1:
            runs.append(StepRun(1.0 / k, z, k - 1, sampling=SamplingEvent.balls_in_bins(k, N)))
    return CompressedLedger(neighboring=NeighboringRelation.ADD_REMOVE, runs=tuple(runs))


def package_bounds(k: int, z: float, epochs: int, delta: float) -> tuple[float, float | None]:
    """The random-allocation package's best provable ε and (one epoch) its lower bound."""
    from random_allocation.comparisons.definitions import Direction
    from random_allocation.comparisons.structs import PrivacyParams, SchemeConfig
    from random_allocation.random_allocation_scheme.combined import (
        allocation_epsilon_combined,
    )
    from random_allocation.random_allocation_scheme.lower_bound import (
        allocation_epsilon_lower_bound,
    )

    config = SchemeConfig(discretization=1e-4, allocation_direct_alpha_orders=list(range(2, 61)))
    params = PrivacyParams(sigma=z, num_steps=k, num_selected=1, num_epochs=epochs, delta=delta)
    best = allocation_epsilon_combined(params, config, Direction.BOTH)
    lower = None
    if epochs == 1:
        lower = allocation_epsilon_lower_bound(params, config, Direction.BOTH)
    return best, lower


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mc-samples", type=int, default=200_000)
    parser.add_argument("--skip-package", action="store_true")
    args = parser.parse_args()
    print(f"# machine: {platform.processor() or platform.machine()}, {platform.platform()}")
    print(f"# median of {args.repeats} runs (the package: 1 run); ε (seconds)\n")
    print(
        "| k | z | epochs | δ | dpledger random_allocation | random-allocation best | "
        "its lower bound | ratio ε (peer / ours) | ratio time (peer / ours) | "
        "Monte Carlo estimate (upper conf.) | pld, no amplification |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for k, z, epochs, delta in SETTINGS:
        print(row(k, z, epochs, delta, args))


def row(k: int, z: float, epochs: int, delta: float, args: argparse.Namespace) -> str:
    """One setting's line of the table."""
    ours_acc = make_accountant("random_allocation")
    mc_acc = make_accountant("balls_in_bins", samples=args.mc_samples, time_budget_s=600)
    pld_acc = make_accountant("pld")
    comp = ledger(k, z, epochs)
    ours, t_ours = timed(lambda: ours_acc.epsilon(comp, delta=delta).epsilon, args.repeats)
    mc, t_mc = timed(lambda: mc_acc.epsilon(comp, delta=delta), 1)
    plain, _ = timed(lambda: pld_acc.epsilon(comp, delta=delta).epsilon, 1)
    best_text = lower_text = ratio_eps = ratio_time = "-"
    if not args.skip_package:
        try:
            (best, lower), t_pkg = timed(lambda: package_bounds(k, z, epochs, delta), 1)
        except ImportError:
            best_text = "not installed"
        else:
            best_text = f"{best:.5g} ({t_pkg:.1f})"
            lower_text = "-" if lower is None else f"{lower:.5g}"
            ratio_eps = f"{best / ours:.3f}"
            ratio_time = f"{t_pkg / t_ours:.0f}×"
    return (
        f"| {k} | {z} | {epochs} | {delta:g} | {ours:.5g} ({t_ours:.2f}) | {best_text} | "
        f"{lower_text} | {ratio_eps} | {ratio_time} | {mc.epsilon:.4g} "
        f"({mc.upper_confidence:.4g}; {t_mc:.1f}) | {plain:.4g} |"
    )


if __name__ == "__main__":
    main()
