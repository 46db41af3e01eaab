"""Correlated-noise generators against independent noise: step time and memory, same run.

Run from the repository root:

    PYTHONPATH=. python benchmarks/correlated_noise_bench.py                  # d = 1e6, T = 512
    PYTHONPATH=. python benchmarks/correlated_noise_bench.py --dim 10000 --steps 64   # smoke

For each generator (independent Gaussian noise as DP-SGD draws it; tree aggregation, standard
and Honaker; banded Toeplitz BandMF with several band counts; BLT with a few buffers) it prints
the median time of one step's noise, its ratio to independent noise measured in the same run,
the floats the generator keeps between steps (``buffer_floats``, O(b·d) for BandMF) and the
peak memory of one step traced by ``tracemalloc``. The factorizations themselves are built
before timing (they are O(T²) matrices, built once per run).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
import tracemalloc
from collections.abc import Callable

import numpy as np

from dpledger.mechanisms.correlated import noise_for, optimize_banded_toeplitz, tree_factorization
from dpledger.mechanisms.correlated.strategies import blt_factorization


def _time_steps(step: Callable[[], object], steps: int) -> tuple[float, int]:
    """Median seconds per step over ``steps`` steps, and the peak traced bytes of one step."""
    times = []
    for _ in range(steps - 1):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    tracemalloc.start()
    step()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return statistics.median(times), peak


def main() -> None:
    """Parse the arguments, run every generator, print one row each."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dim", type=int, default=1_000_000, help="d, coordinates per step")
    parser.add_argument("--steps", type=int, default=512, help="T, steps of the stream")
    parser.add_argument("--bands", default="2,8,32", help="comma-separated BandMF band counts")
    args = parser.parse_args()
    d, t = args.dim, args.steps
    print(f"machine: {platform.platform()}, {platform.processor() or platform.machine()}")
    print(f"d = {d}, T = {t}; median seconds per step, ratio to independent noise (same run)")
    rng = np.random.default_rng(0)
    base, base_peak = _time_steps(lambda: rng.standard_normal(d), t)
    rows = [("independent", base, 0, base_peak)]
    gens = {
        "tree": noise_for(tree_factorization(t), dim=d, noise_stddev=1.0, seed=0),
        "tree_honaker": noise_for(
            tree_factorization(t, honaker=True), dim=d, noise_stddev=1.0, seed=0
        ),
        "blt (3 buffers)": noise_for(
            blt_factorization(t, omega=[-0.3, -0.1, -0.05], theta=[0.2, 0.6, 0.95]),
            dim=d,
            noise_stddev=1.0,
            seed=0,
        ),
    }
    for b in (int(x) for x in args.bands.split(",")):
        gens[f"bandmf b={b}"] = noise_for(
            optimize_banded_toeplitz(num_steps=t, bands=b), dim=d, noise_stddev=1.0, seed=0
        )
    for name, gen in gens.items():
        seconds, peak = _time_steps(gen.next, t)
        rows.append((name, seconds, gen.buffer_floats(), peak))
    print(f"{'generator':<18}  {'s/step':>10}  {'ratio':>6}  {'kept floats':>12}  {'peak MiB':>9}")
    for name, seconds, floats, peak in rows:
        print(
            f"{name:<18}  {seconds:>10.3g}  {seconds / base:>6.2f}  {floats:>12}  "
            f"{peak / 2**20:>9.1f}"
        )


if __name__ == "__main__":
    main()
