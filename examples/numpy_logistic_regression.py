"""DP-SGD for logistic regression in plain NumPy, with per-layer clipping groups and a ledger.

The weights and the bias are two groups (two Gaussian sum queries on every sample): the total
clip bound S* is split between them by dimension, S_g = S*·√(d_g/D), and the noise is
dimension-adjusted, σ̃_g = z·√(D/d_g)·S_g, so the step's effective noise multiplier (paper
Eq. 1) is exactly the target z. Samples are drawn by Poisson sampling and every step's sampling
and sum-query events go to a privacy ledger, which is summarised at the end and replayed with
dp-accounting's RDP accountant.

Run:  PYTHONPATH=. python examples/numpy_logistic_regression.py
"""

from __future__ import annotations

import dp_accounting
import numpy as np
from sklearn.datasets import load_breast_cancer

from dpledger import PrivacyLedger
from dpledger.mechanisms import (
    GroupedSumQuery,
    dimension_adjusted_noise,
    sampled_step,
    split_clip_by_dimension,
)
from dpledger.sampling import PoissonSampler

SEED = 0
STEPS = 60
EXPECTED_BATCH = 64
TOTAL_CLIP = 1.0  # S*
NOISE_MULTIPLIER = 1.5  # target z for every step
LEARNING_RATE = 1.0
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


def per_example_gradients(
    w: np.ndarray, b: float, x: np.ndarray, y: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Gradients of the logistic loss of each example: (B, d) for w and (B, 1) for b."""
    residual = 1.0 / (1.0 + np.exp(-(x @ w + b))) - y
    return residual[:, None] * x, residual[:, None]


def accuracy(w: np.ndarray, b: float, x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(((x @ w + b) > 0) == (y == 1)))


def main() -> None:
    rng = np.random.default_rng(SEED)
    x_train, y_train, x_test, y_test = load_data(rng)
    n, d = x_train.shape

    dimensions = [d, 1]  # weights, bias
    bounds = split_clip_by_dimension(total_l2_norm_bound=TOTAL_CLIP, dimensions=dimensions)
    allocation = dimension_adjusted_noise(
        noise_multiplier=NOISE_MULTIPLIER, l2_norm_bounds=bounds, dimensions=dimensions
    )
    queries = GroupedSumQuery(list(allocation.queries(labels=["weights", "bias"])))
    sampler = PoissonSampler(
        population_size=n, sampling_probability=EXPECTED_BATCH / n, generator=rng
    )

    w, b = np.zeros(d), 0.0
    print(f"test accuracy before training: {accuracy(w, b, x_test, y_test):.3f}")
    ledger = PrivacyLedger(metadata={"example": "numpy_logistic_regression"})
    for _ in range(STEPS):
        with sampled_step(ledger, sampler=sampler) as step:
            idx = step.indices
            grad_w, grad_b = per_example_gradients(w, b, x_train[idx], y_train[idx])
            (noised_w,), (noised_b,) = step.run(queries, [[grad_w], [grad_b]])
            (avg_w,) = step.average([noised_w])  # sum / (q·n): the unbiased fixed denominator
            (avg_b,) = step.average([noised_b])
        w -= LEARNING_RATE * avg_w
        b -= LEARNING_RATE * float(avg_b[0])
    print(f"test accuracy after {STEPS} DP steps: {accuracy(w, b, x_test, y_test):.3f}")

    print("\nprivacy ledger")
    print(f"  steps: {ledger.num_steps}, events: {ledger.num_events}, labels: {ledger.labels}")
    for g, (s, sigma) in enumerate(
        zip(allocation.l2_norm_bounds, allocation.noise_stddevs, strict=True)
    ):
        print(f"  group {queries.labels[g]!r}: S_g = {s:.4f}, noise stddev = {sigma:.4f}")
    print(
        f"  target z = {allocation.target_noise_multiplier}, "
        f"z_eff (Eq. 1) = {allocation.effective_noise_multiplier!r}"
    )
    for run in ledger.runs():
        print(
            f"  run: q = {run.sampling_probability:.4f}, z_eff = {run.noise_multiplier!r}, "
            f"steps = {run.count}"
        )
    accountant = dp_accounting.rdp.RdpAccountant(orders=list(range(2, 257)))
    accountant.compose(ledger.to_dp_event())
    print(f"  epsilon at delta = {DELTA:g} (RDP upper bound): {accountant.get_epsilon(DELTA):.3f}")


if __name__ == "__main__":
    main()
