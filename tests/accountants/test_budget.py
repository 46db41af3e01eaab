"""Budgets and typed errors for extreme inputs: refusals before work, labelled fallbacks."""

from __future__ import annotations

import math
import time

import pytest

from dpledger.accountants import (
    GdpAccountant,
    PldAccountant,
    PrvAccountant,
    ResultKind,
    calibrate_noise_multiplier,
)
from dpledger.accountants.base import DEFAULT_MAX_CURVE_POINTS
from dpledger.accountants.budget import (
    DEFAULT_MEMORY_BUDGET,
    DEFAULT_TIME_BUDGET_S,
    check_memory_budget,
    check_time_budget,
    composed_points,
    subsampled_loss_width,
)
from dpledger.accountants.prv import accountant as prv_accountant_module
from dpledger.accountants.prv.accountant import PrvNumericalError
from dpledger.errors import (
    AccountingNumericalError,
    ComputationBudgetError,
    DPLedgerError,
    InvalidParameterError,
    describe_value,
    format_bytes,
)
from dpledger.ledger.steps import MAX_RUN_COUNT, CompressedLedger
from dpledger.validation import check_positive_finite

DELTA = 1e-5


def _ledger(*runs: tuple[float, float, int]) -> CompressedLedger:
    return CompressedLedger.from_runs(list(runs))


def test_default_budgets_are_documented_values() -> None:
    assert DEFAULT_MEMORY_BUDGET == 256 * 2**20 < 2**30
    assert DEFAULT_TIME_BUDGET_S == 60.0
    assert DEFAULT_MAX_CURVE_POINTS == 10_000


@pytest.mark.parametrize(
    "value", [0, 2**20 - 1, 1.5e9, True, None, "1", pytest.param(-(10**5000), id="minus-huge")]
)
def test_bad_memory_budget_is_refused(value: object) -> None:
    with pytest.raises(InvalidParameterError, match="memory_budget"):
        check_memory_budget(value)


@pytest.mark.parametrize(
    "value", [0, -1.0, math.inf, math.nan, True, pytest.param(10**400, id="10**400")]
)
def test_bad_time_budget_is_refused(value: object) -> None:
    with pytest.raises(InvalidParameterError, match="time_budget_s"):
        check_time_budget(value)


def test_single_step_grid_estimate_matches_dp_accounting() -> None:
    # dp-accounting's PLD of (q=1, z=0.1) at interval 1e-4 has 2,949,097 points; of
    # (q=0.004, z=1.1) 37,787 (measured): the estimate is within 10% of both.
    assert composed_points(1.0, 0.1, 1.0, 1e-4)[0] == pytest.approx(2_949_097, rel=0.1)
    assert composed_points(0.004, 1.1, 1.0, 1e-4)[0] == pytest.approx(37_787, rel=0.1)


def test_loss_width_never_overflows() -> None:
    assert subsampled_loss_width(1e-300, 1e-150) > 0.0
    assert subsampled_loss_width(0.5, 5e-324) == math.inf
    assert math.isfinite(subsampled_loss_width(5e-324, 1e300))


def test_pld_refuses_a_tiny_noise_multiplier_before_allocating() -> None:
    # at z = 1e-6 one step needs ~5e15 grid points (35 PiB)
    start = time.perf_counter()
    with pytest.raises(ComputationBudgetError, match="value_discretization_interval") as info:
        PldAccountant().epsilon(_ledger((0.01, 1e-6, 100)), delta=DELTA)
    assert time.perf_counter() - start < 1.0
    err = info.value
    assert err.estimated_bytes > DEFAULT_MEMORY_BUDGET == err.budget_bytes
    assert "rdp accountant" in str(err)
    assert isinstance(err, DPLedgerError) and isinstance(err, ValueError)


def test_pld_refusal_names_an_interval_that_then_fits() -> None:
    ledger = _ledger((0.5, 0.3, 1000))
    with pytest.raises(ComputationBudgetError) as info:
        PldAccountant().epsilon(ledger, delta=DELTA)
    suggested = float(str(info.value).split("value_discretization_interval=")[2].split(")")[0])
    assert 1e-4 < suggested <= 0.05
    result = PldAccountant(value_discretization_interval=suggested).epsilon(ledger, delta=DELTA)
    assert result.kind is ResultKind.UPPER_BOUND and math.isfinite(result.epsilon)


def test_pld_memory_budget_is_overridable() -> None:
    ledger = _ledger((0.01, 1.0, 100))
    assert PldAccountant(value_discretization_interval=1e-3).epsilon(ledger, delta=DELTA)
    with pytest.raises(ComputationBudgetError, match="memory budget 1 MiB"):
        PldAccountant(value_discretization_interval=1e-5, memory_budget=2**20).epsilon(
            ledger, delta=DELTA
        )


def test_pld_time_budget_refuses_up_front() -> None:
    with pytest.raises(ComputationBudgetError, match=r"time budget 0\.001 s"):
        PldAccountant(time_budget_s=1e-3).epsilon(_ledger((0.01, 1.0, 1000)), delta=DELTA)


