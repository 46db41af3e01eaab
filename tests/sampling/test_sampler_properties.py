"""scheme_property: a sampler's property is its scheme's, value and docstring."""

from __future__ import annotations

import pytest

from dpledger.sampling import PoissonScheme, ShuffleScheme
from dpledger.sampling.sampler_properties import scheme_property


class _Sampler:
    def __init__(self, scheme: object) -> None:
        self._scheme = scheme

    batch_size = scheme_property(ShuffleScheme.batch_size)
    drop_last = scheme_property(ShuffleScheme.drop_last)
    expected_batch_size = scheme_property(PoissonScheme.expected_batch_size)


def test_the_property_reads_the_schemes_value_and_keeps_its_docstring() -> None:
    """Reference: the scheme's own property on the same scheme object."""
    scheme = ShuffleScheme(population_size=10, batch_size=5, drop_last=True)
    sampler = _Sampler(scheme)
    assert sampler.batch_size == scheme.batch_size == 5
    assert sampler.drop_last is scheme.drop_last is True
    assert _Sampler.batch_size.__doc__ == ShuffleScheme.batch_size.__doc__
    poisson = _Sampler(PoissonScheme(population_size=40, sampling_probability=0.25))
    assert poisson.expected_batch_size == 0.25 * 40


def test_the_property_is_read_only() -> None:
    sampler = _Sampler(ShuffleScheme(population_size=10, batch_size=5))
    with pytest.raises(AttributeError):
        sampler.batch_size = 3  # type: ignore[misc]


def test_a_non_property_is_refused() -> None:
    with pytest.raises(TypeError, match="readable property"):
        scheme_property(lambda self: 1)  # type: ignore[arg-type]
