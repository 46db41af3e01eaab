"""Integers beyond the float64 range get typed errors where they meet float arithmetic.

A count (a population n, a batch size |R|, a stream length T) that Python holds exactly but
float64 cannot raises ``OverflowError`` as soon as it meets a float (q·n, |R|·S, 8·T² bytes).
Every such entry point refuses it with :class:`InvalidParameterError` (or the budget error of
the correlated factorizations) naming the parameter; counts within the range still give the
right number, checked against an exact rational computation (``fractions.Fraction``).
"""

from __future__ import annotations

import math
import sys
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpledger import PrivacyLedger
from dpledger.errors import ComputationBudgetError, InvalidParameterError
from dpledger.mechanisms import GaussianSumQuery
from dpledger.mechanisms.averaging import fixed_denominator_average, realised_batch_average
from dpledger.mechanisms.correlated import (
    CorrelatedNoiseSpec,
    optimize_banded_toeplitz,
    tree_factorization,
)
from dpledger.mechanisms.correlated.rebuild import strategy_matrix
from dpledger.mechanisms.correlated.strategies import (
    banded_toeplitz_factorization,
    blt_factorization,
    tree_nodes,
)
from dpledger.sampling import CyclicScheme
from dpledger.validation import FLOAT_INT_MAX

HUGE = st.integers(min_value=FLOAT_INT_MAX + 1, max_value=10**1000)
IN_RANGE = st.integers(min_value=1, max_value=FLOAT_INT_MAX)
Q = st.floats(min_value=1e-300, max_value=1.0)


def test_the_limit_is_the_largest_integer_float64_holds() -> None:
    assert float(FLOAT_INT_MAX) == sys.float_info.max
    with pytest.raises(OverflowError):
        float(FLOAT_INT_MAX + 2**970)  # what the validators keep from the arithmetic


@settings(max_examples=100, deadline=None)
@given(n=HUGE, q=Q)
def test_fixed_denominator_average_refuses_a_population_beyond_float64(n: int, q: float) -> None:
    with pytest.raises(InvalidParameterError, match="population_size") as info:
        fixed_denominator_average(np.ones(3), sampling_probability=q, population_size=n)
    assert info.value.parameter == "population_size" and "float64" in info.value.expected


@settings(max_examples=200, deadline=None)
@given(n=IN_RANGE, q=Q, x=st.floats(min_value=-1e6, max_value=1e6))
def test_fixed_denominator_average_within_range_is_x_over_qn(n: int, q: float, x: float) -> None:
    """Reference: x/(q·n) in exact rational arithmetic, rounded; the implementation's float
    product and reciprocal are within a few ulps of it (absolutely, where it is subnormal)."""
    exact = Fraction(x) / (Fraction(q) * n)  # q >= 1e-300: 1/(q·n) <= 1e300 stays finite
    (got,) = fixed_denominator_average(np.array([x]), sampling_probability=q, population_size=n)
    assert math.isfinite(float(got[0]))
    assert float(got[0]) == pytest.approx(float(exact), rel=1e-15, abs=1e-300)


@pytest.mark.parametrize("q", [5e-324, 1e-310])
def test_a_denominator_whose_reciprocal_overflows_is_refused(q: float) -> None:
    """q·n = 5e-324: 1/(q·n) is ∞ in float64, and the "average" would be ∞ (or NaN for 0)."""
    with pytest.raises(InvalidParameterError, match="finite reciprocal"):
        fixed_denominator_average(np.ones(2), sampling_probability=q, population_size=1)
    with pytest.raises(InvalidParameterError, match="finite reciprocal"):
        fixed_denominator_average(np.ones(2), denominator=q)


@settings(max_examples=100, deadline=None)
@given(b=HUGE)
def test_realised_batch_average_refuses_a_batch_size_beyond_float64(b: int) -> None:
    with pytest.raises(InvalidParameterError, match="batch_size"):
        realised_batch_average(np.ones(3), batch_size=b)


@settings(max_examples=50, deadline=None)
@given(r=HUGE)
def test_a_sum_query_refuses_a_record_count_beyond_float64(r: int) -> None:
    """|R| meets S in the sensitivity check |R|·S."""
    ledger = PrivacyLedger()
    ledger.record_sample(sampling_probability=0.5, population_size=10)
    query = GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=1.0)
    with pytest.raises(InvalidParameterError, match="num_records"):
        query.release([np.ones(3)], num_records=r, ledger=ledger, generator=None)
    assert ledger.num_events == 1  # nothing recorded


@settings(max_examples=30, deadline=2000)
@given(t=st.integers(min_value=10**7, max_value=10**1000))
def test_correlated_constructors_refuse_huge_streams_with_the_budget_error(t: int) -> None:
    """A stream of T steps needs dense T×T matrices: refused up front, naming num_steps, for T
    within and beyond the float64 range (the estimate is computed in integers), before any
    allocation or loop over the steps (the deadline)."""
    calls = [
        lambda: tree_factorization(t),
        lambda: tree_factorization(t, honaker=True),
        lambda: tree_nodes(t),
        lambda: banded_toeplitz_factorization(t, [1.0, 0.5]),
        lambda: blt_factorization(t, omega=[0.1], theta=[0.5]),
        lambda: optimize_banded_toeplitz(num_steps=t, bands=2),
        lambda: CorrelatedNoiseSpec(strategy="tree", num_steps=t, period=2).factorization(),
        lambda: strategy_matrix("tree", {"num_steps": t}),
    ]
    for call in calls:
        with pytest.raises(ComputationBudgetError) as info:
            call()
        assert info.value.parameter == "num_steps"
        assert info.value.estimated_bytes > info.value.budget_bytes


@settings(max_examples=30, deadline=None)
@given(n=st.integers(min_value=2**33 + 1, max_value=10**1000))
def test_a_cyclic_scheme_refuses_a_population_it_cannot_draw(n: int) -> None:
    with pytest.raises(InvalidParameterError, match="population_size"):
        CyclicScheme(population_size=n, period=2, num_steps=4, seed=0)
