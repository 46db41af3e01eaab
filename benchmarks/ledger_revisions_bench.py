"""The ledger's recording and loading at two revisions of dpledger, timed in the same run.

Run from the repository root, with a checkout of the older revision beside it:

    git worktree add /tmp/before fe4c238
    PYTHONPATH=. python benchmarks/ledger_revisions_bench.py /tmp/before . --rounds 6

Each revision runs in its own process, alternately, ``--rounds`` times; each process times every
case ``--repeats`` times and keeps the fastest (the repeat least disturbed by other jobs on a
shared machine). The cases: recording 100,000 steps (a sample and a labelled sum query each) in
memory and to a file; loading that file with ``keep_events=False`` and ``True``; and loading a
100,000-step file whose q differs at every step, both ways (each load followed by
``compressed()``). The table shows the fastest time of all rounds for each revision, and the
median over rounds of the per-round ratio after / before (above 1: slower after).
"""

from __future__ import annotations

import argparse
import statistics

from revisions import alternate

_CHILD = r"""
import json, os, tempfile, time
from dpledger import PrivacyLedger
STEPS, REPEATS = %(steps)d, %(repeats)d
tmp = tempfile.mkdtemp()

def record(path, distinct_q=False):
    ledger = PrivacyLedger(path, buffer_size=4096) if path else PrivacyLedger()
    for i in range(STEPS):
        q = 0.004 + (i %% 1000) * 1e-6 if distinct_q else 0.004
        ledger.record_sample(sampling_probability=q, population_size=60_000)
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.1, label="g")
    ledger.close()

def load(path, keep):
    PrivacyLedger.load(path, keep_events=keep).compressed()

def fastest(fn, *args):
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return min(times)

plain, distinct = os.path.join(tmp, "plain.dpl"), os.path.join(tmp, "distinct.dpl")
out = {}
out["recording in memory"] = fastest(record, None)

def record_file():
    if os.path.exists(plain):
        os.remove(plain)
    record(plain)

out["recording to a file"] = fastest(record_file)
record(distinct, True)
out["load, one q, keep_events=False"] = fastest(load, plain, False)
out["load, one q, keep_events=True"] = fastest(load, plain, True)
out["load, distinct q, keep_events=False"] = fastest(load, distinct, False)
out["load, distinct q, keep_events=True"] = fastest(load, distinct, True)
import dpledger
out["_path"] = dpledger.__file__
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", help="root of the older checkout")
    parser.add_argument("after", help="root of the newer checkout")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100_000)
    args = parser.parse_args()
    child = _CHILD % {"steps": args.steps, "repeats": args.repeats}
    results = alternate(args.before, args.after, args.rounds, child)
    for tree in (args.before, args.after):
        print(f"{tree}: dpledger from {results[tree][0]['_path']}")
    print("| case | before (fastest) | after (fastest) | after / before (median of rounds) |")
    print("| --- | ---: | ---: | ---: |")
    before, after = results[args.before], results[args.after]
    for name in (k for k in before[0] if not k.startswith("_")):
        b = min(r[name] for r in before)
        a = min(r[name] for r in after)
        ratio = statistics.median(ra[name] / rb[name] for rb, ra in zip(before, after, strict=True))
        print(f"| {name} | {b:.3f} s | {a:.3f} s | {ratio:.2f} |")


if __name__ == "__main__":
    main()
