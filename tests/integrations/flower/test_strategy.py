"""UserLevelDPStrategy through Flower's own strategy loop and ClientApp dispatch.

Every test runs ``Strategy.start`` of Flower on a :class:`LoopbackGrid` (real ``ClientApp``s, the
transport replaced by a direct call) with 20–40 clients holding synthetic linear-regression data;
one slow test runs the same through Flower's simulation runtime (Ray).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAdam, FedAvg

from dpledger import PrivacyLedger
from dpledger.accountants import RdpAccountant
from dpledger.errors import (
    InvalidParameterError,
    SamplerMismatchError,
    UpdateOverBoundError,
)
from dpledger.integrations.flower.client import (
    CLIP_NORM_KEY,
    UPDATE_NORM_KEY,
    clip_client_update,
)
from dpledger.integrations.flower.strategy import UserLevelDPStrategy
from dpledger.ledger import SamplingEvent
from dpledger.mechanisms.adaptive import adaptive_noise_multiplier
from tests.integrations.flower.loopback import LoopbackGrid, server_identity

DIM = 6
EXAMPLES = 10


def local_data(partition: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + partition)
    x = rng.normal(size=(EXAMPLES, DIM))
    return x, x @ np.linspace(-1, 1, DIM) + rng.normal(scale=0.1, size=EXAMPLES)


def local_training(weights: np.ndarray, partition: int) -> np.ndarray:
    """Three steps of gradient descent on the client's least-squares loss, in float64."""
    x, y = local_data(partition)
    for _ in range(3):
        weights = weights - 0.1 * x.T @ (x @ weights - y) / EXAMPLES
    return weights


