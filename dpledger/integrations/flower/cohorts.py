"""The cohort samplers of a federated run: which scheme draws each round's clients.

A round's cohort is drawn by one of the core's schemes over the n registered clients (users):
Poisson with rate q (:class:`~dpledger.sampling.PoissonScheme`, accounted under add/remove-one),
m clients without replacement (:class:`~dpledger.sampling.FixedSizeScheme`, replace-one), or
the cyclic groups of a correlated-noise spec (:class:`~dpledger.sampling.CyclicScheme`). The
round's ledger event is the scheme's, with unit ``user``.
"""

from __future__ import annotations

import secrets
from typing import Any

from dpledger.errors import InvalidParameterError
from dpledger.ledger import SamplingEvent
from dpledger.mechanisms.correlated import CorrelatedNoiseSpec
from dpledger.sampling import CyclicScheme, FixedSizeScheme, PoissonScheme

__all__ = ["cohort_scheme", "round_event"]


def cohort_scheme(
    *,
    num_clients: Any,
    sampling_probability: Any,
    cohort_size: Any,
    correlated: Any,
    seed: int | None,
) -> PoissonScheme | FixedSizeScheme | CyclicScheme:
    """The scheme that draws the cohorts: exactly one of q, m and a correlated-noise spec.

    Args:
        num_clients: n ≥ 1, the registered clients.
        sampling_probability: q in (0, 1] (Poisson), or None.
        cohort_size: m in [1, n] (fixed size), or None.
        correlated: a :class:`~dpledger.mechanisms.correlated.CorrelatedNoiseSpec` (its cyclic
            groups), or None.
        seed: the group assignment's seed of a cyclic scheme (None: drawn from the OS, so that
            the groups are as secret as the noise).

    Raises:
        InvalidParameterError: none or two of them, or a bad value (named).
    """
    if correlated is not None:
        if not isinstance(correlated, CorrelatedNoiseSpec):
            raise InvalidParameterError("correlated", correlated, "a CorrelatedNoiseSpec or None")
        if sampling_probability is not None or cohort_size is not None:
            name = "sampling_probability" if sampling_probability is not None else "cohort_size"
            raise InvalidParameterError(
                name,
                sampling_probability if cohort_size is None else cohort_size,
                "None with correlated= (the spec's cyclic groups are the cohorts)",
            )
        group_seed = secrets.randbits(63) if seed is None else seed
        return correlated.scheme(population_size=num_clients, seed=group_seed)
    if (sampling_probability is None) == (cohort_size is None):
        raise InvalidParameterError(
            "sampling_probability",
            sampling_probability,
            "exactly one of sampling_probability and cohort_size",
        )
    if sampling_probability is not None:
        return PoissonScheme(population_size=num_clients, sampling_probability=sampling_probability)
    return FixedSizeScheme(population_size=num_clients, batch_size=cohort_size)


def round_event(scheme: Any) -> SamplingEvent | None:
    """The user-level sampling event of a round drawn by ``scheme`` (None for a cyclic scheme:
    its rounds are steps of a correlated release)."""
    n = scheme.population_size
    if isinstance(scheme, PoissonScheme):
        return SamplingEvent.poisson(scheme.sampling_probability, n, unit="user")
    if isinstance(scheme, FixedSizeScheme):
        return SamplingEvent.fixed_size(scheme.batch_size, n, unit="user")
    return None
