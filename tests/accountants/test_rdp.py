"""RDP accountant: equal to dp-accounting's RdpAccountant at integer orders, published values,
replace-one, inputs.

At integer orders both compute the same finite sum, so they must agree. At fractional orders
they differ on purpose: dp-accounting's series can be several percent above or below the exact
moment, while ours is a certified upper bound within ~1e-10 of it; that is checked against a
50-digit integration in ``test_rdp_certified.py``.
"""

from __future__ import annotations

import functools
import logging
import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant as dp_rdp
from hypothesis import given, settings
from hypothesis import strategies as st

from dpledger.accountants.rdp import (
    DEFAULT_ORDERS,
    RdpAccountant,
    delta_from_rdp,
    epsilon_from_rdp,
    log_moments,
)
from dpledger.errors import InvalidParameterError, UnsupportedLedgerError
from dpledger.ledger.dp_event import compressed_to_dp_event
from dpledger.ledger.steps import CompressedLedger

DELTA = 1e-5
GRID_Q = (1e-4, 1e-3, 1e-2, 0.1, 0.5, 0.99, 1.0)
GRID_Z = (0.5, 0.8, 1.0, 2.0, 5.0, 10.0)
GRID_T = (1, 100, 10_000, 100_000)
INTEGER_ORDERS = [a for a in DEFAULT_ORDERS if a == int(a)]

logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting's non-convergence notes


def _event(q: float, z: float) -> dp_accounting.DpEvent:
    gaussian = dp_accounting.GaussianDpEvent(z)
    return gaussian if q == 1.0 else dp_accounting.PoissonSampledDpEvent(q, gaussian)


@functools.cache
def _oracle_step_rdp(q: float, z: float) -> tuple[float, ...]:
    """dp-accounting's RDP of one step at the integer default orders (its accountant's state)."""
    acc = dp_rdp.RdpAccountant(orders=INTEGER_ORDERS)
    acc.compose(_event(q, z))
    return tuple(float(x) for x in acc._rdp)


def _ledger(q: float, z: float, t: int, neighboring: str = "add_remove") -> CompressedLedger:
    return CompressedLedger.from_runs([(q, z, t)], neighboring=neighboring)


# --------------------------------------------------------------------------- dp-accounting
@pytest.mark.parametrize("q", GRID_Q)
@pytest.mark.parametrize("z", GRID_Z)
def test_equals_dp_accounting_across_the_grid(q: float, z: float) -> None:
    acc = RdpAccountant(orders=INTEGER_ORDERS)
    step = np.asarray(_oracle_step_rdp(q, z))
    orders = np.asarray(INTEGER_ORDERS)
    for t in GRID_T:
        ledger = _ledger(q, z, t)
        ours_orders, ours = acc.rdp(ledger)
        np.testing.assert_array_equal(ours_orders, orders)
        theirs = t * step
        assert np.isfinite(ours).all()
        # rtol 1e-6; atol covers dp-accounting's float64 rounding of log A ≈ 1 + tiny (it sums
        # A, not A − 1: |error| ≲ 1e-15 per step)
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-13 * t)

        eps_theirs, order_theirs = dp_rdp.compute_epsilon(orders, theirs, DELTA)
        result = acc.epsilon(ledger, delta=DELTA)
        assert result.epsilon == pytest.approx(eps_theirs, rel=1e-6, abs=1e-12)
        if eps_theirs > 0:
            assert result.details["optimal_order"] == order_theirs

        delta_theirs, _ = dp_rdp.compute_delta(orders, theirs, 1.0)
        assert acc.delta(ledger, epsilon=1.0).delta == pytest.approx(
            delta_theirs, rel=1e-6, abs=1e-300
        )


