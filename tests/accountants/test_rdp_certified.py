"""The RDP accountant's log-moments are certified upper bounds (checked against 50 digits).

Reference: :mod:`tests.accountants.moment_oracle` integrates the Poisson-subsampled Gaussian's
moment numerically with mpmath at 50 digits (no series), and sums integer orders exactly. The
accountant must never be below it (a valid upper bound after rounding and truncation), and must
be close to it (tight: the bounds it adds are a few ulp of the terms, not a fudge factor).
"""

from __future__ import annotations

import itertools
import math

import mpmath as mp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpledger.accountants import calibrate_sampling_probability
from dpledger.accountants.rdp import RdpAccountant, log_moments
from dpledger.accountants.rdp_moments import fractional_log_moments, integer_log_moments
from dpledger.ledger.steps import CompressedLedger
from tests.accountants.moment_oracle import log_moment, log_moment_integer

# The cases the soundness review measured below the exact moment (q ≈ 3.6e-7 … 1e-6, z = 1.1,
# α = 1.1, 1.5, 2.5) and 6% above it (q = 0.01, α = 1.1) are on this grid.
GRID_Q = (1e-10, 3.6e-7, 1e-6, 1e-4, 0.01, 0.5, 0.999)
GRID_Z = (0.1, 1.1, 1e3)
GRID_FRACTIONAL = (1.1, 1.5, 2.5, 17.5, 255.5)
GRID_INTEGER = (2, 3, 64, 256)
# Tightness: the added rounding bounds are ≲ 10⁻¹⁰ relative on this grid except where A − 1 is
# summed as A (q > 0.45 with large z, ~10⁻⁷); 10⁻⁶ leaves room without hiding a loose bound.
TIGHT = 1e-6


def _truncation_allowance(q: float, z: float, alpha: float) -> mp.mpf:
    """The most the alternating-series bound can exceed the sum after the terms summed: one
    omitted term, |C(α, 1024)|·(I_k + J_k) ≤ |C(α, 1024)|·(I₀ + J₀) (I_k, J_k non-increasing)."""
    qm, zm, am = mp.mpf(q), mp.mpf(z), mp.mpf(alpha)
    first = (1 - qm) ** am + qm**am * mp.exp((am * am - am) / (2 * zm * zm))
    return abs(mp.binomial(am, 1024)) * first


@pytest.mark.slow
def test_oracle_integration_equals_exact_integer_sums() -> None:
    for q, z, alpha in [(1e-6, 1.1, 2), (0.3, 3.0, 256), (0.01, 0.1, 64), (0.999, 1e3, 3)]:
        integrated = log_moment(q, z, float(alpha))
        exact = log_moment_integer(q, z, alpha)
        # quad controls absolute error at the integrand's O(1) scale: ~1e-50, or 1e-39 relative
        # to the smallest moment here, far below float64's 1e-16
        assert abs(integrated - exact) <= mp.mpf(10) ** -30 * abs(exact)


@pytest.mark.slow
@pytest.mark.parametrize(("q", "z"), list(itertools.product(GRID_Q, GRID_Z)))
def test_fractional_orders_are_certified_and_tight(q: float, z: float) -> None:
    alphas = np.asarray(GRID_FRACTIONAL)
    ours = fractional_log_moments(np.full(alphas.size, q), np.full(alphas.size, z), alphas)
    for alpha, value in zip(alphas.tolist(), ours.tolist(), strict=True):
        exact = log_moment(q, z, alpha)
        assert mp.mpf(value) >= exact, (q, z, alpha, value, float(exact))
        allowed = exact * TIGHT + _truncation_allowance(q, z, alpha)
        assert mp.mpf(value) - exact <= allowed, (q, z, alpha, value, float(exact))


