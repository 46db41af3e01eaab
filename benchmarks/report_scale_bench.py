"""How long ``dpledger report`` takes on a long ledger, beside ``dpledger epsilon`` on the file.

    python benchmarks/report_scale_bench.py --steps 1000000 [--curve 20] [--keep DIR]

Writes a ledger of ``--steps`` Poisson steps (q = 0.01, n = 60,000, one sum query with z = 1),
then runs ``dpledger epsilon`` and ``dpledger report --html`` on it in child processes with stderr
not a terminal, and prints each command's wall-clock seconds and peak resident memory (the
child's ``ru_maxrss``). The report is the document a reviewer signs; it should cost a small
multiple of ``epsilon`` (it also draws ε curves with every accountant and the trade-off view).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dpledger import PrivacyLedger


def write_ledger(path: Path, steps: int) -> None:
    with PrivacyLedger(path, buffer_size=4096) as ledger:
        for _ in range(steps):
            ledger.record_sample(sampling_probability=0.01, population_size=60_000)
            ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0)


def timed(args: list[str]) -> tuple[float, float]:
    """Wall-clock seconds and peak RSS (MiB) of ``python -m dpledger ARGS`` in a child."""
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "dpledger", *args],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return seconds, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--curve", type=int, default=None, help="report --curve N")
    parser.add_argument("--keep", type=Path, default=None, help="folder to keep the files in")
    args = parser.parse_args()
    folder = args.keep or Path(tempfile.mkdtemp())
    os.makedirs(folder, exist_ok=True)
    ledger = folder / f"steps{args.steps}.dpl"
    start = time.perf_counter()
    write_ledger(ledger, args.steps)
    print(f"ledger of {args.steps} steps written in {time.perf_counter() - start:.1f} s")
    eps_s, eps_mb = timed(["epsilon", str(ledger), "--delta", "1e-5"])
    print(f"epsilon: {eps_s:.1f} s, peak RSS {eps_mb:.0f} MiB")
    report = ["report", str(ledger), "--delta", "1e-5", "--html", str(folder / "report.html")]
    if args.curve is not None:
        report += ["--curve", str(args.curve)]
    rep_s, rep_mb = timed(report)
    # ru_maxrss of RUSAGE_CHILDREN is the largest child so far: the report's when it is larger
    print(f"report:  {rep_s:.1f} s, peak RSS (largest child so far) {rep_mb:.0f} MiB")
    print(f"report / epsilon: {rep_s / eps_s:.2f}x")


if __name__ == "__main__":
    main()