def _random_ledger(seed: int, runs: int) -> CompressedLedger:
    rng = np.random.default_rng(seed)
    triples = []
    for _ in range(runs):
        q = float(10 ** rng.uniform(-4, -0.3)) if rng.random() < 0.9 else 1.0
        z = float(rng.uniform(0.6, 6.0))
        triples.append((q, z, int(rng.integers(1, 3000))))
    return CompressedLedger.from_runs(triples)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_equals_dp_accounting_on_heterogeneous_ledgers(seed: int) -> None:
    ledger = _random_ledger(seed, runs=15)
    oracle = dp_rdp.RdpAccountant(orders=INTEGER_ORDERS)
    oracle.compose(compressed_to_dp_event(ledger))
    eps_theirs, order_theirs = oracle.get_epsilon_and_optimal_order(DELTA)
    result = RdpAccountant(orders=INTEGER_ORDERS).epsilon(ledger, delta=DELTA)
    assert result.epsilon == pytest.approx(eps_theirs, rel=1e-6)
    assert result.details["optimal_order"] == order_theirs
    assert result.details["distinct_runs"] == len({k for k in ledger.distinct() if k[0] < 1.0})
    assert oracle.get_delta(2.0) == pytest.approx(
        RdpAccountant(orders=INTEGER_ORDERS).delta(ledger, epsilon=2.0).delta, rel=1e-6
    )


def test_noise_schedule_matches_dp_accounting() -> None:
    z_values = np.linspace(0.8, 2.0, 20)
    ledger = CompressedLedger.from_runs([(0.004, float(z), 100) for z in z_values])
    oracle = dp_rdp.RdpAccountant(orders=INTEGER_ORDERS)
    oracle.compose(compressed_to_dp_event(ledger))
    assert RdpAccountant(orders=INTEGER_ORDERS).epsilon(
        ledger, delta=DELTA
    ).epsilon == pytest.approx(oracle.get_epsilon(DELTA), rel=1e-6)


# --------------------------------------------------------------------------- order search
@pytest.mark.parametrize(
    "triples",
    [
        [(1e-4, 10.0, 1)],  # tiny ε: optimum at the largest orders
        [(0.5, 0.5, 100_000)],  # huge ε: optimum at the smallest order
        [(0.01, 1.0, 1000), (0.05, 0.7, 10), (1.0, 30.0, 5)],
        [(0.004, float(z), 7) for z in np.linspace(0.8, 2.0, 200)],
        [(0.3, 3.0, 1), (1e-3, 0.55, 50_000)],
    ],
)
def test_order_search_finds_the_minimum_over_the_whole_grid(triples: list) -> None:
    ledger = CompressedLedger.from_runs(triples)
    acc = RdpAccountant()
    orders, rdp = acc.rdp(ledger)  # every order computed
    eps_all, order_all = epsilon_from_rdp(orders, rdp, delta=DELTA)
    result = acc.epsilon(ledger, delta=DELTA)
    assert result.epsilon == pytest.approx(eps_all, rel=1e-9, abs=1e-15)
    assert result.details["optimal_order"] == order_all
    assert result.details["orders_evaluated"] <= len(DEFAULT_ORDERS)
    delta_all, _ = delta_from_rdp(orders, rdp, epsilon=0.5)
    assert acc.delta(ledger, epsilon=0.5).delta == pytest.approx(delta_all, rel=1e-9)


def test_custom_orders_are_used_and_reported() -> None:
    acc = RdpAccountant(orders=[32, 2, 8.5])
    assert acc.settings()["orders"] == [2.0, 8.5, 32.0]
    result = acc.epsilon(_ledger(0.01, 1.0, 1000), delta=DELTA)
    assert result.details["optimal_order"] in (2.0, 8.5, 32.0)
    oracle = dp_rdp.RdpAccountant(orders=[2.0, 8.5, 32.0])
    oracle.compose(dp_accounting.SelfComposedDpEvent(_event(0.01, 1.0), 1000))
    assert result.epsilon == pytest.approx(oracle.get_epsilon(DELTA), rel=1e-6)
    assert RdpAccountant().settings()["orders"] == "default"


# --------------------------------------------------------------------------- published value
def test_tensorflow_privacy_published_value() -> None:
    # TF Privacy's check: n = 60000, batch 150, z = 1.3, 15 epochs, δ = 1e-5 → ε ≈ 0.7242 at
    # order 19, with its order list.
    orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
    steps = 15 * 60_000 // 150
    result = RdpAccountant(orders=orders).epsilon(_ledger(150 / 60_000, 1.3, steps), delta=DELTA)
    assert result.epsilon == pytest.approx(0.7242, abs=5e-5)
    assert result.details["optimal_order"] == 19.0