def make_client(*, mode: str = "train", cheat: int | None = None) -> ClientApp:
    """A ClientApp: ``train`` (server-side clipping), ``zero`` (sends the model back), or
    ``clip`` (clips with clip_client_update; partition ``cheat`` sends 10 times its update)."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context) -> Message:  # type: ignore[no-untyped-def]
        (weights,) = msg.content["arrays"].to_numpy_ndarrays()
        partition = int(context.node_config["partition-id"])
        metrics: dict[str, float] = {"num-examples": EXAMPLES}
        new = weights if mode == "zero" else local_training(weights, partition)
        if mode == "clip":
            bound = float(msg.content["config"][CLIP_NORM_KEY])
            (clipped,), norm = clip_client_update([new], [weights], l2_norm_bound=bound)
            new = weights + 10 * (new - weights) if partition == cheat else clipped
            metrics[UPDATE_NORM_KEY] = norm
        content = RecordDict({"arrays": ArrayRecord([new]), "metrics": MetricRecord(metrics)})
        return Message(content, reply_to=msg)

    return app


def run(strategy, grid: LoopbackGrid, rounds: int, initial: np.ndarray | None = None):  # type: ignore[no-untyped-def]
    start = np.zeros(DIM) if initial is None else initial
    with server_identity():
        return strategy.start(
            grid=grid, initial_arrays=ArrayRecord([start]), num_rounds=rounds, timeout=10
        )


def final(result) -> np.ndarray:  # type: ignore[no-untyped-def]
    (weights,) = result.arrays.to_numpy_ndarrays()
    return weights


def dp(grid_size: int = 20, *, ledger: PrivacyLedger | None = None, **kwargs):  # type: ignore[no-untyped-def]
    settings = {"l2_norm_bound": 1.0, "noise_multiplier": 1.0, "seed": 7}
    settings.update(kwargs)
    if ledger is None:
        relation = "replace_one" if "cohort_size" in settings else "add_remove"
        ledger = PrivacyLedger(neighboring=relation)
    inner = FedAvg(fraction_evaluate=0.0, min_available_nodes=1, min_train_nodes=1)
    return UserLevelDPStrategy(inner, ledger=ledger, num_clients=grid_size, **settings)


def test_ledger_rounds_and_q_are_what_the_server_did() -> None:
    grid = LoopbackGrid(make_client(), 40)
    strategy = dp(40, sampling_probability=0.25, noise_multiplier=1.3, l2_norm_bound=0.5)
    run(strategy, grid, 5)
    steps = list(strategy.ledger.steps())
    assert len(steps) == 5
    expected = SamplingEvent.poisson(0.25, 40, unit="user")
    assert all(step.sampling == expected for step in steps)
    for step in steps:
        assert [(e.l2_norm_bound, e.noise_stddev, e.label) for e in step.queries] == [
            (0.5, 1.3 * 0.5, "update")
        ]
    # the cohorts the ledger's sampler drew are the nodes Flower delivered to
    assert grid.delivered == [strategy.cohorts[t] for t in range(1, 6)]
    sizes = [len(c) for c in grid.delivered]
    assert len(set(sizes)) > 1  # Poisson cohorts vary in size
    assert strategy.population == sorted(grid.node_ids)


def test_zero_noise_and_an_unreachable_bound_reproduce_fedavg_on_the_same_cohorts() -> None:
    grid = LoopbackGrid(make_client(), 20)
    strategy = dp(20, cohort_size=8, noise_multiplier=0.0, l2_norm_bound=1e9)
    dp_weights = final(run(strategy, grid, 4))

    class SameCohorts(LoopbackGrid):
        """Offers plain FedAvg only the nodes the DP strategy drew in each round."""

        round = 0

        def get_node_ids(self):  # type: ignore[no-untyped-def]
            return strategy.cohorts[self.round + 1]

        def send_and_receive(self, messages, *, timeout=None):  # type: ignore[no-untyped-def]
            messages = list(messages)
            replies = super().send_and_receive(messages, timeout=timeout)
            self.round += bool(messages)  # a train round (evaluation is off)
            return replies

    plain = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=1)
    plain_weights = final(run(plain, SameCohorts(make_client(), 20), 4))
    assert [sorted(c) for c in grid.delivered] == [
        sorted(strategy.cohorts[t]) for t in (1, 2, 3, 4)
    ]
    np.testing.assert_allclose(dp_weights, plain_weights, rtol=1e-12, atol=1e-15)
    # and both are the float64 loop of FedAvg over those cohorts
    weights = np.zeros(DIM)
    for t in range(1, 5):
        parts = [grid.partition[node] for node in strategy.cohorts[t]]
        weights = np.mean([local_training(weights, p) for p in parts], axis=0)
    np.testing.assert_allclose(dp_weights, weights, rtol=1e-12, atol=1e-15)


@pytest.mark.statistical
def test_the_noise_has_the_recorded_stddev_over_the_fixed_denominator() -> None:
    dim, cohort, z, bound = 4000, 10, 2.0, 0.5
    grid = LoopbackGrid(make_client(mode="zero"), 20)
    strategy = dp(20, cohort_size=cohort, noise_multiplier=z, l2_norm_bound=bound)
    with server_identity():
        result = strategy.start(
            grid=grid, initial_arrays=ArrayRecord([np.zeros(dim)]), num_rounds=1, timeout=10
        )
    noise = final(result)
    expected = z * bound / cohort  # σ̃ / m per coordinate of the average
    # the sample standard deviation of d normals has standard error σ/√(2d); the mean σ/√d
    assert abs(noise.std() - expected) < 5 * expected / math.sqrt(2 * dim)
    assert abs(noise.mean()) < 5 * expected / math.sqrt(dim)
    (step,) = strategy.ledger.steps()
    assert step.queries[0].noise_stddev == z * bound


def test_silent_clients_contribute_nothing_and_the_denominator_stays_fixed() -> None:
    silent = {0, 3, 5}
    grid = LoopbackGrid(make_client(), 12, silent=silent)
    strategy = dp(12, cohort_size=12, noise_multiplier=0.0, l2_norm_bound=1e9)
    weights = final(run(strategy, grid, 1))
    answered = [local_training(np.zeros(DIM), p) for p in range(12) if p not in silent]
    np.testing.assert_allclose(weights, np.sum(answered, axis=0) / 12, rtol=1e-12)
    assert strategy.silent_clients == 3
    assert {"flower_round": {"round": 1, "sampled": 12, "silent": 3}} in strategy.ledger.notes
    assert strategy.ledger.num_steps == 1


def test_server_side_clipping_bounds_every_update() -> None:
    grid = LoopbackGrid(make_client(), 10)
    strategy = dp(10, cohort_size=10, noise_multiplier=0.0, l2_norm_bound=0.05)
    weights = final(run(strategy, grid, 1))
    updates = [local_training(np.zeros(DIM), p) for p in range(10)]
    clipped = [u * min(1.0, 0.05 / np.linalg.norm(u)) for u in updates]
    assert min(np.linalg.norm(u) for u in updates) > 0.05  # every update was clipped
    np.testing.assert_allclose(weights, np.mean(clipped, axis=0), rtol=1e-12)


def test_client_side_clipping_is_checked_and_an_update_over_the_bound_refused(tmp_path) -> None:
    path = tmp_path / "fl.dpl"
    honest = dp(10, cohort_size=10, noise_multiplier=0.0, l2_norm_bound=0.05, clipping="client")
    server_side = dp(10, cohort_size=10, noise_multiplier=0.0, l2_norm_bound=0.05)
    np.testing.assert_allclose(
        final(run(honest, LoopbackGrid(make_client(mode="clip"), 10), 2)),
        final(run(server_side, LoopbackGrid(make_client(), 10), 2)),
        rtol=1e-5,
    )
    ledger = PrivacyLedger(path, neighboring="replace_one")
    cheated = dp(
        10, ledger=ledger, cohort_size=10, noise_multiplier=1.0, l2_norm_bound=0.05,
        clipping="client",
    )  # fmt: skip
    grid = LoopbackGrid(make_client(mode="clip", cheat=4), 10)
    with pytest.raises(UpdateOverBoundError) as info:
        run(cheated, grid, 1)
    assert info.value.client == grid.node_ids[4] and info.value.bound == 0.05
    assert info.value.norm > 0.05
    ledger.close()
    assert PrivacyLedger.load(path).num_steps == 0  # refused before anything was recorded


def test_a_reply_from_a_client_the_sampler_did_not_draw_is_refused() -> None:
    grid = LoopbackGrid(make_client(), 20)
    strategy = dp(20, cohort_size=5)
    with server_identity():
        messages = list(strategy.configure_train(1, ArrayRecord([np.zeros(DIM)]), _config(), grid))
        outsider = next(n for n in grid.node_ids if n not in strategy.cohorts[1])
        forged = Message(messages[0].content, dst_node_id=outsider, message_type=MessageType.TRAIN)
        forged.metadata.__dict__["_message_id"] = "forged"
        reply = make_client()(forged, grid._contexts[outsider])
        with pytest.raises(SamplerMismatchError, match="did not draw"):
            strategy.aggregate_train(1, [reply])
        with pytest.raises(SamplerMismatchError, match="no cohort"):
            strategy.aggregate_train(2, [])
    assert strategy.ledger.num_steps == 0


def _config():  # type: ignore[no-untyped-def]
    from flwr.app import ConfigRecord

    return ConfigRecord()


def test_server_resume_continues_the_ledger(tmp_path) -> None:
    path = tmp_path / "server.dpl"
    with PrivacyLedger(path, neighboring="add_remove") as ledger:
        first = dp(30, ledger=ledger, sampling_probability=0.2, seed=1)
        weights = final(run(first, LoopbackGrid(make_client(), 30), 3))
    with PrivacyLedger(path, resume=True) as ledger:
        second = dp(30, ledger=ledger, sampling_probability=0.2, seed=2)
        run(second, LoopbackGrid(make_client(), 30), 2, initial=weights)
    resumed = PrivacyLedger.load(path)
    assert resumed.num_steps == 5
    fresh = PrivacyLedger()
    for _ in range(5):
        fresh.record_sample(event=SamplingEvent.poisson(0.2, 30, unit="user"))
        fresh.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0, label="update")
    accountant = RdpAccountant()
    assert accountant.epsilon(resumed, delta=1e-5).value == pytest.approx(
        accountant.epsilon(fresh, delta=1e-5).value, rel=1e-12
    )


def test_epsilon_is_logged_every_round_and_calibration_meets_the_target() -> None:
    grid = LoopbackGrid(make_client(), 40)
    strategy = dp(
        40, sampling_probability=0.25, noise_multiplier=None, target_epsilon=3.0, delta=1e-4,
        num_rounds=6, accountant="rdp",
    )  # fmt: skip
    result = run(strategy, grid, 6)
    epsilons = [strategy.epsilons[t] for t in range(1, 7)]
    assert epsilons == sorted(epsilons) and epsilons[0] > 0
    assert 0.97 * 3.0 < epsilons[-1] <= 3.0  # calibrated to 0.1% in z
    assert result.train_metrics_clientapp[6]["dpledger-epsilon"] == epsilons[-1]
    direct = RdpAccountant().epsilon(strategy.ledger, delta=1e-4).value
    assert epsilons[-1] == direct


def test_adaptive_clipping_records_its_count_query_and_moves_the_bound() -> None:
    grid = LoopbackGrid(make_client(), 40)
    strategy = dp(
        40, sampling_probability=0.5, noise_multiplier=1.0, l2_norm_bound=0.01,
        target_unclipped_quantile=0.5, count_noise_stddev=2.0, clip_learning_rate=0.5,
    )  # fmt: skip
    run(strategy, grid, 3)
    steps = list(strategy.ledger.steps())
    z_update = adaptive_noise_multiplier(noise_multiplier=1.0, count_noise_stddev=2.0)
    bounds = []
    for step in steps:
        update, count = step.queries
        assert update.label == "update" and count.label == "unclipped_count"
        assert (count.l2_norm_bound, count.noise_stddev) == (0.5, 2.0)
        assert update.noise_stddev == pytest.approx(z_update * update.l2_norm_bound, rel=1e-12)
        z_eff = (
            (update.l2_norm_bound / update.noise_stddev) ** 2
            + (count.l2_norm_bound / count.noise_stddev) ** 2
        ) ** -0.5
        assert z_eff == pytest.approx(1.0, rel=1e-12)
        bounds.append(update.l2_norm_bound)
    assert bounds[0] == 0.01 and bounds[2] > bounds[1] > bounds[0]  # every update was clipped
    assert strategy.l2_norm_bound > bounds[2]


def test_it_wraps_fedadam_as_post_processing() -> None:
    grid = LoopbackGrid(make_client(), 20)
    inner = FedAdam(fraction_evaluate=0.0, min_available_nodes=1, min_train_nodes=1)
    strategy = UserLevelDPStrategy(
        inner, ledger=PrivacyLedger(), num_clients=20, l2_norm_bound=1.0,
        sampling_probability=0.3, noise_multiplier=1.0, seed=3,
    )  # fmt: skip
    weights = final(run(strategy, grid, 2))
    assert np.all(np.isfinite(weights)) and strategy.ledger.num_steps == 2


@pytest.mark.slow
def test_cli_epsilon_and_report_show_the_user_level_epsilon(tmp_path, capsys) -> None:
    from dpledger.cli import main

    path = tmp_path / "fl.dpl"
    with PrivacyLedger(path, neighboring="add_remove") as ledger:
        strategy = dp(30, ledger=ledger, sampling_probability=0.2, delta=1e-5)
        run(strategy, LoopbackGrid(make_client(), 30), 4)
    assert main(["epsilon", str(path), "--delta", "1e-5", "--accountant", "rdp", "--json"]) == 0
    (shown,) = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]
    assert shown["epsilon"] == pytest.approx(strategy.epsilons[4], rel=1e-12)
    assert shown["details"]["unit"] == "user" and shown["kind"] == "upper_bound"
    assert shown["details"]["sampling"] == ["poisson(q=0.2, n=30), unit=user"]
    report = tmp_path / "report.md"
    command = ["report", str(path), "--delta", "1e-5", "--accountant", "rdp", "--curve", "2"]
    assert main([*command, "--markdown", str(report)]) == 0
    text = report.read_text(encoding="utf-8")
    assert "| poisson(q=0.2, n=30), unit=user | poisson | user | 0.2 | 4 |" in text
    claimed = float(re.search(r"\(ε = ([0-9.]+), δ = 1e-05\)", text).group(1))  # type: ignore[union-attr]
    # the report shows six digits, rounded up (an upper bound stays one)
    assert strategy.epsilons[4] <= claimed <= strategy.epsilons[4] * (1 + 1e-5)


def test_bad_arguments_are_refused_by_name() -> None:
    inner = FedAvg()
    led = PrivacyLedger()
    cases = [
        ({"sampling_probability": 0.1, "cohort_size": 3}, "sampling_probability"),
        ({}, "sampling_probability"),
        ({"cohort_size": 3}, "ledger"),  # fixed-size needs replace-one
        ({"sampling_probability": 0.1, "clipping": "both"}, "clipping"),
        ({"sampling_probability": 1.5}, "sampling_probability"),
        ({"sampling_probability": 0.1, "noise_multiplier": -1.0}, "noise_multiplier"),
        ({"sampling_probability": 0.1, "l2_norm_bound": 0.0}, "l2_norm_bound"),
        (
            {"sampling_probability": 0.1, "noise_multiplier": None, "target_epsilon": 1.0},
            "num_rounds",
        ),
    ]
    for kwargs, parameter in cases:
        settings = {"l2_norm_bound": 1.0, "noise_multiplier": 1.0, **kwargs}
        with pytest.raises(InvalidParameterError) as info:
            UserLevelDPStrategy(inner, ledger=led, num_clients=10, **settings)
        assert info.value.parameter == parameter, kwargs
    fixed = PrivacyLedger(neighboring="replace_one")
    with pytest.raises(InvalidParameterError, match="target_epsilon"):
        UserLevelDPStrategy(
            inner, ledger=fixed, num_clients=10, l2_norm_bound=1.0, cohort_size=3,
            target_epsilon=1.0, delta=1e-5, num_rounds=3,
        )  # fmt: skip
    with pytest.raises(InvalidParameterError, match="strategy"):
        UserLevelDPStrategy(object(), ledger=led, num_clients=10, l2_norm_bound=1.0,
                            sampling_probability=0.1, noise_multiplier=1.0)  # fmt: skip
    strategy = dp(25, sampling_probability=0.1, registration_timeout=0.0)
    with pytest.raises(InvalidParameterError, match="registered Flower nodes"):
        run(strategy, LoopbackGrid(make_client(), 20), 1)


@pytest.mark.slow
def test_the_example_runs_in_flowers_simulation_runtime_and_leaves_its_rounds(tmp_path) -> None:
    """examples/flower_user_level.py, two rounds in Flower's simulation runtime (Ray)."""
    import subprocess
    import sys

    pytest.importorskip("ray")
    root = Path(__file__).resolve().parents[3]
    path = tmp_path / "simulation.dpl"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, str(root / "examples" / "flower_user_level.py"), "--rounds", "2",
         "--ledger", str(path)],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    ledger = PrivacyLedger.load(path)
    assert ledger.num_steps == 2 and ledger.closed_cleanly
    assert all(s.sampling == SamplingEvent.poisson(0.2, 50, unit="user") for s in ledger.steps())
    line = next(x for x in done.stdout.splitlines() if x.startswith("round  2"))
    epsilon = float(line.rsplit("=", 1)[1])
    assert epsilon == pytest.approx(RdpAccountant().epsilon(ledger, delta=1e-5).value, abs=5e-4)


