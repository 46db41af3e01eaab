"""A NumPy DP-SGD loop that saves its parameters after step k and is then killed.

    python killed_after_checkpoint.py LEDGER WEIGHTS K

Each step draws a Poisson sample (:func:`dpledger.mechanisms.sampled_step` on a
:class:`~dpledger.sampling.PoissonSampler`), releases the
clipped sum of the sampled records' gradients of a least-squares model through a
:class:`~dpledger.mechanisms.GaussianSumQuery`, averages it and updates the parameters. After
exactly K steps it saves the parameters alone (``numpy.save``) and kills itself with SIGKILL
(see ``tests/killed_runs.py``).
"""

from __future__ import annotations

import os
import signal
import sys

import numpy as np

from dpledger import PrivacyLedger
from dpledger.mechanisms import GaussianSumQuery, sampled_step
from dpledger.sampling import PoissonSampler


def main(ledger_path: str, weights_path: str, steps: int) -> None:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(256, 3)), rng.normal(size=256)
    theta = np.zeros(3)
    query = GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=1.0, label="theta")
    sampler = PoissonSampler(population_size=256, sampling_probability=0.05, generator=rng)
    ledger = PrivacyLedger(ledger_path)  # default buffering
    for taken in range(1, steps + 1):
        with sampled_step(ledger, sampler=sampler) as step:
            rows = step.indices
            grads = (x[rows] @ theta - y[rows])[:, None] * x[rows]
            (noised,) = step.run(query, grads)
            (average,) = step.average([noised])
            theta -= 0.1 * average
        if taken == steps:
            np.save(weights_path, theta)  # the parameters alone
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
