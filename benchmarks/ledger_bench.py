"""Benchmark of the privacy ledger: recording, loading + verifying + compressing, peak memory.

What it measures (medians over repeats; the machine is shared and noisy, so ratios matter more
than seconds):

* recording events in memory, to a file with default buffering, and to a file with one write
  per step (``flush()`` after each step's events: the write-ahead write a mechanism's step
  makes), timed interleaved (events per second), and, as the peer, Opacus's accountant history
  (``RDPAccountant().step(noise_multiplier=, sample_rate=)``), which keeps a run-length history
  of (σ, q) per optimizer step, with the ratio of the time per step;
* steps of a NumPy mechanism (``sampled_step`` and one ``GaussianSumQuery.release`` of a
  ``--dim``-coordinate sum) with an in-memory ledger and with a ledger file (default buffering):
  what a training step pays for its ledger file, the write-ahead write of each step included;
* loading, verifying and compressing a ledger of ``--steps`` steps (two events each) with
  ``keep_events=False`` and ``keep_events=True``, for a noise schedule with few distinct values
  and for a worst case where every step has a different q;
* peak memory of those loads (peak RSS growth, and the tracemalloc peak, each in a fresh
  process), at ``--steps`` and at a tenth of it, to show what grows with the ledger.

Run from the repository root::

    PYTHONPATH=. python benchmarks/ledger_bench.py            # the figures in RESULTS.md
    PYTHONPATH=. python benchmarks/ledger_bench.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dpledger import PrivacyLedger, __version__
from dpledger.mechanisms import GaussianSumQuery, sampled_step

ROOT = Path(__file__).resolve().parents[1]
SIGMA_EVERY = 10_000  # the noise schedule changes every this many steps


def sigma_at(step: int) -> float:
    return 1.0 + 0.01 * (step // SIGMA_EVERY)


def record_steps(
    ledger: PrivacyLedger, steps: int, *, distinct_q: bool = False, write_ahead: bool = False
) -> None:
    sample = ledger.record_sample
    query = ledger.record_sum_query
    flush = ledger.flush
    for i in range(steps):
        q = 0.004 + i * 1e-12 if distinct_q else 0.004
        sample(sampling_probability=q, population_size=60_000)
        query(l2_norm_bound=1.0, noise_stddev=sigma_at(i), label="model")
        if write_ahead:
            flush()  # one write per step, as a mechanism's release makes


def median_time(fn, repeats: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def interleaved_medians(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """The median time of each function over ``repeats`` rounds that call each once, in turn,
    so that a change in the machine's load hits every function alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def bench_recording(events: int, repeats: int, tmp: Path) -> dict[str, float]:
    steps = events // 2

    def in_memory() -> None:
        record_steps(PrivacyLedger(), steps)

    counter = iter(range(10**9))

    def to_file(write_ahead: bool = False) -> None:
        path = tmp / f"rec-{next(counter)}.dpl"
        with PrivacyLedger(path) as ledger:  # default buffering; close() flushes and fsyncs
            record_steps(ledger, steps, write_ahead=write_ahead)
        path.unlink()

    med = interleaved_medians(
        {"memory": in_memory, "file": to_file, "ahead": lambda: to_file(write_ahead=True)},
        repeats,
    )
    mem, fil, ahead = med["memory"], med["file"], med["ahead"]
    out = {
        "events": 2 * steps,
        "memory_s": mem,
        "memory_events_per_s": 2 * steps / mem,
        "file_s": fil,
        "file_events_per_s": 2 * steps / fil,
        "file_write_ahead_s": ahead,
        "file_write_ahead_events_per_s": 2 * steps / ahead,
        "write_ahead_cost_us_per_step": (ahead - fil) / steps * 1e6,
    }
    try:
        from opacus.accountants import RDPAccountant
    except ImportError:
        print("opacus is not installed: no peer timing")
        return out

    def opacus_history() -> None:
        accountant = RDPAccountant()
        step = accountant.step
        for i in range(steps):
            step(noise_multiplier=sigma_at(i), sample_rate=0.004)

    opa, _ = median_time(opacus_history, repeats)
    out["opacus_s"] = opa
    out["opacus_steps_per_s"] = steps / opa
    out["ratio_memory_step_vs_opacus_step"] = mem / opa
    out["ratio_file_step_vs_opacus_step"] = fil / opa
    return out