def test_each_round_is_in_the_ledger_file_before_the_wrapped_strategy_sees_its_model(
    tmp_path,
) -> None:
    path = tmp_path / "ahead.dpl"
    seen: list[tuple[int, int]] = []

    class Watching(FedAvg):
        def aggregate_train(self, server_round, replies):  # type: ignore[no-untyped-def]
            lines = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]
            kinds = [line["kind"] for line in lines]
            seen.append((kinds.count("sample"), kinds.count("sum_query")))
            return super().aggregate_train(server_round, replies)

    with PrivacyLedger(path, neighboring="add_remove", flush_interval=1e9) as ledger:
        inner = Watching(fraction_evaluate=0.0, min_available_nodes=1, min_train_nodes=1)
        strategy = UserLevelDPStrategy(
            inner, ledger=ledger, num_clients=20, l2_norm_bound=1.0, sampling_probability=0.3,
            noise_multiplier=1.0, seed=5,
        )  # fmt: skip
        run(strategy, LoopbackGrid(make_client(), 20), 3)
    assert seen == [(1, 1), (2, 2), (3, 3)]


def _spec():  # type: ignore[no-untyped-def]
    from dpledger.mechanisms.correlated import CorrelatedNoiseSpec

    return CorrelatedNoiseSpec(strategy="bandmf", num_steps=6, period=3, bands=2)


