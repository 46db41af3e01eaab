"""CorrelatedNoiseSpec: the factorization and the cyclic selection a training run asks for.

References: the factorizations are compared with the constructors they name
(``tree_factorization``, ``optimize_banded_toeplitz``, ``optimize_blt``); the schema with
``ParticipationSchema.cyclic`` (Choquette-Choo et al. 2023, section 2).
"""

from __future__ import annotations

import numpy as np
import pytest

from dpledger.errors import InvalidParameterError
from dpledger.mechanisms.correlated import (
    CorrelatedNoiseSpec,
    ParticipationSchema,
    optimize_banded_toeplitz,
    optimize_blt,
    tree_factorization,
)
from dpledger.mechanisms.correlated.release import release_event
from dpledger.mechanisms.correlated.spec import NoiseStrategy


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"strategy": "tree"}, lambda: tree_factorization(12)),
        ({"strategy": "tree_honaker"}, lambda: tree_factorization(12, honaker=True)),
        (
            {"strategy": "bandmf", "bands": 3},
            lambda: optimize_banded_toeplitz(num_steps=12, bands=3),
        ),
        ({"strategy": "blt", "buffers": 2}, lambda: optimize_blt(num_steps=12, buffers=2)),
    ],
)
def test_the_factorization_is_the_named_strategys(kwargs: dict[str, object], expected) -> None:  # type: ignore[no-untyped-def]
    spec = CorrelatedNoiseSpec(num_steps=12, period=4, **kwargs)  # type: ignore[arg-type]
    fact, ref = spec.factorization(), expected()
    assert fact.kind == ref.kind
    assert fact.strategy_hash == ref.strategy_hash
    assert spec.schema() == ParticipationSchema.cyclic(num_steps=12, period=4)
    assert isinstance(spec.strategy, NoiseStrategy)


def test_the_scheme_draws_what_the_spec_asks_and_its_participation_is_recorded() -> None:
    spec = CorrelatedNoiseSpec(
        strategy="bandmf",
        num_steps=12,
        period=4,
        bands=4,
        amplified=True,
        sampling_probability=0.5,
    )
    scheme = spec.scheme(population_size=40, seed=3)
    assert spec.matches(scheme)
    schema, q = scheme.participation()
    assert schema == spec.schema() and q == 0.5
    event = release_event(
        spec.factorization(), schema, l2_norm_bound=1.0, noise_stddev=1.0, sampling_probability=q
    )
    assert event.sampling == "poisson_within_bands"
    plain = CorrelatedNoiseSpec(strategy="tree", num_steps=12, period=4)
    assert not plain.matches(scheme)
    whole = plain.scheme(population_size=40, seed=3)
    assert plain.matches(whole) and whole.sampling_probability is None
    assert np.array_equal(whole.draw(5), whole.group(1))
    assert spec.describe() == "bandmf(bands=4, T=12, period=4, q=0.5)"
    assert plain.describe() == "tree(T=12, period=4)"


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"strategy": "fft", "num_steps": 4, "period": 2}, "strategy"),
        ({"strategy": "tree", "num_steps": 0, "period": 1}, "num_steps"),
        ({"strategy": "tree", "num_steps": 4, "period": 5}, "period"),
        ({"strategy": "tree", "num_steps": 4, "period": 2, "bands": 2}, "bands"),
        ({"strategy": "bandmf", "num_steps": 4, "period": 2}, "bands"),
        ({"strategy": "bandmf", "num_steps": 4, "period": 2, "bands": 5}, "bands"),
        ({"strategy": "blt", "num_steps": 4, "period": 2}, "buffers"),
        ({"strategy": "tree", "num_steps": 4, "period": 2, "buffers": 1}, "buffers"),
        ({"strategy": "tree", "num_steps": 4, "period": 2, "amplified": 1}, "amplified"),
        (
            {
                "strategy": "tree",
                "num_steps": 4,
                "period": 2,
                "amplified": True,
                "sampling_probability": 0.5,
            },
            "amplified",
        ),
        (
            {
                "strategy": "bandmf",
                "num_steps": 8,
                "period": 2,
                "bands": 3,
                "amplified": True,
                "sampling_probability": 0.5,
            },
            "bands",
        ),
        (
            {"strategy": "bandmf", "num_steps": 8, "period": 2, "bands": 2, "amplified": True},
            "sampling_probability",
        ),
        (
            {
                "strategy": "bandmf",
                "num_steps": 8,
                "period": 2,
                "bands": 2,
                "sampling_probability": 0.5,
            },
            "sampling_probability",
        ),
        (
            {
                "strategy": "bandmf",
                "num_steps": 8,
                "period": 2,
                "bands": 2,
                "amplified": True,
                "sampling_probability": 1.5,
            },
            "sampling_probability",
        ),
    ],
)
def test_bad_specs_are_refused_by_name(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(InvalidParameterError, match=name):
        CorrelatedNoiseSpec(**kwargs)  # type: ignore[arg-type]
