"""Time and memory of accountant calls at extreme lengths, each in a capped child process.

    python benchmarks/budget_bench.py [CASE ...]

Runs each case (the cases of ``tests/accountants/test_budget_memory.py``: PRV ε and δ at
q = 0.5, z = 16, T = 10¹²; GDP ε at q = 0.01, z = 16, T = 10¹⁵; ``calibrate_noise_multiplier`` at
2⁶³ and 10¹⁵ steps) in a child whose address space is capped at 3 GiB (an accountant that
allocates first dies there instead of exhausting the machine), and prints its outcome, wall-clock
seconds (interpreter start-up included), tracemalloc peak and peak resident memory. Run it from
the root of the tree to measure (PYTHONPATH=.), e.g. a checkout of an older commit for "before".
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

CHILD = """
import json, resource, sys, tracemalloc
resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))
from dpledger.errors import DPLedgerError
from dpledger.ledger.steps import CompressedLedger
from dpledger.accountants import GdpAccountant, PrvAccountant, calibrate_noise_multiplier

def ledger(q, z, steps):
    return CompressedLedger.from_runs([(q, z, steps)])

CASES = {
    "prv_epsilon": lambda: PrvAccountant().epsilon(ledger(0.5, 16.0, 10**12), delta=1e-5),
    "prv_delta": lambda: PrvAccountant().delta(ledger(0.5, 16.0, 10**12), epsilon=1.0),
    "gdp_epsilon": lambda: GdpAccountant().epsilon(ledger(0.01, 16.0, 10**15), delta=1e-5),
    "calibrate_2_63": lambda: calibrate_noise_multiplier(
        target_epsilon=1.0, delta=1e-5, sampling_probability=0.01, steps=2**63),
    "calibrate_1e15": lambda: calibrate_noise_multiplier(
        target_epsilon=1.0, delta=1e-5, sampling_probability=0.01, steps=10**15),
}
tracemalloc.start()
try:
    result = CASES[sys.argv[1]]()
    outcome = repr(getattr(result, "epsilon", result))[:40]
except DPLedgerError as exc:
    outcome = "refused: " + type(exc).__name__
except MemoryError:
    outcome = "MemoryError (3 GiB cap)"
print(json.dumps({"outcome": outcome, "peak": tracemalloc.get_traced_memory()[1]}))
"""

CASES = ("prv_epsilon", "prv_delta", "gdp_epsilon", "calibrate_2_63", "calibrate_1e15")


def main() -> None:
    for case in sys.argv[1:] or CASES:
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, case], capture_output=True, text=True, timeout=900
        )
        seconds = time.perf_counter() - start
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        try:
            out = json.loads(proc.stdout.strip().splitlines()[-1])
            text = f"{out['outcome']}, tracemalloc peak {out['peak'] / 2**20:.2f} MiB"
        except (IndexError, ValueError):
            text = f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"
        print(f"{case:<16} {seconds:7.1f} s  {text}  (largest child RSS so far {rss:.0f} MiB)")


if __name__ == "__main__":
    main()
