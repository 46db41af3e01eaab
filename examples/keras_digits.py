"""Train a small CNN on scikit-learn's digits with DP through Keras's ``model.fit``.

The training set (1,437 images of 8×8 pixels) is sampled with a Poisson sampler (each image in
each batch with probability q = 64/1437); every step clips each example's gradient to C = 1,
adds Gaussian noise with the noise multiplier calibrated for ε = 8 at δ = 1e-5 (RDP), averages
with the fixed denominator q·n and lets Adam take the step. The run's ledger is written to a file
and replayed by every accountant available.

    PYTHONPATH=. python examples/keras_digits.py [LEDGER_PATH]   # default: keras_digits.dpl
    dpledger epsilon LEDGER_PATH --delta 1e-5                    # the same ε, from the file
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import attrs
import keras
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from dpledger import PrivacyLedger
from dpledger.accountants import calibrate_noise_multiplier, make_accountant
from dpledger.accountants.base import ACCOUNTANT_MODULES, SCHEME_SPECIFIC_ACCOUNTANTS
from dpledger.adapters.tensorflow import DPKerasModel, PoissonDatasetSampler

DELTA = 1e-5
TARGET_EPSILON = 8.0
EXPECTED_BATCH = 64
CLIP = 1.0


@attrs.frozen
class DigitsRun:
    """What a run produced: test accuracy, the ledger, the ε table and the noise used."""

    test_accuracy: float
    ledger: PrivacyLedger
    epsilons: dict[str, Any]
    skipped: dict[str, str]
    noise_multiplier: float
    steps: int


def digits_cnn() -> keras.Model:
    """Conv(16, 3×3) → Conv(32, 3×3) → Dense(32) → Dense(10): 14,378 parameters."""
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(32, 3, strides=2, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def epsilon_table(ledger: PrivacyLedger, *, delta: float = DELTA) -> tuple[dict, dict]:
    """ε at δ from every accountant of ACCOUNTANT_MODULES that can be imported.

    Returns:
        (results by name, reasons by name for the accountants that could not be used).
    """
    results, skipped = {}, {}
    for name in ACCOUNTANT_MODULES:
        if name in SCHEME_SPECIFIC_ACCOUNTANTS:  # for one sampling scheme, not this Poisson run
            continue
        module_name, _ = ACCOUNTANT_MODULES[name]
        try:
            importlib.import_module(module_name)
        except ImportError as exc:
            skipped[name] = f"cannot be imported ({exc})"
            continue
        results[name] = make_accountant(name).epsilon(ledger, delta=delta)
    return results, skipped


def train(
    *,
    epochs: int = 15,
    optimizer: keras.optimizers.Optimizer | None = None,
    ledger_path: str | os.PathLike[str] | None = None,
    seed: int = 0,
    strategy: str = "auto",
    noise_seed: int | None = None,
) -> DigitsRun:
    """Train the CNN with DP for ``epochs`` epochs of 1/q steps; return accuracy and ε.

    ``seed`` seeds the data split and the model's initialisation; the noise and the batches
    come from the operating system unless ``noise_seed`` is given (for tests and research:
    the ledger then records a caller-given seed and ``dpledger epsilon`` flags it).
    """
    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int32")
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=seed, stratify=y
    )
    sampler = PoissonDatasetSampler.from_expected_batch_size(
        population_size=len(x_train), expected_batch_size=EXPECTED_BATCH, seed=noise_seed
    )
    steps = epochs * sampler.steps_per_epoch
    z = calibrate_noise_multiplier(
        target_epsilon=TARGET_EPSILON,
        delta=DELTA,
        sampling_probability=sampler.sampling_probability,
        steps=steps,
        accountant="rdp",
    ).value
    keras.utils.set_random_seed(seed)
    model = digits_cnn()
    ledger = PrivacyLedger(ledger_path, metadata={"example": "keras_digits"})
    dp_model = DPKerasModel(
        model,
        l2_norm_bound=CLIP,
        noise_multiplier=z,
        sampler=sampler,
        ledger=ledger,
        seed=None if noise_seed is None else noise_seed + 1,
        strategy=strategy,
    )
    dp_model.compile(
        optimizer=optimizer or keras.optimizers.Adam(2e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    dp_model.fit(sampler.sample((x_train, y_train)), epochs=epochs, shuffle=False, verbose=0)
    ledger.flush()
    _, accuracy = dp_model.evaluate(x_test, y_test, verbose=0)
    results, skipped = epsilon_table(ledger)
    return DigitsRun(
        test_accuracy=float(accuracy),
        ledger=ledger,
        epsilons=results,
        skipped=skipped,
        noise_multiplier=z,
        steps=steps,
    )


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "keras_digits.dpl")
    noise_seed = int(sys.argv[2]) if len(sys.argv) > 2 else None  # tests only: OS by default
    if path.exists():
        path.unlink()  # the demo starts over; a resumed run would pass resume=True
    run = train(ledger_path=path, noise_seed=noise_seed)
    run.ledger.close()
    print(f"steps: {run.steps}, noise multiplier: {run.noise_multiplier:.4f}, C = {CLIP}")
    print(f"test accuracy: {run.test_accuracy:.3f}")
    print(f"epsilon at delta = {DELTA:g} from the ledger {path}:")
    for name, result in run.epsilons.items():
        print(f"  {name:4s} {result.epsilon:8.4f}  ({result.kind.value})")
    for name, reason in run.skipped.items():
        print(f"  {name:4s} skipped: {reason}")


if __name__ == "__main__":
    main()
