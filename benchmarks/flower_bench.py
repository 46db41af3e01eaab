"""Federated learning on Flower: Flower's own accounting beside dpledger's, and the per-round cost.

Run from the repository root (needs ``pip install "dpledger[flower]"``):

    PYTHONPATH=. python benchmarks/flower_bench.py            # T = 100 and 1000 rounds, d = 10⁶
    PYTHONPATH=. python benchmarks/flower_bench.py --quick    # T = 100, d = 10⁵, fewer repeats

**ε side by side.** One federated run: n clients, m per round, noise multiplier z, T rounds,
δ. Flower's DP wrappers (``DifferentialPrivacyServerSideFixedClipping``, ``…ClientSide…``)
accept only its accountant in ``sampling_method="no-amplification"`` mode, which composes T
unsampled Gaussian mechanisms: that is the ε Flower reports for this run. dpledger runs the same
rounds through :class:`~dpledger.integrations.flower.strategy.UserLevelDPStrategy`, which draws
the cohorts itself and records the sampler, so the ledger is accounted with amplification:
fixed-size cohorts of m (replace-one) and Poisson cohorts of rate m/n (add/remove). Flower's
accountant in its Poisson mode (available, though its DP wrappers refuse it) is printed as a
cross-check of dpledger's Poisson ε.

**Overhead per round.** ``aggregate_train`` on the same m replies of a d-parameter float32
model: plain ``FedAvg``, Flower's ``DifferentialPrivacyServerSideFixedClipping`` and dpledger's
wrapper (clip, sum, noise, the round's events written to a ledger file), medians of
``--repeats`` runs and ratios from this run.
"""

from __future__ import annotations

import argparse
import logging
import platform
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg
from flwr.supercore.privacy_accounting import (
    GaussianPrivacyEvent,
    NeighboringRelation,
    PrivacyConfig,
    SamplingMethod,
)
from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant as FlowerRdp
from flwr.supercore.task_identity import TaskIdentity

from dpledger import PrivacyLedger
from dpledger.accountants import PldAccountant, RdpAccountant
from dpledger.integrations.flower.strategy import UserLevelDPStrategy

logging.getLogger("flwr").setLevel(logging.WARNING)
logging.getLogger("dpledger").setLevel(logging.WARNING)
for handler in logging.getLogger("flwr").handlers:
    handler.setLevel(logging.WARNING)

CLIENTS, COHORT, Z, S, DELTA = 100, 10, 1.0, 1.0, 1e-5