# --------------------------------------------------------------------------- closed forms
@pytest.mark.parametrize("z", [0.3, 1.0, 7.0])
def test_full_batch_is_the_gaussian_closed_form(z: float) -> None:
    orders, rdp = RdpAccountant().rdp(_ledger(1.0, z, 3))
    np.testing.assert_allclose(rdp, 3 * orders / (2 * z * z), rtol=1e-14)


def test_log_moments_function_matches_closed_form_and_accountant() -> None:
    values = log_moments([1.0, 0.02], [2.0, 1.5], [2.0, 2.5])
    assert values[0] == pytest.approx([2.0 * 1.0 / 8.0, 2.5 * 1.5 / 8.0])
    _, rdp = RdpAccountant(orders=[2.0, 2.5]).rdp(_ledger(0.02, 1.5, 1))
    np.testing.assert_allclose(values[1] / np.array([1.0, 1.5]), rdp, rtol=1e-14)


# --------------------------------------------------------------------------- replace-one
def test_replace_one_full_batch_doubles_sensitivity_unlike_dp_accounting_issue_378() -> None:
    acc = RdpAccountant()
    replace = _ledger(1.0, 2.0, 10, neighboring="replace_one")
    orders, rdp = acc.rdp(replace)
    np.testing.assert_allclose(rdp, 10 * 2.0 * orders / 2.0**2, rtol=1e-14)  # 2α/z² per step
    add_remove_half = acc.epsilon(_ledger(1.0, 1.0, 10), delta=DELTA).epsilon
    assert acc.epsilon(replace, delta=DELTA).epsilon == pytest.approx(add_remove_half, rel=1e-12)
    # dp-accounting composes GaussianDpEvent(z) under REPLACE_ONE with sensitivity 1: 4× less RDP
    defect = dp_rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE
    )
    defect.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(2.0), 10))
    assert defect.get_epsilon(DELTA) < 0.6 * add_remove_half


def test_replace_one_subsampled_is_refused() -> None:
    with pytest.raises(UnsupportedLedgerError, match="replace-one"):
        RdpAccountant().epsilon(_ledger(0.01, 1.0, 10, neighboring="replace_one"), delta=DELTA)
    free_and_full = CompressedLedger.from_runs(
        [(0.01, math.inf, 3), (0.0, 1.0, 2), (1.0, 4.0, 1)], neighboring="replace_one"
    )
    assert RdpAccountant().epsilon(free_and_full, delta=DELTA).epsilon > 0


# --------------------------------------------------------------------------- extremes
@pytest.mark.parametrize(
    ("q", "z", "t"), [(0.5, 0.1, 10), (1e-9, 1.0, 10), (0.01, 1e4, 10**6), (0.999999, 0.5, 3)]
)
def test_extreme_parameters_give_finite_non_negative_epsilon(q: float, z: float, t: int) -> None:
    result = RdpAccountant().epsilon(_ledger(q, z, t), delta=DELTA)
    assert math.isfinite(result.epsilon) and result.epsilon >= 0.0
    assert not math.isnan(RdpAccountant().delta(_ledger(q, z, t), epsilon=1.0).delta)


def test_rdp_of_trivial_ledgers() -> None:
    acc = RdpAccountant(orders=[2, 3])
    assert acc.rdp(CompressedLedger())[1].tolist() == [0.0, 0.0]
    assert acc.rdp(_ledger(0.1, 0.0, 1))[1].tolist() == [math.inf, math.inf]


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "orders", [[], [1.0], [0.5, 2], [math.nan], [math.inf], "abc", [True, 2], 5, [2, "x"]]
)
def test_bad_orders_are_rejected(orders: object) -> None:
    with pytest.raises(InvalidParameterError, match="orders"):
        RdpAccountant(orders=orders)  # type: ignore[arg-type]


