"""A DPKerasModel fit that saves the weights after step k and is then killed.

    python killed_after_checkpoint.py LEDGER WEIGHTS K

Fits a tiny dense model with Poisson batches (q = 1/10 of 40 records), and at the end of step
K (a Keras callback) saves the model's weights alone with ``save_weights`` and kills itself with
SIGKILL (see ``tests/killed_runs.py``).
"""

from __future__ import annotations

import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np

from dpledger import PrivacyLedger
from dpledger.adapters.tensorflow import DPKerasModel, PoissonDatasetSampler


class SaveThenKill(keras.callbacks.Callback):
    """After step ``steps``: the weights alone to ``path``, then SIGKILL."""

    def __init__(self, inner: keras.Model, path: str, steps: int) -> None:
        super().__init__()
        self.inner, self.path, self.steps = inner, path, steps

    def on_train_batch_end(self, batch: int, logs: object = None) -> None:
        if batch + 1 == self.steps:
            self.inner.save_weights(self.path)
            os.kill(os.getpid(), signal.SIGKILL)


def main(ledger_path: str, weights_path: str, steps: int) -> None:
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 3)).astype(np.float32)
    y = rng.integers(0, 2, 40).astype(np.int32)
    inner = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    sampler = PoissonDatasetSampler(population_size=40, sampling_probability=0.1, seed=1)
    model = DPKerasModel(
        inner,
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        sampler=sampler,
        ledger=PrivacyLedger(ledger_path),  # default buffering
        seed=2,
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(
        sampler.sample((x, y)),
        epochs=1,
        verbose=0,
        callbacks=[SaveThenKill(inner, weights_path, steps)],
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