@pytest.mark.parametrize(("q", "z"), list(itertools.product(GRID_Q, GRID_Z)))
def test_integer_orders_are_certified_and_tight(q: float, z: float) -> None:
    for alpha in GRID_INTEGER:
        value = float(integer_log_moments(np.array([q]), np.array([z]), alpha)[0])
        exact = log_moment_integer(q, z, alpha)
        assert mp.mpf(value) >= exact, (q, z, alpha, value, float(exact))
        # the added rounding bound: C·u·(α·|log q| + log-binomials) ≤ 8·2.2e-16·(256·24 + 2000)
        # ≈ 1.4e-11 relative on this grid
        assert mp.mpf(value) <= exact * (1 + 1e-10), (q, z, alpha, value, float(exact))


@pytest.mark.slow
def test_no_order_is_left_out_for_not_converging() -> None:
    # q = 0.5, z = 0.5: dp-accounting's series (and this accountant's before) did not converge
    # within 1000 terms at the smallest fractional orders and left them out; the alternating-series
    # bound gives a valid value at any number of terms.
    values = log_moments([0.5, 0.1], [0.5, 0.5], [1.1, 1.5, 1.6])
    assert np.isfinite(values).all()
    exact = log_moment(0.1, 0.5, 1.5)
    assert exact <= mp.mpf(float(values[1, 1])) <= exact * (1 + TIGHT)


def test_extreme_noise_gives_a_bound_not_nan() -> None:
    q = np.array([0.01, 0.01, 5e-324, 0.999999])
    z = np.array([1e-200, 1e300, 1.0, 1e-3])
    for alpha in (1.5, 255.5):
        values = fractional_log_moments(q, z, np.full(4, alpha))
        assert not np.isnan(values).any()
        assert values[0] == math.inf and values[1] > 0.0 and values[2] > 0.0
    for alpha in (2, 256):
        values = integer_log_moments(q, z, alpha)
        assert not np.isnan(values).any()
        assert values[0] == math.inf and values[1] > 0.0 and values[2] > 0.0


def _epsilon(q: float, z: float, t: int, delta: float = 1e-5) -> float:
    ledger = CompressedLedger.from_runs([(q, z, t)])
    return RdpAccountant().epsilon(ledger, delta=delta).epsilon


@settings(max_examples=60, deadline=None)
@given(
    q=st.floats(min_value=1e-10, max_value=1.0),
    z=st.floats(min_value=0.1, max_value=1e3),
    t=st.integers(min_value=1, max_value=10**6),
    factor=st.floats(min_value=1.0 + 1e-6, max_value=4.0),
)
@pytest.mark.slow
def test_epsilon_is_monotone_in_q_steps_and_noise(
    q: float, z: float, t: int, factor: float
) -> None:
    base = _epsilon(q, z, t)
    assert base >= 0.0 and not math.isnan(base)
    assert _epsilon(min(1.0, q * factor), z, t) >= base
    assert _epsilon(q, z, t + max(1, int(t * (factor - 1.0)))) >= base
    assert _epsilon(q, z * factor, t) <= base


@settings(max_examples=30, deadline=None)
@given(q=st.floats(min_value=1e-10, max_value=1e-5), factor=st.floats(1.0 + 1e-9, 2.0))
def test_epsilon_is_monotone_in_tiny_q(q: float, factor: float) -> None:
    # where the old series lost the digits of A − 1 and ε dipped as q grew
    assert _epsilon(q * factor, 1.1, 10**7, 1e-5) >= _epsilon(q, 1.1, 10**7, 1e-5)


def test_calibrated_sampling_probability_meets_the_target_and_is_largest() -> None:
    result = calibrate_sampling_probability(
        target_epsilon=0.05,
        delta=1e-5,
        noise_multiplier=1.1,
        steps=10**6,
        bracket=(1e-9, 1.0),
        accountant="rdp",
    )
    q = result.value
    assert _epsilon(q, 1.1, 10**6) <= 0.05
    assert _epsilon(q * 1.002, 1.1, 10**6) > 0.05
