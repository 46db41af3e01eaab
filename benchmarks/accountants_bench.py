"""Accountant benchmarks: dpledger's accountants and their peers, timed in the same run.

Run from the repository root:

    PYTHONPATH=. python benchmarks/accountants_bench.py            # everything (~5 minutes)
    PYTHONPATH=. python benchmarks/accountants_bench.py --quick    # fewer repeats, no slow peers

Every time is the median of ``--repeats`` runs (one run for calls that take over 10 s; the row
says n=1), and every ratio is computed from times measured in this run on this machine. Peers:
Opacus (RDP; PRV with eps_error = 0.01) and dp-accounting (RDP; PLD with its default
value_discretization_interval = 1e-4). PRV rows appear when ``dpledger.accountants.prv`` exists.
"""

from __future__ import annotations

import argparse
import logging
import math
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dpledger.accountants.bucketing import conservative_buckets
from dpledger.accountants.gdp import GdpAccountant
from dpledger.accountants.pld import PldAccountant
from dpledger.accountants.rdp import RdpAccountant
from dpledger.ledger.dp_event import compressed_to_dp_event
from dpledger.ledger.steps import CompressedLedger

DELTA = 1e-5
SLOW = 10.0  # seconds: a single call slower than this is not repeated

logging.getLogger("absl").setLevel(logging.ERROR)


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, Any, int]:
    """(median seconds, last result, number of runs)."""
    times = []
    result = None
    for i in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
        if i == 0 and times[0] > SLOW:
            break
    return statistics.median(times), result, len(times)


def row(name: str, eps: float, seconds: float, n: int, note: str = "") -> None:
    eps_text = f"{eps:.6f}" if math.isfinite(eps) else str(eps)
    print(f"  {name:<34} ε = {eps_text:>11}   {seconds:9.4f} s  (n={n}) {note}")


def ratio(label: str, slow: float, fast: float) -> None:
    print(f"  -> {label}: {slow / fast:.1f}x")


# --------------------------------------------------------------------------- peers
def opacus_rdp(history: list[tuple[float, float, int]]) -> float:
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    acc.history = list(history)
    return float(acc.get_epsilon(delta=DELTA))


def opacus_prv(history: list[tuple[float, float, int]]) -> float:
    from opacus.accountants import PRVAccountant

    acc = PRVAccountant()
    acc.history = list(history)
    return float(acc.get_epsilon(delta=DELTA, eps_error=0.01))


def dp_rdp(ledger: CompressedLedger) -> float:
    import dp_accounting

    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(compressed_to_dp_event(ledger))
    return float(acc.get_epsilon(DELTA))


def dp_pld(ledger: CompressedLedger) -> float:
    import dp_accounting

    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(compressed_to_dp_event(ledger))
    return float(acc.get_epsilon(DELTA))


def prv_accountant() -> Any | None:
    try:
        from dpledger.accountants.prv import PrvAccountant
    except ImportError:
        return None
    return PrvAccountant()


def history_of(ledger: CompressedLedger) -> list[tuple[float, float, int]]:
    return [(r.noise_multiplier, r.sampling_probability, r.count) for r in ledger.runs]


# --------------------------------------------------------------------------- sections
def homogeneous(repeats: int, quick: bool) -> None:
    q, z, t = 256 / 60_000, 1.1, 14_062
    ledger = CompressedLedger.from_runs([(q, z, t)])
    print(f"\n[1] homogeneous ledger: q = 256/60000, z = {z}, {t} steps, δ = {DELTA}")
    s_rdp, r, n = timed(lambda: RdpAccountant().epsilon(ledger, delta=DELTA), repeats)
    row("dpledger rdp", r.epsilon, s_rdp, n, f"(order {r.details['optimal_order']})")
    s_gdp, g, n = timed(lambda: GdpAccountant().epsilon(ledger, delta=DELTA), repeats)
    row("dpledger gdp (approximation)", g.epsilon, s_gdp, n)
    s_pld, p, n = timed(lambda: PldAccountant().epsilon(ledger, delta=DELTA), repeats)
    row("dpledger pld (1e-4)", p.epsilon, s_pld, n)
    prv = prv_accountant()
    s_prv = None
    if prv is None:
        print("  prv: not available in this tree")
    else:
        s_prv, v, n = timed(lambda: prv.epsilon(ledger, delta=DELTA), repeats)
        row(
            "dpledger prv (upper)",
            v.upper if v.upper is not None else v.epsilon,
            s_prv,
            n,
            f"[{v.lower}, {v.upper}]",
        )
    s_dr, e, n = timed(lambda: dp_rdp(ledger), repeats)
    row("dp-accounting rdp", e, s_dr, n)
    s_dp, e, n = timed(lambda: dp_pld(ledger), repeats)
    row("dp-accounting pld (1e-4)", e, s_dp, n)
    s_or, e, n = timed(lambda: opacus_rdp(history_of(ledger)), repeats)
    row("opacus rdp", e, s_or, n)
    s_op, e, n = timed(lambda: opacus_prv(history_of(ledger)), repeats)
    row("opacus prv (eps_error 0.01)", e, s_op, n)
    ratio("dpledger rdp vs dp-accounting rdp", s_dr, s_rdp)
    ratio("dpledger rdp vs opacus rdp", s_or, s_rdp)
    ratio("dpledger pld vs dp-accounting pld", s_dp, s_pld)
    if s_prv is not None:
        ratio("dpledger prv vs faster of (opacus prv, dp-accounting pld)", min(s_op, s_dp), s_prv)