class Nodes(Grid):
    """The part of a grid a strategy's ``configure_train`` uses: the node ids."""

    def __init__(self, n: int) -> None:
        self.ids = list(range(1, n + 1))

    def get_node_ids(self):  # type: ignore[no-untyped-def]
        return list(self.ids)

    def set_run(self, run):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    @property
    def run(self):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def create_message(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def push_messages(self, messages):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def pull_messages(self, message_ids):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def send_and_receive(self, messages, *, timeout=None):  # type: ignore[no-untyped-def]
        raise NotImplementedError


def replies_to(messages: list[Message], arrays: list[np.ndarray], rng) -> list[Message]:  # type: ignore[no-untyped-def]
    """Each client's reply: the global model plus a random update of norm about 2·S."""
    out = []
    size = sum(a.size for a in arrays)
    for message in messages:
        message.metadata.__dict__["_message_id"] = str(uuid.uuid4())
        new = [
            (a + rng.normal(scale=2.0 * S / np.sqrt(size), size=a.shape)).astype(a.dtype)
            for a in arrays
        ]
        content = RecordDict(
            {"arrays": ArrayRecord(new), "metrics": MetricRecord({"num-examples": 1})}
        )
        out.append(Message(content, reply_to=message))
    return out


def run_rounds(strategy, rounds: int, arrays: list[np.ndarray], seed: int = 0) -> None:  # type: ignore[no-untyped-def]
    grid, rng = Nodes(CLIENTS), np.random.default_rng(seed)
    record = ArrayRecord(arrays)
    for t in range(1, rounds + 1):
        messages = list(strategy.configure_train(t, record, ConfigRecord(), grid))
        new, _ = strategy.aggregate_train(t, replies_to(messages, arrays, rng))
        record = new if new is not None else record


def epsilons(rounds: int) -> None:
    print(f"\nε at δ = {DELTA} after T rounds: n = {CLIENTS} clients, m = {COHORT}, z = {Z}")
    model = [np.zeros(10, dtype=np.float32)]
    flower = FlowerRdp(
        PrivacyConfig(
            target_delta=DELTA,
            population_size=CLIENTS,
            neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
            sampling_method=SamplingMethod.NO_AMPLIFICATION,
        )
    )
    # what Flower's DP wrapper composes, once per released round
    event = GaussianPrivacyEvent(noise_multiplier=Z, sample_size=COHORT, population_size=CLIENTS)
    flower.compose(event, rounds)
    poisson_flower = FlowerRdp(
        PrivacyConfig(
            target_delta=DELTA,
            population_size=CLIENTS,
            neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
            sampling_method=SamplingMethod.POISSON,
        )
    )
    poisson_flower.compose(event, rounds)
    rows = [("Flower, its DP wrappers' accountant (no amplification)", flower.get_epsilon(DELTA))]
    fixed = ("dpledger, fixed-size cohorts (replace-one)", {"cohort_size": COHORT}, "replace_one")
    poisson = ("dpledger, Poisson cohorts q = m/n (add/remove)",
               {"sampling_probability": COHORT / CLIENTS}, "add_remove")  # fmt: skip
    # dp-accounting's PLD has no construction for sampling without replacement: RDP certifies it
    for (label, kwargs, relation), accountants in (
        (fixed, (RdpAccountant(),)),
        (poisson, (RdpAccountant(), PldAccountant())),
    ):
        ledger = PrivacyLedger(neighboring=relation)
        strategy = UserLevelDPStrategy(
            FedAvg(fraction_evaluate=0.0, min_available_nodes=1, min_train_nodes=1),
            ledger=ledger, num_clients=CLIENTS, l2_norm_bound=S, noise_multiplier=Z, **kwargs,
        )  # fmt: skip
        run_rounds(strategy, rounds, model)
        assert ledger.num_steps == rounds
        for accountant in accountants:
            result = accountant.epsilon(ledger, delta=DELTA)
            rows.append((f"{label}, {accountant.name}", result.value))
    rows.append(("Flower's accountant in Poisson mode (its wrappers refuse it)",
                 poisson_flower.get_epsilon(DELTA)))  # fmt: skip
    base = rows[0][1]
    print(f"T = {rounds}")
    for label, value in rows:
        print(f"  {label:<66} ε = {value:10.4f}   ({value / base:6.3f} × Flower's)")


def timed(make: Callable[[], Callable[[], object]], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        call = make()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def overhead(dim: int, repeats: int) -> None:
    rows, cols = 1000, dim // 1000
    arrays = [np.zeros((rows, cols), dtype=np.float32), np.zeros(cols, dtype=np.float32)]
    record, grid, rng = ArrayRecord(arrays), Nodes(CLIENTS), np.random.default_rng(1)
    tmp = Path(tempfile.mkdtemp())

    def round_of(strategy, t: list[int]) -> Callable[[], Callable[[], object]]:  # type: ignore[no-untyped-def]
        def make() -> Callable[[], object]:
            t[0] += 1
            messages = list(strategy.configure_train(t[0], record, ConfigRecord(), grid))
            replies = replies_to(messages, arrays, rng)
            return lambda: strategy.aggregate_train(t[0], replies)

        return make

    fedavg = FedAvg(fraction_train=COHORT / CLIENTS, fraction_evaluate=0.0, min_available_nodes=1)
    flower_dp = DifferentialPrivacyServerSideFixedClipping(
        FedAvg(fraction_train=COHORT / CLIENTS, fraction_evaluate=0.0, min_available_nodes=1),
        noise_multiplier=Z, clipping_norm=S, num_sampled_clients=COHORT,
    )  # fmt: skip
    ledger = PrivacyLedger(tmp / "bench.dpl", neighboring="replace_one")
    ours = UserLevelDPStrategy(
        FedAvg(fraction_evaluate=0.0, min_available_nodes=1, min_train_nodes=1),
        ledger=ledger, num_clients=CLIENTS, l2_norm_bound=S, noise_multiplier=Z,
        cohort_size=COHORT,
    )  # fmt: skip
    medians = {}
    contenders = (
        ("FedAvg", fedavg),
        ("Flower DP (server-side fixed clipping)", flower_dp),
        ("dpledger UserLevelDPStrategy", ours),
    )
    for name, strategy in contenders:
        medians[name] = timed(round_of(strategy, [0]), repeats)
    ledger.close()
    print(f"\naggregate_train per round: m = {COHORT} replies, d = {dim:,} float32 parameters, "
          f"median of {repeats}")  # fmt: skip
    base = medians["FedAvg"]
    flower = medians["Flower DP (server-side fixed clipping)"]
    for name, value in medians.items():
        print(f"  {name:<40} {value * 1e3:9.1f} ms   {value / base:5.2f} × FedAvg   "
              f"{value / flower:5.2f} × Flower DP")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    repeats = args.repeats or (5 if args.quick else 15)
    print(f"machine: {platform.platform()}, {platform.processor() or platform.machine()}")
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    for rounds in (100,) if args.quick else (100, 1000):
        epsilons(rounds)
    overhead(100_000 if args.quick else 1_000_000, repeats)


if __name__ == "__main__":
    main()
