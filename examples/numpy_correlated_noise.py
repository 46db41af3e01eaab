"""BandMF (correlated noise) for logistic regression in plain NumPy, with a ledger and ε.

Every record joins one of ``BATCHES`` fixed groups, uniformly and independently of the others
(``dpledger.sampling.CyclicScheme``), and the groups are visited in the same order every epoch
(cyclic participation: a record takes part once every ``BATCHES`` steps; independent assignment,
not an equal split of the data, is what keeps this valid under add/remove). The noise comes from
a banded Toeplitz factorization with at most ``BATCHES`` bands (BandMF, Choquette-Choo et al. 2023),
optimised for the stream's T steps: the noise of step t is (C⁻¹·Z)_t, which cancels in the
running sum of updates that SGD follows. The release is recorded once in the ledger (strategy,
hash of C, participation, clip, noise, sensitivity) and the accountants turn it into the Gaussian
mechanism it is: μ = sens(C)·S/σ.

Run:  PYTHONPATH=. python examples/numpy_correlated_noise.py
"""

from __future__ import annotations

import secrets

import numpy as np
from sklearn.datasets import load_breast_cancer

from dpledger import PrivacyLedger
from dpledger.accountants.base import make_accountant
from dpledger.mechanisms.correlated import CorrelatedNoiseRelease, optimize_banded_toeplitz
from dpledger.sampling import CyclicScheme

SEED = 0
BATCHES = 7  # fixed batches per epoch: the period of the cyclic participation
EPOCHS = 10
BANDS = 7  # at most BATCHES: columns BATCHES apart are then orthogonal
CLIP = 1.0  # S
NOISE_STDDEV = 12.0  # σ of every entry of Z
LEARNING_RATE = 0.5
DELTA = 1e-5


def load_data(rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    data = load_breast_cancer()
    x, y = data.data, data.target.astype(np.float64)
    order = rng.permutation(len(y))
    x, y = x[order], y[order]
    split = int(0.8 * len(y))
    mean, std = x[:split].mean(axis=0), x[:split].std(axis=0)
    x = (x - mean) / std
    return x[:split], y[:split], x[split:], y[split:]


def per_example_gradients(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Gradients of the logistic loss of each example (bias as the last feature): (B, d)."""
    residual = 1.0 / (1.0 + np.exp(-(x @ w))) - y
    return residual[:, None] * x


def accuracy(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(((x @ w) > 0) == (y == 1)))


def main() -> None:
    rng = np.random.default_rng(SEED)
    x_train, y_train, x_test, y_test = load_data(rng)
    x_train = np.hstack([x_train, np.ones((len(x_train), 1))])
    x_test = np.hstack([x_test, np.ones((len(x_test), 1))])
    n, d = x_train.shape
    steps = BATCHES * EPOCHS
    # the batches and the noise come from the OS's entropy; SEED seeds only the data
    scheme = CyclicScheme(
        population_size=n, period=BATCHES, num_steps=steps, seed=secrets.randbits(62)
    )

    factorization = optimize_banded_toeplitz(num_steps=steps, bands=BANDS)
    schema = scheme.participation().schema
    ledger = PrivacyLedger(metadata={"example": "numpy_correlated_noise"})
    release = CorrelatedNoiseRelease(
        ledger,
        factorization,
        schema,
        l2_norm_bound=CLIP,
        noise_stddev=NOISE_STDDEV,
        dim=d,
        label="weights",
    )

    w = np.zeros(d)
    print(f"test accuracy before training: {accuracy(w, x_test, y_test):.3f}")
    for t in range(steps):
        idx = scheme.draw(t)
        noisy_sum = release.release(per_example_gradients(w, x_train[idx], y_train[idx]))
        w -= LEARNING_RATE * noisy_sum / scheme.average_denominator  # a fixed denominator
    print(f"test accuracy after {steps} BandMF steps: {accuracy(w, x_test, y_test):.3f}")

    (event,) = ledger.correlated_releases
    print("\nprivacy ledger")
    print(f"  {event.describe()}")
    print(f"  mu = sens(C)·S/σ = {event.gaussian_mu:.4f}")
    for name in ("pld", "rdp"):
        result = make_accountant(name).epsilon(ledger, delta=DELTA)
        print(f"  epsilon at delta = {DELTA:g} ({name}, {result.kind.value}): {result.value:.3f}")


if __name__ == "__main__":
    main()