def test_correlated_noise_follows_the_cyclic_groups_and_records_the_stream() -> None:
    from dpledger.mechanisms.correlated import CorrelatedNoiseRelease, noise_for

    grid = LoopbackGrid(make_client(mode="zero"), 21)
    strategy = dp(
        21, correlated=_spec(), noise_multiplier=1.5, l2_norm_bound=0.5, seed=11, delta=1e-5
    )
    weights = final(run(strategy, grid, 6))
    population = strategy.population
    groups = [sorted(strategy.cohorts[t]) for t in range(1, 7)]
    assert groups[:3] == groups[3:]  # round t and t + period take the same group
    assert sorted(n for g in groups[:3] for n in g) == population  # each client in one group
    for t in range(1, 7):  # the cohorts are the scheme's draws
        assert strategy.cohorts[t] == [population[i] for i in strategy.scheme.draw(t - 1)]
    (release,) = strategy.ledger.correlated_releases
    assert strategy.ledger.stream_progress(0) == 6 and strategy.ledger.num_steps == 0
    # the updates are all zero: the model is the sum of the stream's six noises / (n / period)
    expected = noise_for(_spec().factorization(), dim=DIM, noise_stddev=0.75, seed=11)
    total = sum(expected.next() for _ in range(6))
    np.testing.assert_allclose(weights, total / 7.0, rtol=1e-12, atol=1e-15)
    # the ledger's ε is that of the same release recorded directly
    direct = PrivacyLedger()
    same = CorrelatedNoiseRelease(
        direct, _spec().factorization(), _spec().schema(), l2_norm_bound=0.5,
        noise_stddev=0.75, dim=DIM, seed=11, label="update",
    )  # fmt: skip
    for _ in range(6):
        same.next_noise()
    assert release == same.event
    accountant = RdpAccountant()
    assert accountant.epsilon(strategy.ledger, delta=1e-5).value == pytest.approx(
        accountant.epsilon(direct, delta=1e-5).value, rel=1e-12
    )
    assert strategy.epsilons[6] == accountant.epsilon(strategy.ledger, delta=1e-5).value


