"""ε of one training setting under every sampler, by every accountant that certifies it.

Run from the repository root:

    PYTHONPATH=. python benchmarks/sampling_bench.py            # about 2 minutes
    PYTHONPATH=. python benchmarks/sampling_bench.py --quick    # one repeat, fewer MC samples

The setting: n = 60,000 records, batches of b = 256 (q = b/n), noise multiplier z = 1.1, 15
epochs, δ = 1e-5. Per-step samplers run round(15·n/b) = 3516 steps; balls-in-bins runs 15 epochs
of k = 234 batches, shuffle 15 epochs of ⌈n/b⌉ = 235 batches. Each row names the sampler, the
relation, the accountant, the kind of number and the median time of ``--repeats`` runs. Peers in
the same run: dp-accounting's RDP and PLD accountants fed the ledger's DpEvent where
dp-accounting has one for the sampler (for truncated Poisson, the larger ε of its two events,
dataset_size n and n + 1: ``compressed_to_dp_events``).
"""

from __future__ import annotations

import argparse
import logging
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

from dpledger import PrivacyLedger, SamplingEvent
from dpledger.accountants import make_accountant
from dpledger.accountants.display import format_rounded
from dpledger.accountants.sampling_report import shuffle_gap
from dpledger.errors import UnsupportedLedgerError

N, B, Z, EPOCHS, DELTA = 60_000, 256, 1.1, 15, 1e-5
STEPS = round(EPOCHS * N / B)
K = N // B  # balls-in-bins batches per epoch
logging.getLogger("absl").setLevel(logging.ERROR)


def ledger(events: list[SamplingEvent], relation: str) -> Any:
    out = PrivacyLedger(neighboring=relation)
    for event in events:
        out.record_sample(event=event)
        out.record_sum_query(l2_norm_bound=1.0, noise_stddev=Z)
    return out.compressed()


def epochs(build: Callable[..., SamplingEvent], per_epoch: int) -> list[SamplingEvent]:
    return [build(epoch_start=t % per_epoch == 0) for t in range(EPOCHS * per_epoch)]


def timed(fn: Callable[[], Any], repeats: int) -> tuple[Any, float]:
    times, value = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - start)
    return value, statistics.median(times)


def dp_accounting_epsilon(comp: Any, kind: str, relation: str) -> float:
    import dp_accounting

    rel = (
        dp_accounting.NeighboringRelation.REPLACE_ONE
        if relation == "replace_one"
        else dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    )
    from dpledger.ledger.dp_event import compressed_to_dp_events

    values = []
    for event in compressed_to_dp_events(comp):  # two neighbouring pairs for truncated Poisson
        if kind == "rdp":
            acc: Any = dp_accounting.rdp.RdpAccountant(neighboring_relation=rel)
        else:
            acc = dp_accounting.pld.PLDAccountant(neighboring_relation=rel)
        acc.compose(event)
        values.append(acc.get_epsilon(DELTA))
    return max(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--mc-samples", type=int, default=100_000)
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    mc_samples = 20_000 if args.quick else args.mc_samples
    q = B / N
    setups = [
        ("poisson(q=b/n)", [SamplingEvent.poisson(q, N)] * STEPS, "add_remove"),
        ("fixed_size(b, n)", [SamplingEvent.fixed_size(B, N)] * STEPS, "replace_one"),
        (
            "truncated_poisson(q, n, 320)",
            [SamplingEvent.truncated_poisson(q, N, 320)] * STEPS,
            "add_remove",
        ),
        (
            "balls_in_bins(k=234, n)",
            epochs(lambda **kw: SamplingEvent.balls_in_bins(K, N, **kw), K),
            "add_remove",
        ),
        (
            "shuffle(b, n)",
            epochs(lambda **kw: SamplingEvent.shuffle(B, N, **kw), -(-N // B)),
            "replace_one",
        ),
        (
            "shuffle(b, n)",
            epochs(lambda **kw: SamplingEvent.shuffle(B, N, **kw), -(-N // B)),
            "add_remove",
        ),
        ("full_batch(n)", [SamplingEvent.poisson(1.0, N)] * EPOCHS, "add_remove"),
    ]
    print(f"# machine: {platform.processor() or platform.machine()}, {platform.platform()}")
    print(f"# n={N}, b={B}, z={Z}, {EPOCHS} epochs, δ={DELTA}; median of {repeats} runs\n")
    print("| sampler | relation | steps | accountant | ε | kind | seconds |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, events, relation in setups:
        comp = ledger(events, relation)
        for acc_name in ("rdp", "pld", "prv", "gdp", "balls_in_bins", "random_allocation"):
            settings = {"samples": mc_samples} if acc_name == "balls_in_bins" else {}
            acc = make_accountant(acc_name, **settings)
            try:
                result, seconds = timed(
                    lambda acc=acc, comp=comp: acc.epsilon(comp, delta=DELTA), repeats
                )
            except UnsupportedLedgerError as exc:
                reason = str(exc).split(":")[0].split(".")[0]
                scheme_only = acc_name in ("balls_in_bins", "random_allocation")
                if scheme_only and "balls_in_bins" not in name:
                    continue
                print(
                    f"| {name} | {relation} | {comp.num_steps} | {acc_name} | refused | "
                    f"{reason} | - |"
                )
                continue
            eps = f"{result.epsilon:.4g}"
            if result.kind.value == "estimate" and result.upper is not None:
                eps += f" (upper conf. {result.upper:.4g})"
            print(
                f"| {name} | {relation} | {comp.num_steps} | {acc_name} | {eps} | "
                f"{result.kind.value} | {seconds:.3f} |"
            )
        for kind in ("rdp", "pld"):
            try:
                value, seconds = timed(
                    lambda kind=kind, comp=comp, rel=relation: dp_accounting_epsilon(
                        comp, kind, rel
                    ),
                    repeats,
                )
            except Exception as exc:  # dp-accounting refuses what it cannot analyse
                print(
                    f"| {name} | {relation} | {comp.num_steps} | dp-accounting {kind} | "
                    f"refused | {type(exc).__name__} | - |"
                )
                continue
            print(
                f"| {name} | {relation} | {comp.num_steps} | dp-accounting {kind} | "
                f"{value:.4g} | peer | {seconds:.3f} |"
            )
        if name.startswith("shuffle"):
            gap, seconds = timed(lambda comp=comp: shuffle_gap(comp, delta=DELTA), repeats)
            shown = format_rounded(gap.lower_bound.epsilon, "down", digits=4)
            print(
                f"| {name} | {relation} | {comp.num_steps} | Chua et al. lower bound | "
                f"≥ {shown} | lower_bound | {seconds:.3f} |"
            )


if __name__ == "__main__":
    main()
