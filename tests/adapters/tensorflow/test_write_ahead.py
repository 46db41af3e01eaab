"""Write-ahead: a Keras step's events are in the ledger file before it changes a weight."""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np
import pytest

from dpledger import PrivacyLedger
from dpledger.adapters.tensorflow import DPKerasModel, PoissonDatasetSampler
from tests.killed_runs import run_until_killed

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_a_fit_killed_after_save_weights_keeps_every_applied_step(tmp_path: Path) -> None:
    ledger_path, weights = tmp_path / "run.dpl", tmp_path / "model.weights.h5"
    run_until_killed(HERE / "killed_after_checkpoint.py", str(ledger_path), str(weights), "6")
    assert weights.stat().st_size > 0  # the checkpoint was saved
    ledger = PrivacyLedger.load(ledger_path)
    # the saved weights embody 6 steps; each was written before it was applied
    assert ledger.num_steps == 6
    assert all(len(step.queries) == 1 for step in ledger.steps())


def test_every_keras_step_is_in_the_file_when_it_ends(tmp_path: Path) -> None:
    class CountOnDisk(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.counts: list[int] = []

        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            with open(path, encoding="utf-8") as fp:  # a separate open(), not the ledger
                self.counts.append(fp.read().count('"kind":"sample"'))

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(20, 3)).astype(np.float32), rng.integers(0, 2, 20).astype(np.int32)
    path = tmp_path / "run.dpl"
    sampler = PoissonDatasetSampler(population_size=20, sampling_probability=0.2, seed=1)
    model = DPKerasModel(
        keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]),
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        sampler=sampler,
        ledger=PrivacyLedger(path),  # default buffer_size and flush_interval
        seed=2,
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    counter = CountOnDisk()
    model.fit(sampler.sample((x, y)), epochs=2, verbose=0, callbacks=[counter])
    assert counter.counts == list(range(1, 11))