def test_correlated_noise_refuses_a_round_past_the_stream_and_bad_settings() -> None:
    strategy = dp(21, correlated=_spec(), seed=1)
    with pytest.raises(InvalidParameterError):
        run(strategy, LoopbackGrid(make_client(), 21), 7)
    assert strategy.ledger.stream_progress(0) == 6
    cases = [
        ({"sampling_probability": 0.2}, "sampling_probability"),
        ({"noise_multiplier": 0.0}, "correlated"),
        ({"target_unclipped_quantile": 0.5}, "correlated"),
    ]
    for kwargs, parameter in cases:
        with pytest.raises(InvalidParameterError) as info:
            dp(21, correlated=_spec(), **kwargs)
        assert info.value.parameter == parameter
    used = PrivacyLedger()
    used.record_sample(event=SamplingEvent.poisson(0.2, 21, unit="user"))
    with pytest.raises(InvalidParameterError) as info:
        dp(21, ledger=used, correlated=_spec())
    assert info.value.parameter == "ledger"


def test_an_empty_poisson_cohort_is_still_a_recorded_round() -> None:
    grid = LoopbackGrid(make_client(), 20)
    strategy = dp(20, sampling_probability=0.01, noise_multiplier=2.0, l2_norm_bound=0.5)
    weights = final(run(strategy, grid, 3))
    empty = [t for t in (1, 2, 3) if not strategy.cohorts[t]]
    assert empty  # q·n = 0.2: most rounds draw nobody
    assert strategy.ledger.num_steps == 3  # the noise was released all the same
    assert np.all(weights != 0.0)  # the model moved by the noise alone (σ̃ / (q·n) = 5)
