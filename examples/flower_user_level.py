"""Federated learning with user-level DP on Flower: every round in the server's ledger.

50 simulated clients each hold a small synthetic linear-regression data set and train locally in
NumPy. The server wraps Flower's ``FedAvg`` in ``UserLevelDPStrategy``: each round it draws a
Poisson cohort (every client with probability q), clips each client's model update to S, adds
Gaussian noise calibrated for a target ε over the planned rounds, divides by the fixed
denominator q·n and records the round (a user-level sampling event and the sum query (S, σ̃)) in
``flower_user_level.dpl`` before the new model is used. Afterwards:

    dpledger epsilon flower_user_level.dpl --delta 1e-5

Run (needs ``pip install "dpledger[flower]"``; Flower's simulation runtime starts Ray):

    PYTHONPATH=. python examples/flower_user_level.py [--rounds 10] [--ledger FILE]
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.simulation import run_simulation

from dpledger import PrivacyLedger
from dpledger.integrations.flower.strategy import UserLevelDPStrategy

CLIENTS = 50
SAMPLING_PROBABILITY = 0.2  # q: each client's chance to be in a round
CLIP = 0.5  # S: the L2 bound of one client's model update
TARGET_EPSILON, DELTA = 8.0, 1e-5
DIM, EXAMPLES = 8, 20
TRUE_WEIGHTS = np.linspace(-1.0, 1.0, DIM)


def client_data(partition: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(partition)
    x = rng.normal(size=(EXAMPLES, DIM))
    return x, x @ TRUE_WEIGHTS + rng.normal(scale=0.1, size=EXAMPLES)


client = ClientApp()


@client.train()
def train(msg: Message, context: Context) -> Message:
    """Five steps of gradient descent on the client's own data, from the global model."""
    (weights,) = msg.content["arrays"].to_numpy_ndarrays()
    x, y = client_data(int(context.node_config["partition-id"]))
    for _ in range(5):
        weights = weights - 0.05 * x.T @ (x @ weights - y) / EXAMPLES
    metrics = MetricRecord({"num-examples": EXAMPLES})
    return Message(RecordDict({"arrays": ArrayRecord([weights]), "metrics": metrics}), reply_to=msg)


def server_app(ledger_path: Path, rounds: int) -> ServerApp:
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        with PrivacyLedger(ledger_path, neighboring="add_remove") as ledger:
            strategy = UserLevelDPStrategy(
                FedAvg(fraction_evaluate=0.0),
                ledger=ledger,
                num_clients=CLIENTS,
                sampling_probability=SAMPLING_PROBABILITY,
                l2_norm_bound=CLIP,
                target_epsilon=TARGET_EPSILON,
                delta=DELTA,
                num_rounds=rounds,
            )
            result = strategy.start(
                grid=grid, initial_arrays=ArrayRecord([np.zeros(DIM)]), num_rounds=rounds
            )
        (weights,) = result.arrays.to_numpy_ndarrays()
        print(f"noise multiplier z = {strategy.noise_multiplier:.4f} (calibrated)")
        for t, epsilon in sorted(strategy.epsilons.items()):
            print(f"round {t:2d}: cohort {len(strategy.cohorts[t]):2d}, ε = {epsilon:.3f}")
        print(f"distance to the true weights: {np.linalg.norm(weights - TRUE_WEIGHTS):.3f}")
        print(f"ledger: {ledger_path} ({strategy.silent_clients} silent clients)")

    return server


def main() -> None:
    parser = argparse.ArgumentParser(description="Flower with user-level DP and a ledger")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--ledger", type=Path, default=Path("flower_user_level.dpl"))
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    if args.ledger.exists():
        args.ledger.unlink()
    run_simulation(
        server_app=server_app(args.ledger, args.rounds),
        client_app=client,
        num_supernodes=CLIENTS,
        backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 2}},
    )


if __name__ == "__main__":
    main()
