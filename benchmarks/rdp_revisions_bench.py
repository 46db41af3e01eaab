"""The RDP accountant at two revisions of dpledger, timed in the same run (interleaved).

Run from the repository root, with a checkout of the older revision beside it:

    git worktree add /tmp/before 699c98f
    PYTHONPATH=. python benchmarks/rdp_revisions_bench.py /tmp/before .

Each revision runs in its own process (so both can be imported), alternately, ``--rounds`` times;
each process times every ledger 3 times. The table shows medians over rounds, the ratio of the
second revision's time to the first's, and both ε at δ = 1e-5.
"""

from __future__ import annotations

import argparse
import statistics

from revisions import alternate

_CHILD = r"""
import json, statistics, time
import numpy as np
from dpledger.ledger.steps import CompressedLedger
from dpledger.accountants.rdp import RdpAccountant
rng = np.random.default_rng(0)
qs, zs = 10 ** rng.uniform(-4, -1, 100_000), rng.uniform(0.8, 3.0, 100_000)
cases = {
    "homogeneous: q = 0.004, z = 1.1, 10^5 steps": [(0.004, 1.1, 100_000)],
    "1,000 distinct z (0.8 to 3), q = 0.004, 100 steps each": [
        (0.004, float(z), 100) for z in np.linspace(0.8, 3.0, 1000)
    ],
    "100,000 distinct steps (q 1e-4 to 0.1, z 0.8 to 3)": [
        (float(q), float(z), 1) for q, z in zip(qs, zs)
    ],
    "curve of 100 points (homogeneous ledger)": None,
}
out = {}
for name, runs in cases.items():
    times = []
    for _ in range(3):
        acc = RdpAccountant()
        start = time.perf_counter()
        if runs is None:
            ledger = CompressedLedger.from_runs([(0.004, 1.1, 100_000)])
            steps = list(range(1000, 100_001, 1000))
            result = acc.epsilon_curve(ledger, delta=1e-5, steps=steps)[-1]
        else:
            result = acc.epsilon(CompressedLedger.from_runs(runs), delta=1e-5)
        times.append(time.perf_counter() - start)
    out[name] = [statistics.median(times), result.epsilon]
import dpledger
out["_path"] = dpledger.__file__
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", help="root of the older checkout")
    parser.add_argument("after", help="root of the newer checkout")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    results = alternate(args.before, args.after, args.rounds, _CHILD)
    for tree in (args.before, args.after):
        print(f"{tree}: dpledger from {results[tree][0].pop('_path')}")
        for r in results[tree][1:]:
            r.pop("_path")
    print("| ledger | before | after | after / before | ε before | ε after |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in results[args.before][0]:
        b = statistics.median(r[name][0] for r in results[args.before])
        a = statistics.median(r[name][0] for r in results[args.after])
        eb, ea = results[args.before][0][name][1], results[args.after][0][name][1]
        print(f"| {name} | {b:.4f} s | {a:.4f} s | {a / b:.2f}x | {eb:.6f} | {ea:.6f} |")


if __name__ == "__main__":
    main()
