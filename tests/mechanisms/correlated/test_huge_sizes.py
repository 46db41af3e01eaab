"""Sizes too large to allocate get typed errors before any allocation.

Each function of the correlated-noise package that allocates from a size the caller gives (T,
the number of BLT buffers, the noise dimension d, the number of bands) estimates its memory in
integers first and refuses with :class:`ComputationBudgetError` naming the parameter and the
limit (1 GiB, ``MAX_MATRIX_BYTES``, for computations over T; the machine's physical memory for a
noise generator's d-vectors), or with :class:`InvalidParameterError` for sizes that can never be
valid. Before, NumPy raised ``ValueError: Maximum allowed dimension exceeded`` or
``MemoryError`` (after trying to allocate terabytes). Reference: tracemalloc's peak stays below
1 MiB for every refusal, so nothing of the size asked for was allocated.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpledger.errors import ComputationBudgetError, InvalidParameterError
from dpledger.mechanisms.correlated import (
    ParticipationSchema,
    noise_for,
    optimize_banded_toeplitz,
    optimize_blt,
    tree_factorization,
)
from dpledger.mechanisms.correlated.noise import BandedNoise
from dpledger.mechanisms.correlated.strategies import (
    MAX_MATRIX_BYTES,
    blt_factorization,
    blt_prefix_error,
    inverse_toeplitz_coefficients,
    prefix_error,
    prefix_sum_workload,
)
from dpledger.sampling.participation import count_patterns

# T from just past the 1 GiB budget of any of these computations to far past int64 and float64
HUGE_T = st.integers(min_value=10**10, max_value=2**1100)
# d past any machine's memory (80 TB of float64 for a single vector) and past int64
HUGE_DIM = st.integers(min_value=10**13, max_value=2**1100)
PEAK = 2**20


def refused(
    call: Callable[[], Any], error: type[Exception] = ComputationBudgetError, limit: int = PEAK
) -> Exception:
    """The typed error ``call`` raises, with tracemalloc's peak checked below ``limit``."""
    tracemalloc.start()
    try:
        with pytest.raises(error) as info:
            call()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < limit, peak
    return info.value


FACTORIZATIONS = {
    "tree": tree_factorization(8),
    "tree_honaker": tree_factorization(8, honaker=True),
    "banded": optimize_banded_toeplitz(num_steps=8, bands=3),
    "blt": blt_factorization(8, omega=[-0.2, 0.1], theta=[0.5, 0.9]),
}


@settings(max_examples=40, deadline=None)
@given(t=HUGE_T)
def test_functions_over_t_refuse_huge_t_before_allocating(t: int) -> None:
    calls = [
        lambda: prefix_sum_workload(t),
        lambda: inverse_toeplitz_coefficients([1.0, -0.5], t),
        lambda: prefix_error([1.0, 0.5], t),
        lambda: blt_prefix_error(omega=[-0.2], theta=[0.5], num_steps=t),
        lambda: count_patterns(
            ParticipationSchema.min_separation_schema(
                num_steps=t, max_participations=2, min_separation=3
            )
        ),
        lambda: ParticipationSchema.cyclic(num_steps=t, period=7).patterns(),
        lambda: ParticipationSchema.single(num_steps=t).patterns(),
    ]
    for call in calls:
        error = refused(call)
        assert error.parameter == "num_steps" and error.value == t
        assert error.budget_bytes == MAX_MATRIX_BYTES and error.estimated_bytes > MAX_MATRIX_BYTES


@settings(max_examples=40, deadline=None)
@given(dim=HUGE_DIM, kind=st.sampled_from(sorted(FACTORIZATIONS)))
def test_noise_generators_refuse_a_huge_dim_before_allocating(dim: int, kind: str) -> None:
    factorization = FACTORIZATIONS[kind]
    error = refused(lambda: noise_for(factorization, dim=dim, noise_stddev=1.0, seed=0))
    assert error.parameter == "dim" and error.value == dim
    assert 0 < error.budget_bytes < error.estimated_bytes
    assert "physical memory" in str(error)


@settings(max_examples=20, deadline=None)
@given(buffers=st.integers(min_value=10**9, max_value=2**1100))
def test_blt_refuses_huge_numbers_of_buffers_before_allocating(buffers: int) -> None:
    error = refused(lambda: optimize_blt(num_steps=8, buffers=buffers))
    assert error.parameter == "buffers" and error.value == buffers


def test_blt_with_many_recorded_buffers_is_refused_before_its_table() -> None:
    """A T × buffers table of 1000 × 10⁵ floats (0.8 GB, twice over for the powers) is over
    the budget: refused, naming omega, before the table is built (the peak is the two
    parameter arrays of 0.8 MB, not the table)."""
    omega, theta = [0.0] * 100_000, [0.5] * 100_000
    limit = 8 * PEAK
    error = refused(lambda: blt_factorization(1000, omega=omega, theta=theta), limit=limit)
    assert error.parameter == "omega" and "per buffer" in str(error)
    error = refused(lambda: blt_prefix_error(omega=omega, theta=theta, num_steps=1000), limit=limit)
    assert error.parameter == "omega"


def test_sizes_that_can_never_work_are_invalid() -> None:
    banded = FACTORIZATIONS["banded"]
    error = refused(
        lambda: BandedNoise(banded, bands=10**15, dim=4, noise_stddev=1.0, seed=0),
        InvalidParameterError,
    )
    assert error.parameter == "bands"
    for coeffs in ([0.0, 1.0], [], [[1.0]], [1.0, float("nan")]):
        with pytest.raises(InvalidParameterError, match="coeffs"):
            inverse_toeplitz_coefficients(coeffs, 5)


def test_sizes_within_the_limits_still_work() -> None:
    """Just inside the budget: the same functions answer (and agree with their definitions)."""
    t = MAX_MATRIX_BYTES // (8 * 6)  # prefix_error holds 6 floats per step
    assert prefix_error([1.0], t) == pytest.approx(t * (t + 1) / 2, rel=1e-9)  # ‖A‖_F²
    assert inverse_toeplitz_coefficients([1.0, -1.0], 5).tolist() == [1.0] * 5
    generator = noise_for(FACTORIZATIONS["blt"], dim=1000, noise_stddev=1.0, seed=0)
    assert generator.next().shape == (1000,)
    assert count_patterns(ParticipationSchema.cyclic(num_steps=10**12, period=7)) == 7
