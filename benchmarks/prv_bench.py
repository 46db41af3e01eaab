"""PRV accountant benchmark: dpledger's PRV against Opacus's PRV, microsoft prv_accountant and
dp-accounting's PLD, timed in the same run (medians over repeats; ratios are what matters on a
shared machine).

    PYTHONPATH=. python benchmarks/prv_bench.py [--quick] [--pld-1000] [--slow-peers] [--only N]

Cases (δ = 1e-5 throughout):
  1. homogeneous: q = 256/60000, z = 1.1, 14,062 steps; peers at eps_error 0.01 / interval 1e-4;
  2. 1,000 distinct z (0.8 → 2.0, q = 0.004, 100 steps each); dp-accounting's PLD is timed on
     the first 100 distinct values and scaled by 10 (its cost grows linearly in the number of
     distinct values; --pld-1000 times all 1,000, about three minutes);
  3. 100,000 steps, all distinct (z from 0.8 to 2.0, q = 0.004), with bucketing 1e-3;
  4. a 100-point ε curve against 100 separate ε computations (homogeneous ledger).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import statistics
import subprocess
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from dpledger.accountants.prv import PrvAccountant
from dpledger.ledger.steps import CompressedLedger

DELTA = 1e-5


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """(median seconds, last result) over ``repeats`` calls."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def machine() -> str:
    model = ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next(
            (ln.split(":", 1)[1].strip() for ln in out.splitlines() if "Model name" in ln), ""
        )
    except OSError:
        pass
    versions = []
    for pkg in ("numpy", "scipy", "dp-accounting", "opacus", "prv-accountant"):
        try:
            versions.append(f"{pkg} {importlib.metadata.version(pkg)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{pkg} (not installed)")
    return f"nproc {os.cpu_count()}, {model}, Python {platform.python_version()}, " + ", ".join(
        versions
    )


# ---------------------------------------------------------------------------- peers
def pld_epsilon(runs: list[tuple[float, float, int]]) -> float:
    import dp_accounting

    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    for q, z, count in runs:
        acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), count)
    return acc.get_epsilon(DELTA)


def opacus_triple(runs: list[tuple[float, float, int]]) -> tuple[float, float, float]:
    from opacus.accountants import PRVAccountant

    acc = PRVAccountant()
    acc.history = [(z, q, count) for q, z, count in runs]
    dprv = acc._get_dprv(eps_error=0.01, delta_error=DELTA / 1000)
    lower, estimate, upper = dprv.compute_epsilon(DELTA, DELTA / 1000, 0.01)
    return float(lower), float(estimate), float(upper)


def microsoft_triple(runs: list[tuple[float, float, int]]) -> tuple[float, float, float]:
    from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant

    prvs = [
        PoissonSubsampledGaussianMechanism(sampling_probability=q, noise_multiplier=z)
        for q, z, _ in runs
    ]
    counts = [count for _, _, count in runs]
    acc = PRVAccountant(
        prvs=prvs, max_self_compositions=counts, eps_error=0.01, delta_error=DELTA / 1000
    )
    lower, estimate, upper = acc.compute_epsilon(delta=DELTA, num_self_compositions=counts)
    return float(lower), float(estimate), float(upper)


def ours(ledger: CompressedLedger, **settings: Any) -> Any:
    return PrvAccountant(**settings).epsilon(ledger, delta=DELTA)


# ---------------------------------------------------------------------------- cases
def row(name: str, seconds: float, reported: float, bounds: tuple[float, float] | None) -> str:
    text = f"{name:36s} {seconds:9.4f} s  epsilon {reported:10.5f}"
    if bounds is not None:
        lower, upper = bounds
        text += f"  [{lower:.5f}, {upper:.5f}] width {upper - lower:.5f}"
    return text


