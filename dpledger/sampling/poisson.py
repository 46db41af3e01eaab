"""Poisson sampling of records with NumPy, recorded with the exact probability used.

McMahan & Andrew, section 1, step 1: each of the n records is in the sample independently with
probability q, so the sample size is Binomial(n, q) and may be 0. The sampling event recorded in
the ledger carries this q — the sampler's own — rather than a batch-size ratio: a step on a
fresh sample is :func:`dpledger.mechanisms.sampled_step` with ``sampler=`` this sampler.
"""

from __future__ import annotations

import numpy as np

from dpledger.errors import InvalidParameterError
from dpledger.sampling.index_draws import poisson
from dpledger.sampling.validation import (
    MAX_POPULATION,
    check_population_size,
    check_sampling_probability,
)

__all__ = ["MAX_POPULATION", "PoissonSampler"]


class PoissonSampler:
    """Draws Poisson samples of record indices from a population of n records.

    Example::

        sampler = PoissonSampler(population_size=len(data), sampling_probability=0.01,
                                 generator=np.random.default_rng())
        with sampled_step(ledger, sampler=sampler) as step:  # records (q, n), draws the step
            batch = data[step.indices]
            noised = step.run(query, per_example_gradients(batch))

    Args:
        population_size: n ≥ 1.
        sampling_probability: q in [0, 1].
        generator: the ``numpy.random.Generator`` that decides membership.
    """

    def __init__(
        self, *, population_size: int, sampling_probability: float, generator: np.random.Generator
    ) -> None:
        self.population_size = check_population_size(population_size, maximum=MAX_POPULATION)
        self.sampling_probability = check_sampling_probability(
            sampling_probability, allow_zero=True
        )
        if not isinstance(generator, np.random.Generator):
            raise InvalidParameterError(
                "generator", generator, "a numpy.random.Generator (e.g. numpy.random.default_rng())"
            )
        self.generator = generator

    @property
    def expected_batch_size(self) -> float:
        """q·n."""
        return self.sampling_probability * self.population_size

    def sample(self) -> np.ndarray:
        """Sorted indices of the records in a fresh sample (each included with probability q;
        :func:`~dpledger.sampling.index_draws.poisson`)."""
        return poisson(self.generator, self.population_size, self.sampling_probability)

    def __repr__(self) -> str:
        return (
            f"PoissonSampler(population_size={self.population_size!r}, "
            f"sampling_probability={self.sampling_probability!r})"
        )