def distinct_thousand(repeats: int, quick: bool) -> None:
    z_values = np.linspace(0.8, 2.0, 1000)
    ledger = CompressedLedger.from_runs([(0.004, float(z), 100) for z in z_values])
    print("\n[2] 1,000 distinct z (0.8 -> 2.0), q = 0.004, 100 steps each (100,000 steps)")
    opacus_orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
    acc_opacus_grid = RdpAccountant(orders=opacus_orders)
    s_rdp_o, r_o, n = timed(lambda: acc_opacus_grid.epsilon(ledger, delta=DELTA), repeats)
    row(
        "dpledger rdp (opacus orders)",
        r_o.epsilon,
        s_rdp_o,
        n,
        f"({r_o.details['orders_evaluated']} orders computed)",
    )
    s_rdp, r, n = timed(lambda: RdpAccountant().epsilon(ledger, delta=DELTA), repeats)
    row("dpledger rdp (default orders)", r.epsilon, s_rdp, n)
    s_gdp, g, n = timed(lambda: GdpAccountant().epsilon(ledger, delta=DELTA), repeats)
    row("dpledger gdp (approximation)", g.epsilon, s_gdp, n)
    prv = prv_accountant()
    if prv is None:
        print("  prv: not available in this tree")
    else:
        s_prv, v, n = timed(lambda: prv.epsilon(ledger, delta=DELTA), repeats)
        row(
            "dpledger prv (upper)",
            v.upper if v.upper is not None else v.epsilon,
            s_prv,
            n,
            f"[{v.lower}, {v.upper}]",
        )
    s_or, e_or, n = timed(lambda: opacus_rdp(history_of(ledger)), repeats)
    row("opacus rdp", e_or, s_or, n)
    ratio("dpledger rdp vs opacus rdp (same orders)", s_or, s_rdp_o)
    print(f"  -> same ε: |Δε|/ε = {abs(r_o.epsilon - e_or) / e_or:.2e}")
    if not quick:
        s_dr, e_dr, n = timed(lambda: dp_rdp(ledger), 1)
        row("dp-accounting rdp", e_dr, s_dr, n)
        ratio("dpledger rdp vs dp-accounting rdp (same orders)", s_dr, s_rdp)
        print(f"  -> same ε: |Δε|/ε = {abs(r.epsilon - e_dr) / e_dr:.2e}")
        if prv is not None:
            s_dp, e, n = timed(lambda: dp_pld(ledger), 1)
            row("dp-accounting pld (1e-4)", e, s_dp, n)
            ratio("dpledger prv vs dp-accounting pld", s_dp, s_prv)