@pytest.mark.parametrize("bucketing", [0, 1, -0.1, 2.0, True, "1e-3", math.nan])
def test_bad_bucketing_is_rejected(bucketing: object) -> None:
    with pytest.raises(InvalidParameterError, match="bucketing"):
        RdpAccountant(bucketing=bucketing)  # type: ignore[arg-type]


def test_bad_inputs_of_module_functions() -> None:
    with pytest.raises(InvalidParameterError, match="rdp"):
        epsilon_from_rdp([2, 3], [0.1], delta=DELTA)
    with pytest.raises(InvalidParameterError, match="delta"):
        epsilon_from_rdp([2, 3], [0.1, 0.2], delta=0.0)
    with pytest.raises(InvalidParameterError, match="epsilon"):
        delta_from_rdp([2, 3], [0.1, 0.2], epsilon=-1.0)
    with pytest.raises(InvalidParameterError, match="orders"):
        epsilon_from_rdp([], [], delta=DELTA)
    with pytest.raises(InvalidParameterError, match="sampling_probability"):
        log_moments([0.0], [1.0], [2.0])
    with pytest.raises(InvalidParameterError, match="noise_multiplier"):
        log_moments([0.1], [math.inf], [2.0])
    with pytest.raises(InvalidParameterError, match="sampling_probability"):
        log_moments([0.1, 0.2], [1.0], [2.0])


def test_tiny_rdp_is_not_rounded_to_zero_epsilon_for_tiny_delta() -> None:
    # One step with q = 1e-9: RDP ~ 1e-20, below float64 resolution of log A ≈ 1. With δ = 1e-14
    # the KL bound δ ≥ √(1 − e^{−RDP}) cannot certify ε = 0 unless RDP < 1e-28; rounding must not
    # pretend it does.
    result = RdpAccountant().epsilon(_ledger(1e-9, 1.0, 1), delta=1e-14)
    assert result.epsilon > 0.0
    # with δ = 1e-5 the KL bound legitimately gives ε = 0
    assert RdpAccountant().epsilon(_ledger(1e-9, 1.0, 1), delta=1e-5).epsilon == 0.0


@settings(max_examples=40, deadline=None)
@given(
    q=st.floats(min_value=1e-4, max_value=0.05),
    z=st.floats(min_value=0.7, max_value=10.0),
    t=st.integers(min_value=1, max_value=10_000),
)
@pytest.mark.slow
def test_monotone_in_q_z_and_steps(q: float, z: float, t: int) -> None:
    # the full ranges (q down to 1e-10, z from 0.1 to 1e3) are in test_rdp_certified.py
    acc = RdpAccountant()
    base = acc.epsilon(_ledger(q, z, t), delta=DELTA).epsilon
    assert acc.epsilon(_ledger(min(1.0, 1.1 * q), z, t), delta=DELTA).epsilon >= base
    assert acc.epsilon(_ledger(q, 1.1 * z, t), delta=DELTA).epsilon <= base
    assert acc.epsilon(_ledger(q, z, t + 1), delta=DELTA).epsilon >= base


def test_no_order_is_left_out_where_dp_accounting_leaves_orders_out() -> None:
    # dp-accounting's fractional series does not converge within 1000 terms at q = 0.5, z = 0.5
    # for the smallest orders and leaves them out; the alternating-series bound needs no
    # convergence, so every order has a value, and ε no longer dips as q grows (it did, by
    # ~1e-4 relative, when a larger q made an order converge).
    acc = dp_rdp.RdpAccountant(orders=list(DEFAULT_ORDERS))
    acc.compose(_event(0.5, 0.5))
    assert np.isinf(np.asarray(acc._rdp)[:6]).all()
    _, rdp = RdpAccountant().rdp(_ledger(0.5, 0.5, 52))
    assert np.isfinite(rdp).all()
    eps_05 = RdpAccountant().epsilon(_ledger(0.5, 0.5, 52), delta=DELTA).epsilon
    eps_055 = RdpAccountant().epsilon(_ledger(0.55, 0.5, 52), delta=DELTA).epsilon
    assert eps_055 >= eps_05
