"""Runs in a fresh process (logical devices must be set before TensorFlow starts): DP training
under MirroredStrategy on two logical CPUs against a single-device run; prints JSON results."""

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

from dpledger.adapters.tensorflow import DPKerasModel, PoissonDatasetSampler  # noqa: E402

Q, N = 0.1, 100


def _model() -> keras.Model:
    keras.utils.set_random_seed(3)
    return keras.Sequential(
        [
            keras.Input((6, 6, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(20, activation="tanh"),
            keras.layers.Dense(30),
        ]
    )


def _train(strategy, x, y, *, clip, sigma, seed=5):
    scope = strategy.scope() if strategy is not None else tf.name_scope("single")
    with scope:
        model = _model()
        dp = DPKerasModel(
            model,
            l2_norm_bound=clip,
            noise_multiplier=sigma,
            sampling_probability=Q,
            population_size=N,
            seed=seed,
        )
        dp.compile(
            optimizer=keras.optimizers.SGD(1.0),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    data = tf.data.Dataset.from_tensors((x, y))
    dp.fit(data, epochs=1, shuffle=False, verbose=0)
    weights = np.concatenate([np.asarray(v).ravel() for v in model.trainable_variables])
    replicas = None
    if strategy is not None:
        replicas = [
            np.concatenate(
                [np.asarray(v.value.values[r]).ravel() for v in model.trainable_variables]
            ).tolist()
            for r in range(2)
        ]
    steps = [[(e.l2_norm_bound, e.noise_stddev) for e in s.queries] for s in dp.ledger.steps()]
    return weights, replicas, steps


def main() -> None:
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(10, 6, 6, 1)).astype(np.float32)
    y = rng.integers(0, 30, 10).astype(np.int32)
    start = np.concatenate([np.asarray(v).ravel() for v in _model().trainable_variables])
    out = {"replicas": strategy.num_replicas_in_sync, "weight_scale": float(np.max(np.abs(start)))}
    for name, clip in (("unclipped", 1e30), ("clipped", 0.05)):
        single, _, _ = _train(None, x, y, clip=clip, sigma=0.0)
        mirrored, replicas, steps = _train(strategy, x, y, clip=clip, sigma=0.0)
        out[name] = {
            "single_update": (single - start).tolist(),
            "mirrored_update": (mirrored - start).tolist(),
            "replicas_equal": replicas[0] == replicas[1],
            "steps": steps,
        }
    exact, _, _ = _train(strategy, x, y, clip=0.05, sigma=0.0)
    noisy, _, steps = _train(strategy, x, y, clip=0.05, sigma=2.0)
    out["noise"] = {"difference": (noisy - exact).tolist(), "steps": steps}
    # Poisson batches (uneven and empty per-replica shards): one ledger step per step
    sampler = PoissonDatasetSampler(population_size=10, sampling_probability=0.15, seed=1)
    with strategy.scope():
        dp = DPKerasModel(
            _model(), l2_norm_bound=1.0, noise_multiplier=1.0, sampler=sampler, seed=2
        )
        dp.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    dp.fit(sampler.sample((x, y)), epochs=2, shuffle=False, verbose=0)
    out["poisson"] = {
        "ledger_steps": dp.ledger.num_steps,
        "iterations": int(dp.optimizer.iterations.numpy()),
    }
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