def distinct_hundred(repeats: int, quick: bool) -> None:
    z_values = np.linspace(0.8, 2.0, 100)
    ledger = CompressedLedger.from_runs([(0.004, float(z), 100) for z in z_values])
    print("\n[3] 100 distinct z (0.8 -> 2.0), q = 0.004, 100 steps each (10,000 steps)")
    s_rdp, r, n = timed(lambda: RdpAccountant().epsilon(ledger, delta=DELTA), repeats)
    row("dpledger rdp", r.epsilon, s_rdp, n)
    s_pld, p, n = timed(lambda: PldAccountant().epsilon(ledger, delta=DELTA), 1)
    row("dpledger pld (1e-4)", p.epsilon, s_pld, n)
    s_pld_b, pb, n = timed(lambda: PldAccountant(bucketing=1e-2).epsilon(ledger, delta=DELTA), 1)
    row(
        "dpledger pld (1e-4, bucketing 1e-2)",
        pb.epsilon,
        s_pld_b,
        n,
        f"({len(conservative_buckets(ledger, relative_precision=1e-2).distinct())} distinct)",
    )
    prv = prv_accountant()
    if prv is None:
        print("  prv: not available in this tree")
    else:
        s_prv, v, n = timed(lambda: prv.epsilon(ledger, delta=DELTA), repeats)
        row("dpledger prv (upper)", v.upper if v.upper is not None else v.epsilon, s_prv, n)
    if not quick:
        s_dp, e, n = timed(lambda: dp_pld(ledger), 1)
        row("dp-accounting pld (1e-4)", e, s_dp, n)
        ratio("dpledger pld vs dp-accounting pld", s_dp, s_pld)
        s_op, e, n = timed(lambda: opacus_prv(history_of(ledger)), 1)
        row("opacus prv (eps_error 0.01)", e, s_op, n)


def all_distinct(repeats: int, quick: bool) -> None:
    z_values = np.linspace(0.8, 2.0, 100_000)
    ledger = CompressedLedger.from_runs([(0.004, float(z), 1) for z in z_values])
    print("\n[4] 100,000 steps, all distinct: z = 0.8 -> 2.0, q = 0.004")
    s_rdp, r, n = timed(lambda: RdpAccountant().epsilon(ledger, delta=DELTA), repeats)
    row("dpledger rdp", r.epsilon, s_rdp, n, f"({r.details['orders_evaluated']} orders computed)")
    s_b, b, n = timed(lambda: RdpAccountant(bucketing=1e-3).epsilon(ledger, delta=DELTA), repeats)
    row(
        "dpledger rdp, bucketing 1e-3",
        b.epsilon,
        s_b,
        n,
        f"({b.details['distinct_runs']} distinct after bucketing)",
    )
    print(f"  -> bucketing moved ε by {(b.epsilon - r.epsilon) / r.epsilon:+.2e} (relative)")
    ratio("bucketing speed-up", s_rdp, s_b)
    s_gdp, g, n = timed(lambda: GdpAccountant().epsilon(ledger, delta=DELTA), repeats)
    row("dpledger gdp (approximation)", g.epsilon, s_gdp, n)
    prv = prv_accountant()
    if prv is None:
        print("  prv: not available in this tree")
    else:
        try:
            prv_b = type(prv)(bucketing=1e-3)
        except TypeError:
            prv_b = prv
        s_prv, v, n = timed(lambda: prv_b.epsilon(ledger, delta=DELTA), 1)
        row(
            "dpledger prv (bucketing 1e-3, upper)",
            v.upper if v.upper is not None else v.epsilon,
            s_prv,
            n,
        )


def curve(repeats: int, quick: bool) -> None:
    z_values = np.linspace(0.8, 2.0, 1000)
    ledger = CompressedLedger.from_runs([(0.004, float(z), 100) for z in z_values])
    steps = [round(ledger.num_steps * (i + 1) / 100) for i in range(100)]
    print("\n[5] 100-point ε curve vs 100 separate ε computations (the 1,000-distinct ledger)")
    acc = RdpAccountant()
    s_curve, c, n = timed(lambda: acc.epsilon_curve(ledger, delta=DELTA, steps=steps), repeats)
    row("rdp curve (100 points)", c[-1].epsilon, s_curve, n)
    s_sep, e, n = timed(
        lambda: [acc.epsilon(ledger.prefix(t), delta=DELTA).epsilon for t in steps], repeats
    )
    row("rdp, 100 separate calls", e[-1], s_sep, n)
    assert all(abs(a.epsilon - b) <= 1e-9 * b for a, b in zip(c, e, strict=True))
    ratio("curve vs separate (rdp)", s_sep, s_curve)
    small = CompressedLedger.from_runs([(0.01, float(z), 50) for z in np.linspace(0.9, 1.5, 4)])
    steps_small = [2 * (i + 1) for i in range(100)]
    pld = PldAccountant(value_discretization_interval=1e-3)
    s_curve, c, n = timed(lambda: pld.epsilon_curve(small, delta=DELTA, steps=steps_small), 1)
    row("pld 1e-3 curve (100 points, 200 steps)", c[-1].epsilon, s_curve, n)
    s_sep, e, n = timed(
        lambda: [pld.epsilon(small.prefix(t), delta=DELTA).epsilon for t in steps_small], 1
    )
    row("pld 1e-3, 100 separate calls", e[-1], s_sep, n)
    ratio("curve vs separate (pld)", s_sep, s_curve)
    gdp = GdpAccountant(lower_bound=False)
    s_curve, c, n = timed(lambda: gdp.epsilon_curve(ledger, delta=DELTA, steps=steps), repeats)
    row("gdp curve (100 points, no lower bound)", c[-1].epsilon, s_curve, n)
    s_sep, e, n = timed(
        lambda: [gdp.epsilon(ledger.prefix(t), delta=DELTA).epsilon for t in steps], repeats
    )
    row("gdp, 100 separate calls", e[-1], s_sep, n)
    ratio("curve vs separate (gdp, no lower bound)", s_sep, s_curve)