def test_pld_clamps_extreme_but_harmless_values_conservatively() -> None:
    # q = 5e-324 is raised to 1e-12 and z = 1e300 lowered to 1e4: both only raise ε
    tiny_q = PldAccountant(value_discretization_interval=1e-3).epsilon(
        _ledger((5e-324, 1.0, 10)), delta=DELTA
    )
    huge_z = PldAccountant(value_discretization_interval=1e-3).epsilon(
        _ledger((0.01, 1e300, 10)), delta=DELTA
    )
    for result in (tiny_q, huge_z):
        assert result.kind is ResultKind.UPPER_BOUND
        assert 0.0 <= result.epsilon < 0.1


def test_pld_huge_step_counts_are_refused_not_overflowed() -> None:
    for count in (10**24, MAX_RUN_COUNT):
        with pytest.raises(ComputationBudgetError):
            PldAccountant().epsilon(_ledger((0.01, 1.0, count)), delta=DELTA)


def test_step_counts_beyond_the_ledgers_limit_are_refused_when_the_ledger_is_built() -> None:
    for count in (MAX_RUN_COUNT + 1, 10**1000):
        with pytest.raises(InvalidParameterError, match="count"):
            _ledger((0.01, 1.0, count))


def test_prv_falls_back_to_rdp_with_a_label_when_the_grid_does_not_fit() -> None:
    result = PrvAccountant().epsilon(_ledger((0.01, 1e-6, 100)), delta=DELTA)
    assert result.kind is ResultKind.UPPER_BOUND
    assert result.details["method"] == "rdp_fallback"
    assert result.lower is None
    assert any("memory_budget" in w for w in result.warnings)


def test_prv_delta_query_that_does_not_fit_raises_naming_the_settings() -> None:
    with pytest.raises(PrvNumericalError, match=r"memory_budget.*eps_error.*rdp accountant"):
        PrvAccountant().delta(_ledger((0.01, 1e-6, 100)), epsilon=1.0)


def test_prv_tiny_delta_falls_back_with_a_label() -> None:
    result = PrvAccountant().epsilon(_ledger((0.01, 1.0, 100)), delta=1e-320)
    assert result.details["method"] == "rdp_fallback"
    assert "1e-320" in result.warnings[0]


def test_prv_time_budget_falls_back() -> None:
    result = PrvAccountant(time_budget_s=1e-9).epsilon(_ledger((0.01, 1.0, 100)), delta=DELTA)
    assert result.details["method"] == "rdp_fallback"
    assert "time_budget_s" in result.warnings[0]


@pytest.mark.parametrize("count", [10**24, MAX_RUN_COUNT], ids=["1e24", "2**128"])
def test_gdp_handles_step_counts_beyond_int64(count: int) -> None:
    full = GdpAccountant().epsilon(_ledger((1.0, 1.0, count)), delta=DELTA)
    assert full.epsilon == math.inf or full.epsilon > 1e11
    sub = GdpAccountant(lower_bound=False).epsilon(_ledger((1e-13, 1e3, count)), delta=DELTA)
    assert sub.epsilon >= 0.0 and not math.isnan(sub.epsilon)


def test_gdp_clt_term_is_not_zero_times_infinity() -> None:
    # q² underflows to 0 and e^{1/z²} overflows: μ² = exp(2 log q + 1/z²) = ∞, not NaN
    result = GdpAccountant(lower_bound=False).epsilon(_ledger((1e-300, 1e-3, 10)), delta=DELTA)
    assert result.epsilon == math.inf


def test_untyped_numerical_failures_become_typed(monkeypatch: pytest.MonkeyPatch) -> None:
    # PRV cannot discretise z = 5e-324: refused before any grid is built, naming the budget
    with pytest.raises(PrvNumericalError, match=r"memory_budget"):
        PrvAccountant().delta(_ledger((0.01, 5e-324, 10)), epsilon=1.0)

    # an untyped failure inside the computation: a typed error naming the accountant and ledger
    def overflowing(*_args: object, **_kwargs: object) -> None:
        raise FloatingPointError("overflow encountered")

    monkeypatch.setattr(prv_accountant_module, "discretise_steps", overflowing)
    with pytest.raises(AccountingNumericalError, match=r"prv accountant.*z=0\.5.*overflow"):
        PrvAccountant().delta(_ledger((0.01, 0.5, 10)), epsilon=1.0)


def test_keyboard_interrupt_propagates(monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*_args: object) -> None:
        raise KeyboardInterrupt

    acc = PldAccountant()
    monkeypatch.setattr(acc, "_epsilon", interrupted)
    with pytest.raises(KeyboardInterrupt):
        acc.epsilon(_ledger((0.01, 1.0, 10)), delta=DELTA)