def bench_mechanism_steps(steps: int, dim: int, repeats: int, tmp: Path) -> dict[str, float]:
    """``steps`` mechanism steps (a Poisson sample, one Gaussian sum query of a ``dim``-coordinate
    sum) in memory and to a file; the file's cost per step is the difference."""
    query = GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=1.1, label="model")
    clipped = [np.zeros(dim)]

    def run(ledger: PrivacyLedger) -> None:
        rng = np.random.default_rng(0)
        for _ in range(steps):
            with sampled_step(
                ledger, sampling_probability=0.004, population_size=60_000, generator=rng
            ) as step:
                step.release(query, clipped, num_records=240)

    counter = iter(range(10**9))

    def to_file() -> None:
        path = tmp / f"mech-{next(counter)}.dpl"
        with PrivacyLedger(path) as ledger:  # default buffering
            run(ledger)
        path.unlink()

    med = interleaved_medians({"memory": lambda: run(PrivacyLedger()), "file": to_file}, repeats)
    mem, fil = med["memory"], med["file"]
    return {
        "steps": steps,
        "dim": dim,
        "memory_us_per_step": mem / steps * 1e6,
        "file_us_per_step": fil / steps * 1e6,
        "file_cost_us_per_step": (fil - mem) / steps * 1e6,
        "ratio_file_vs_memory": fil / mem,
    }


def write_ledger(path: Path, steps: int, *, distinct_q: bool) -> float:
    start = time.perf_counter()
    with PrivacyLedger(path, metadata={"benchmark": "ledger_bench"}) as ledger:
        record_steps(ledger, steps, distinct_q=distinct_q)
    return time.perf_counter() - start


def peak_rss_kib() -> int:
    """This process's peak resident set size in KiB (VmHWM; ru_maxrss where /proc is missing).

    ru_maxrss survives exec on Linux, so in a child it can report the parent's peak; VmHWM
    belongs to the process's own address space.
    """
    try:
        with open("/proc/self/status") as fp:
            for line in fp:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def load_child(path: str, keep_events: bool, trace: bool) -> None:
    """Runs in a fresh process: load, verify and compress once; print the measurements."""
    base_rss = peak_rss_kib()
    if trace:
        tracemalloc.start()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ledger = PrivacyLedger.load(path, keep_events=keep_events)
    compressed = ledger.compressed()
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1] if trace else None
    rss = peak_rss_kib()
    print(
        json.dumps(
            {
                "seconds": seconds,
                "events": ledger.num_events,
                "runs": len(compressed.runs),
                "rss_growth_mib": (rss - base_rss) / 1024,
                "peak_rss_mib": rss / 1024,
                "tracemalloc_peak_mib": None if peak is None else peak / 2**20,
            }
        )
    )


def run_child(path: Path, keep_events: bool, trace: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(path), str(int(keep_events)), str(int(trace))],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(out.stdout)


