"""Runs in a fresh process (logical devices must be set before TensorFlow starts): training with
a correlated-noise release under MirroredStrategy on two logical CPUs against a single-device
run with the same seeds; prints JSON results."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from dpledger import PrivacyLedger  # noqa: E402
from dpledger.adapters.tensorflow import CyclicDatasetSampler, DPKerasModel  # noqa: E402
from dpledger.ledger.correlated import StreamStepEvent  # noqa: E402
from dpledger.mechanisms.correlated import CorrelatedNoiseSpec  # noqa: E402

N, PERIOD, T = 12, 2, 4
SPEC = CorrelatedNoiseSpec(strategy="tree_honaker", num_steps=T, period=PERIOD)


def _model() -> keras.Model:
    keras.utils.set_random_seed(3)
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(3)]
    )


def _train(strategy, x, y):  # type: ignore[no-untyped-def]
    scope = strategy.scope() if strategy is not None else tf.name_scope("single")
    ledger = PrivacyLedger()
    sampler = CyclicDatasetSampler(population_size=N, period=PERIOD, num_steps=T, seed=1)
    with scope:
        model = _model()
        dp = DPKerasModel(
            model,
            l2_norm_bound=0.5,
            noise_multiplier=1.5,
            sampler=sampler,
            ledger=ledger,
            seed=7,
            noise=SPEC,
        )
        dp.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    dp.fit(x, y, epochs=T // PERIOD, verbose=0)
    weights = np.concatenate([np.asarray(v).ravel() for v in model.trainable_variables])
    replicas = None
    if strategy is not None:
        replicas = [
            np.concatenate(
                [np.asarray(v.value.values[r]).ravel() for v in model.trainable_variables]
            ).tolist()
            for r in range(2)
        ]
    return weights, replicas, ledger, int(dp.optimizer.iterations.numpy())


def main() -> None:
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 4)).astype(np.float32)
    y = rng.integers(0, 3, N).astype(np.int32)
    start = np.concatenate([np.asarray(v).ravel() for v in _model().trainable_variables])
    single, _, single_ledger, _ = _train(None, x, y)
    mirrored, replicas, ledger, iterations = _train(strategy, x, y)
    out = {
        "replicas": strategy.num_replicas_in_sync,
        "weight_scale": float(np.max(np.abs(start))),
        "single_update": (single - start).tolist(),
        "mirrored_update": (mirrored - start).tolist(),
        "replicas_equal": replicas[0] == replicas[1],
        "releases": len(ledger.correlated_releases),
        "same_release": ledger.correlated_releases == single_ledger.correlated_releases,
        "ledger_steps": ledger.num_steps,
        "stream_steps": [
            [e.release, e.step] for e in ledger.events() if isinstance(e, StreamStepEvent)
        ],
        "single_stream_steps": single_ledger.stream_progress(0),
        "iterations": iterations,
    }
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