def test_curve_length_is_bounded_before_any_work() -> None:
    ledger = _ledger((0.01, 1.0, 10))
    acc = GdpAccountant()
    for steps in (range(10**21), iter(range(10**21)), [1] * (DEFAULT_MAX_CURVE_POINTS + 1)):
        with pytest.raises(InvalidParameterError, match="max_curve_points"):
            acc.epsilon_curve(ledger, delta=DELTA, steps=steps)
    assert len(acc.epsilon_curve(ledger, delta=DELTA, steps=[1, 2], max_curve_points=2)) == 2
    with pytest.raises(InvalidParameterError, match="max_curve_points"):
        acc.epsilon_curve(ledger, delta=DELTA, steps=[1], max_curve_points=0)


def test_epsilon_beyond_the_float_range_means_infinity() -> None:
    result = GdpAccountant().delta(_ledger((0.01, 1.0, 10)), epsilon=10**400)
    assert result.delta == 0.0 and result.epsilon == math.inf


def test_calibration_time_budget() -> None:
    with pytest.raises(ComputationBudgetError, match="time_budget_s"):
        calibrate_noise_multiplier(
            target_epsilon=1.0,
            delta=DELTA,
            sampling_probability=0.01,
            steps=100,
            time_budget_s=1e-9,
        )


def test_huge_ints_are_described_not_printed() -> None:
    huge = 10**5000
    assert describe_value(huge) == "<an integer of 16610 bits, about 2**16609>"
    assert describe_value(-huge).startswith("-<an integer")
    assert describe_value(0.1) == "0.1" and describe_value(5e-324) == "5e-324"
    with pytest.raises(InvalidParameterError, match="16610 bits"):
        check_positive_finite("noise_stddev", huge)
    assert format_bytes(35.5 * 2**50) == "35.5 PiB"
    assert format_bytes(math.inf) == "unboundedly much memory"


def test_messages_never_round_a_nonzero_value_to_zero() -> None:
    with pytest.raises(ComputationBudgetError) as info:
        PldAccountant(value_discretization_interval=5e-324).epsilon(
            _ledger((0.01, 1.0, 10)), delta=DELTA
        )
    assert "5e-324" in str(info.value)


def test_prv_curve_over_many_points_and_distinct_steps_is_refused_up_front() -> None:
    ledger = _ledger(*[(0.01, 1.0 + i * 1e-3, 2) for i in range(5000)])
    start = time.perf_counter()
    with pytest.raises(ComputationBudgetError, match="bucketing=1e-3"):
        PrvAccountant().epsilon_curve(ledger, delta=DELTA, steps=range(1, 10_001))
    assert time.perf_counter() - start < 5.0


def test_pld_curve_work_counts_every_point() -> None:
    ledger = _ledger((0.01, 1.0, 10_000))
    with pytest.raises(ComputationBudgetError, match=r"time budget 60 s"):
        PldAccountant().epsilon_curve(ledger, delta=DELTA, steps=range(1, 10_001))


def test_pld_sparse_distribution_with_a_huge_count_finishes() -> None:
    # one step's PLD has few points at interval 0.1 (dp-accounting keeps it sparse and would
    # loop 10**12 times); repeated squaring takes about 80 compositions
    start = time.perf_counter()
    result = PldAccountant(value_discretization_interval=0.1).epsilon(
        _ledger((0.0006848740532740592, 19.496203333351218, 10**12)), delta=DELTA
    )
    assert time.perf_counter() - start < 10.0
    assert result.kind is ResultKind.UPPER_BOUND and result.epsilon >= 0.0


def test_repeated_squaring_agrees_with_dp_accountings_loop() -> None:
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    from dpledger.accountants.pld_composition import SPARSE_LOOP_LIMIT, self_compose

    base = pld_lib.from_gaussian_mechanism(
        standard_deviation=50.0, sampling_prob=1e-3, value_discretization_interval=0.1
    )
    count = SPARSE_LOOP_LIMIT + 1
    ours, operations = self_compose(base, count)
    assert operations <= 2 * count.bit_length()
    theirs = base.self_compose(count)
    # the same discrete convolution; pessimistic truncation only moves mass to larger losses,
    # so ours (more compositions, each truncating) is never below dp-accounting's loop, which
    # truncates once (at most 1e-15 from each tail), up to float rounding
    for eps in (0.0, 0.5, 1.0):
        assert ours.get_delta_for_epsilon(eps) >= (
            theirs.get_delta_for_epsilon(eps) * (1 - 1e-12) - 2e-15
        )


@pytest.mark.slow
def test_gdp_lower_bound_shares_one_time_budget_and_counts_the_gaussian_part() -> None:
    # μ of the full-batch part is ~2450: its optimistic PLD would need ~6e8 grid points
    ledger = _ledger((1.0, 0.4083238960253006, 10**6), (0.5, 2.271342784009953, 2686))
    start = time.perf_counter()
    result = GdpAccountant(time_budget_s=2.0).epsilon(ledger, delta=DELTA)
    assert time.perf_counter() - start < 2.0 + 2.0  # the budget plus one bounded step
    assert result.kind is ResultKind.APPROXIMATION and result.lower is None
    assert "grid points" in result.details["lower_bound_skipped"]