def homogeneous(repeats: int) -> None:
    runs = [(256 / 60000, 1.1, 14062)]
    ledger = CompressedLedger.from_runs(runs)
    t_ours, r = timed(lambda: ours(ledger), repeats * 3)
    t_opacus, o = timed(lambda: opacus_triple(runs), repeats)
    t_pld, p = timed(lambda: pld_epsilon(runs), repeats)
    t_ms, m = timed(lambda: microsoft_triple(runs), max(1, repeats // 2))
    print("\n## 1. homogeneous ledger q=256/60000, z=1.1, 14,062 steps, delta=1e-5")
    print(row("dpledger PRV (eps_error 0.01)", t_ours, r.epsilon, (r.lower, r.upper)))
    print(f"{'':36s} estimate {r.details['estimate']:.5f}")
    print(row("Opacus PRV (eps_error 0.01)", t_opacus, o[2], (o[0], o[2])))
    print(f"{'':36s} estimate {o[1]:.5f}")
    print(row("prv_accountant (eps_error 0.01)", t_ms, m[2], (m[0], m[2])))
    print(row("dp-accounting PLD (interval 1e-4)", t_pld, p, None))
    fastest = min(t_opacus, t_pld)
    print(f"speed-up vs the faster of Opacus PRV and PLD: {fastest / t_ours:.1f}x")
    print(
        f"  (Opacus {t_opacus / t_ours:.1f}x, PLD {t_pld / t_ours:.1f}x, "
        f"prv_accountant {t_ms / t_ours:.1f}x)"
    )
    print(f"PLD epsilon inside our certified interval: {r.lower <= p <= r.upper + 1e-3}")


def many_distinct(repeats: int, pld_all: bool, slow_peers: bool) -> None:
    zs = np.linspace(0.8, 2.0, 1000)
    runs = [(0.004, float(z), 100) for z in zs]
    ledger = CompressedLedger.from_runs(runs)
    t_ours, r = timed(lambda: ours(ledger), repeats)
    runs100 = [(0.004, float(z), 100) for z in np.linspace(0.8, 2.0, 100)]
    t_ours100, r100 = timed(lambda: ours(CompressedLedger.from_runs(runs100)), repeats)
    t_pld50, _ = timed(lambda: pld_epsilon(runs100[::2]), 1)
    t_pld100, p100 = timed(lambda: pld_epsilon(runs100), 1)
    print("\n## 2. 1,000 distinct z (0.8 -> 2.0), q=0.004, 100 steps each, delta=1e-5")
    print(row("dpledger PRV, 1,000 distinct", t_ours, r.epsilon, (r.lower, r.upper)))
    print(row("dpledger PRV, 100 distinct", t_ours100, r100.epsilon, (r100.lower, r100.upper)))
    print(row("dp-accounting PLD, 50 distinct", t_pld50, float("nan"), None))
    print(row("dp-accounting PLD, 100 distinct", t_pld100, p100, None))
    inside = r100.lower <= p100 <= r100.upper + 1e-3
    print(f"PLD epsilon (100 distinct) inside our certified interval: {inside}")
    if slow_peers:
        for name, fn in (("Opacus PRV", opacus_triple), ("prv_accountant", microsoft_triple)):
            try:
                t_peer, triple = timed(lambda fn=fn: fn(runs100), 1)
                print(row(f"{name}, 100 distinct", t_peer, triple[2], (triple[0], triple[2])))
            except Exception as exc:  # a peer's failure is a result to report
                print(f"{name}, 100 distinct: failed with {type(exc).__name__}: {exc}")
    if pld_all:
        t_pld1000, p1000 = timed(lambda: pld_epsilon(runs), 1)
        print(row("dp-accounting PLD, 1,000 distinct", t_pld1000, p1000, None))
        print(f"inside our interval: {r.lower <= p1000 <= r.upper + 1e-3}")
        estimate = t_pld1000
    else:
        estimate = 10 * t_pld100
        print(f"dp-accounting PLD, 1,000 distinct, scaled linearly from 100: {estimate:.1f} s")
    print(f"speed-up vs PLD on 1,000 distinct values: {estimate / t_ours:.0f}x")


def all_distinct(repeats: int) -> None:
    zs = np.linspace(0.8, 2.0, 100_000)
    ledger = CompressedLedger.from_runs([(0.004, float(z), 1) for z in zs])
    t_b, r = timed(lambda: ours(ledger, bucketing=1e-3), repeats)
    t_f, rf = timed(lambda: ours(ledger, bucketing=1e-4), 1)
    print("\n## 3. 100,000 steps, all distinct (z 0.8 -> 2.0, q=0.004), delta=1e-5")
    for name, t, res in (("bucketing 1e-3", t_b, r), ("bucketing 1e-4", t_f, rf)):
        print(row(name, t, res.epsilon, (res.lower, res.upper)))
        print(f"{'':36s} {res.details['distinct_after_bucketing']} distinct after bucketing")
    print(f"bucketing 1e-3 instead of 1e-4 moved the upper bound by {r.upper - rf.upper:+.5f}")


def curve(repeats: int) -> None:
    ledger = CompressedLedger.from_runs([(256 / 60000, 1.1, 14062)])
    steps = [int(t) for t in np.linspace(140, 14062, 100)]
    acc = PrvAccountant()
    t_curve, c = timed(lambda: acc.epsilon_curve(ledger, delta=DELTA, steps=steps), repeats)
    t_single, s = timed(
        lambda: [acc.epsilon(ledger.prefix(t), delta=DELTA) for t in steps], repeats
    )
    agree = max(abs(a.upper - b.upper) for a, b in zip(c, s, strict=True))
    print("\n## 4. 100-point epsilon curve, homogeneous ledger")
    print(f"curve: {t_curve:.3f} s; 100 separate calls: {t_single:.3f} s")
    print(f"the curve is {t_single / t_curve:.1f}x cheaper; upper bounds differ by <= {agree:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--pld-1000", action="store_true", help="time PLD on all 1,000 values")
    parser.add_argument(
        "--slow-peers", action="store_true", help="also time the PRV peers on 100 distinct values"
    )
    parser.add_argument("--only", choices=["1", "2", "3", "4"], help="run one case")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    repeats = 3 if args.quick else 5
    print(machine())
    cases = {
        "1": lambda: homogeneous(repeats),
        "2": lambda: many_distinct(max(1, repeats // 2), args.pld_1000, args.slow_peers),
        "3": lambda: all_distinct(max(1, repeats // 2)),
        "4": lambda: curve(max(1, repeats // 2)),
    }
    for key, case in cases.items():
        if args.only in (None, key):
            case()


if __name__ == "__main__":
    main()