def bucketing_effect(repeats: int, quick: bool) -> None:
    print("\n[6] conservative bucketing (r = 1e-3): relative change of ε, and speed")
    ledgers = {
        "homogeneous 256/60000, z=1.1, 14062": CompressedLedger.from_runs(
            [(256 / 60_000, 1.1, 14_062)]
        ),
        "1,000 distinct z, 100 steps each": CompressedLedger.from_runs(
            [(0.004, float(z), 100) for z in np.linspace(0.8, 2.0, 1000)]
        ),
        "100,000 distinct z": CompressedLedger.from_runs(
            [(0.004, float(z), 1) for z in np.linspace(0.8, 2.0, 100_000)]
        ),
        "1,000 distinct q (1e-4 -> 0.05), z=1": CompressedLedger.from_runs(
            [(float(q), 1.0, 50) for q in np.geomspace(1e-4, 0.05, 1000)]
        ),
    }
    for name, ledger in ledgers.items():
        plain_s, plain, _ = timed(
            lambda ledger=ledger: RdpAccountant().epsilon(ledger, delta=DELTA), repeats
        )
        b_s, b, _ = timed(
            lambda ledger=ledger: RdpAccountant(bucketing=1e-3).epsilon(ledger, delta=DELTA),
            repeats,
        )
        print(
            f"  rdp  {name:<38} ε {plain.epsilon:.6f} -> {b.epsilon:.6f} "
            f"({(b.epsilon - plain.epsilon) / plain.epsilon:+.2e}); distinct "
            f"{plain.details['distinct_runs']} -> {b.details['distinct_runs']}; "
            f"{plain_s:.3f} s -> {b_s:.3f} s"
        )
        g = GdpAccountant(lower_bound=False).epsilon(ledger, delta=DELTA).epsilon
        gb = GdpAccountant(lower_bound=False, bucketing=1e-3).epsilon(ledger, delta=DELTA).epsilon
        print(f"  gdp  {name:<38} ε {g:.6f} -> {gb:.6f} ({(gb - g) / g:+.2e})")


def machine() -> None:
    import dp_accounting  # noqa: F401
    import scipy

    def version(module: str) -> str:
        try:
            from importlib.metadata import version as v

            return v(module)
        except Exception:  # pragma: no cover - reporting only
            return "?"

    cpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in cpu.splitlines()
            if line.startswith("Model name")
        ),
        "?",
    )
    nproc = subprocess.run(["nproc"], capture_output=True, text=True, check=False).stdout.strip()
    print(
        f"machine: {nproc} cores, {model}; Python {platform.python_version()}; numpy "
        f"{np.__version__}, scipy {scipy.__version__}, dp-accounting {version('dp-accounting')}, "
        f"opacus {version('opacus')}"
    )


SECTIONS = {
    "homogeneous": homogeneous,
    "distinct1000": distinct_thousand,
    "distinct100": distinct_hundred,
    "alldistinct": all_distinct,
    "curve": curve,
    "bucketing": bucketing_effect,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 repeat, skip the slowest peers")
    parser.add_argument("--only", choices=sorted(SECTIONS), action="append")
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    machine()
    import dp_accounting.pld
    import dp_accounting.rdp  # noqa: F401
    import opacus.accountants  # noqa: F401

    for name, section in SECTIONS.items():
        if args.only and name not in args.only:
            continue
        section(repeats, args.quick)


if __name__ == "__main__":
    main()