def bench_loading(steps: int, repeats: int, tmp: Path) -> dict:
    results: dict = {"steps": steps}
    for name, distinct_q in (("schedule", False), ("distinct_q", True)):
        path = tmp / f"load-{name}.dpl"
        results[f"{name}_write_s"] = write_ledger(path, steps, distinct_q=distinct_q)
        results[f"{name}_file_mib"] = path.stat().st_size / 2**20
        for keep in (False, True):
            runs = [run_child(path, keep, trace=False) for _ in range(repeats)]
            key = f"{name}_keep_{keep}"
            results[key + "_s"] = statistics.median(r["seconds"] for r in runs)
            results[key + "_runs"] = runs[0]["runs"]
            results[key + "_events"] = runs[0]["events"]
            results[key + "_rss_growth_mib"] = statistics.median(r["rss_growth_mib"] for r in runs)
            results[key + "_peak_rss_mib"] = statistics.median(r["peak_rss_mib"] for r in runs)
            if name == "schedule":
                results[key + "_tracemalloc_peak_mib"] = run_child(path, keep, trace=True)[
                    "tracemalloc_peak_mib"
                ]
        path.unlink()
    # The same ledger at a tenth of the size: what grows with the number of events.
    small = tmp / "load-small.dpl"
    write_ledger(small, steps // 10, distinct_q=False)
    for keep in (False, True):
        results[f"small_keep_{keep}_tracemalloc_peak_mib"] = run_child(small, keep, trace=True)[
            "tracemalloc_peak_mib"
        ]
        child = run_child(small, keep, trace=False)
        results[f"small_keep_{keep}_rss_growth_mib"] = child["rss_growth_mib"]
        results[f"small_keep_{keep}_peak_rss_mib"] = child["peak_rss_mib"]
    small.unlink()
    return results


def machine() -> dict[str, str]:
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in subprocess.run(
                ["lscpu"], capture_output=True, text=True
            ).stdout.splitlines()
            if line.startswith("Model name")
        )
    except (OSError, StopIteration):
        cpu = platform.processor() or "unknown"
    try:
        import opacus

        opacus_version = opacus.__version__
    except ImportError:
        opacus_version = "not installed"
    return {
        "cpus": str(os.cpu_count()),
        "cpu": cpu,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "dpledger": __version__,
        "opacus": opacus_version,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000, help="events to record")
    parser.add_argument("--steps", type=int, default=1_000_000, help="steps in the loaded ledger")
    parser.add_argument(
        "--mechanism-steps", type=int, default=100_000, help="NumPy mechanism steps to time"
    )
    parser.add_argument("--dim", type=int, default=100, help="coordinates of a mechanism's sum")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small sizes, 2 repeats")
    parser.add_argument("--json", metavar="FILE", help="also write the results to FILE")
    args = parser.parse_args()
    if args.quick:
        args.events, args.steps, args.repeats = 100_000, 50_000, 2
        args.mechanism_steps = 20_000
    info = machine()
    print("machine:", json.dumps(info))
    with tempfile.TemporaryDirectory(prefix="dpledger-bench-") as tmpdir:
        tmp = Path(tmpdir)
        rec = bench_recording(args.events, args.repeats, tmp)
        print(f"\nrecording {rec['events']:,} events ({args.repeats} repeats, medians)")
        print(f"  in memory            {rec['memory_events_per_s']:>12,.0f} events/s")
        print(f"  to a file (default)  {rec['file_events_per_s']:>12,.0f} events/s")
        print(
            f"  to a file, one write per step {rec['file_write_ahead_events_per_s']:>12,.0f} "
            f"events/s (+{rec['write_ahead_cost_us_per_step']:.2f} µs per step)"
        )
        if "opacus_s" in rec:
            print(f"  Opacus history       {rec['opacus_steps_per_s']:>12,.0f} steps/s")
            print(
                "  time per step (sample + one sum query) relative to Opacus's step(): "
                f"in memory {rec['ratio_memory_step_vs_opacus_step']:.2f}x, "
                f"to a file {rec['ratio_file_step_vs_opacus_step']:.2f}x"
            )
        mech = bench_mechanism_steps(args.mechanism_steps, args.dim, args.repeats, tmp)
        print(
            f"\n{mech['steps']:,} NumPy mechanism steps (sample + one sum query of "
            f"{mech['dim']} coordinates; {args.repeats} repeats, medians)"
        )
        print(f"  in memory            {mech['memory_us_per_step']:>9.2f} µs/step")
        print(
            f"  to a file (default)  {mech['file_us_per_step']:>9.2f} µs/step "
            f"(+{mech['file_cost_us_per_step']:.2f} µs, {mech['ratio_file_vs_memory']:.2f}x)"
        )
        load = bench_loading(args.steps, min(args.repeats, 3), tmp)
        print(f"\nload + verify + compress, {args.steps:,} steps ({2 * args.steps:,} events)")
        for name, label in (("schedule", "noise schedule"), ("distinct_q", "distinct q per step")):
            print(
                f"  {label}: file {load[name + '_file_mib']:.0f} MiB, written in "
                f"{load[name + '_write_s']:.1f} s"
            )
            for keep in (False, True):
                key = f"{name}_keep_{keep}"
                print(
                    f"    keep_events={keep!s:<5}  {load[key + '_s']:6.2f} s  "
                    f"({2 * args.steps / load[key + '_s']:,.0f} events/s), "
                    f"{load[key + '_runs']:,} runs, peak RSS {load[key + '_peak_rss_mib']:.0f} MiB "
                    f"(+{load[key + '_rss_growth_mib']:.1f} MiB over the imports)"
                    + (
                        f", tracemalloc peak {load[key + '_tracemalloc_peak_mib']:.1f} MiB"
                        if key + "_tracemalloc_peak_mib" in load
                        else ""
                    )
                )
        print(f"  the same schedule at {args.steps // 10:,} steps:")
        for keep in (False, True):
            print(
                f"    keep_events={keep!s:<5}  peak RSS "
                f"{load[f'small_keep_{keep}_peak_rss_mib']:.0f} MiB "
                f"(+{load[f'small_keep_{keep}_rss_growth_mib']:.1f} MiB), tracemalloc peak "
                f"{load[f'small_keep_{keep}_tracemalloc_peak_mib']:.1f} MiB"
            )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"machine": info, "recording": rec, "mechanism_steps": mech, "loading": load},
                indent=2,
            )
        )


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        load_child(sys.argv[2], bool(int(sys.argv[3])), bool(int(sys.argv[4])))
    else:
        main()
