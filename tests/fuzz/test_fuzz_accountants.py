"""Fuzzing every accountant with extreme legal (and some illegal) inputs.

For every accountant (rdp, prv, gdp, pld) and every question (ε, δ, ε curve, the three
calibrations) the only exceptions allowed to escape are :class:`dpledger.errors.DPLedgerError`
subclasses; every answer is a number (never NaN) with ε ≥ 0 and 0 ≤ δ ≤ 1; and where the
accountant's result is a certified upper bound, ε is non-decreasing in the number of steps T and
in q and non-increasing in z, up to the slack the accountant documents:

* rdp: none (an RDP bound at a fixed order grid is monotone exactly; we allow 1e-12 relative for
  floating-point summation);
* pld: the pessimistic discretisation rounds each step's privacy loss up by less than the
  interval h, so its ε exceeds the true ε by less than (number of subsampled steps)·h: comparing
  two results allows that slack of the one expected to be smaller's competitor;
* prv: the certified interval [lower, upper] contains the true ε, so upper(a) ≤ true(a) + width(a)
  ≤ true(b) + width(a) ≤ upper(b) + width(a): the tolerance is the first result's own
  upper − lower;
* gdp: its μ grows with T and q and shrinks with z and ε(μ) is increasing, so its
  (approximate) ε is monotone too, up to the rounding-up of its root finding (1e-12 relative);
  in q only within one regime (the CLT μ for q < 1 may exceed the exact μ of q = 1).

Accountants run with small memory and time budgets (so that no single example can be slow and
the budget refusals are exercised); each example has a hypothesis deadline.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpledger.accountants import (
    GdpAccountant,
    PldAccountant,
    PrvAccountant,
    RdpAccountant,
    calibrate_noise_multiplier,
    calibrate_sampling_probability,
    calibrate_steps,
)
from dpledger.accountants.base import PrivacyResult, ResultKind
from dpledger.errors import DPLedgerError
from dpledger.ledger.steps import MAX_RUN_COUNT, CompressedLedger

FUZZ_MEMORY = 32 * 2**20
PLD_INTERVAL = 1e-2


def _accountant(name: str) -> Any:
    if name == "rdp":
        return RdpAccountant()
    if name == "prv":
        return PrvAccountant(eps_error=0.1, memory_budget=FUZZ_MEMORY)
    if name == "gdp":
        return GdpAccountant(memory_budget=FUZZ_MEMORY, time_budget_s=2.0)
    return PldAccountant(
        value_discretization_interval=PLD_INTERVAL, memory_budget=FUZZ_MEMORY, time_budget_s=2.0
    )


NAMES = ("rdp", "prv", "gdp", "pld")
ACCOUNTANTS = {name: _accountant(name) for name in NAMES}

EXTREME_Q = [5e-324, 1e-300, 1e-12, 1e-6, 0.5, 1.0 - 1e-16, 1.0]
EXTREME_Z = [5e-324, 1e-300, 1e-6, 0.05, 1e6, 1e300]
EXTREME_T = [1, 2, 10**6, 10**12, 10**24, 10**400]
EXTREME_DELTA = [1e-320, 1e-300, 1e-100, 0.5, 1.0 - 1e-16]
EXTREME_EPS = [0.0, 5e-324, 1e-300, 1e-6, 1e6, 1e300, math.inf, 10**400]

q_values = st.one_of(st.sampled_from(EXTREME_Q), st.floats(1e-6, 1.0))
z_values = st.one_of(st.sampled_from(EXTREME_Z), st.floats(0.3, 50.0))
t_values = st.one_of(st.sampled_from(EXTREME_T), st.integers(1, 5000))
delta_values = st.one_of(st.sampled_from(EXTREME_DELTA), st.floats(1e-12, 0.1))
eps_values = st.one_of(st.sampled_from(EXTREME_EPS), st.floats(0.0, 20.0))
names = st.sampled_from(NAMES)

FUZZ = settings(
    max_examples=60,
    deadline=20_000,
    suppress_health_check=[HealthCheck.too_slow],
)

_COUNTS: dict[str, int] = {}


def _count(test: str) -> None:
    _COUNTS[test] = _COUNTS.get(test, 0) + 1


def _check_result(result: PrivacyResult) -> None:
    for value in (result.epsilon, result.delta, result.lower, result.upper):
        if value is not None:
            assert not math.isnan(value), result
            assert value >= 0.0, result
    assert result.delta <= 1.0, result


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(...)``, or None when it raised a dpledger error (anything else propagates)."""
    try:
        return fn(*args, **kwargs)
    except DPLedgerError:
        return None


def _ledger(*runs: tuple[float, float, int]) -> CompressedLedger:
    return CompressedLedger.from_runs(list(runs))


def _certified(result: PrivacyResult | None) -> bool:
    return (
        result is not None
        and result.kind is ResultKind.UPPER_BOUND
        and math.isfinite(result.epsilon)
        and not result.warnings
    )


def _slack(name: str, smaller: PrivacyResult, larger: PrivacyResult, steps: int) -> float:
    """The documented slack allowed in ε(smaller case) ≤ ε(larger case)."""
    if name == "pld":
        return steps * PLD_INTERVAL + 1e-9
    if name == "prv":
        if smaller.lower is None:  # the RDP fallback: no interval, exact monotonicity
            return 1e-12 * max(1.0, smaller.epsilon)
        return smaller.epsilon - smaller.lower + 1e-12
    return 1e-12 * max(1.0, larger.epsilon)


@pytest.mark.slow
@FUZZ
@given(name=names, q=q_values, z=z_values, t=t_values, delta=delta_values, eps=eps_values)
def test_epsilon_and_delta_are_typed_and_valid(
    name: str, q: float, z: float, t: int, delta: float, eps: float
) -> None:
    _count("epsilon_and_delta")
    acc = ACCOUNTANTS[name]
    ledger = _call(_ledger, (q, z, t))  # a count beyond 2**128 is refused here, typed
    if ledger is None:
        assert t > MAX_RUN_COUNT
        return
    for result in (
        _call(acc.epsilon, ledger, delta=delta),
        _call(acc.delta, ledger, epsilon=eps),
    ):
        if result is not None:
            _check_result(result)


@pytest.mark.slow
@FUZZ
@given(name=names, q=q_values, z=z_values, t=st.integers(1, 400), delta=delta_values)
def test_epsilon_is_monotone_in_steps(name: str, q: float, z: float, t: int, delta: float) -> None:
    _count("monotone_in_steps")
    acc = ACCOUNTANTS[name]
    fewer = _call(acc.epsilon, _ledger((q, z, t)), delta=delta)
    more = _call(acc.epsilon, _ledger((q, z, 2 * t)), delta=delta)
    for r in (fewer, more):
        if r is not None:
            _check_result(r)
    if (_certified(fewer) and _certified(more)) or (name == "gdp" and fewer and more):
        _count("compared:monotone_in_steps")
        assert fewer.epsilon <= more.epsilon + _slack(name, fewer, more, 2 * t), (fewer, more)


@FUZZ
@given(
    name=names,
    q=q_values,
    factor=st.floats(1.0, 1e6),
    z=z_values,
    t=st.integers(1, 400),
    delta=delta_values,
)
@pytest.mark.slow
def test_epsilon_is_monotone_in_q(
    name: str, q: float, factor: float, z: float, t: int, delta: float
) -> None:
    _count("monotone_in_q")
    acc = ACCOUNTANTS[name]
    bigger_q = min(1.0, q * factor)
    low = _call(acc.epsilon, _ledger((q, z, t)), delta=delta)
    high = _call(acc.epsilon, _ledger((bigger_q, z, t)), delta=delta)
    for r in (low, high):
        if r is not None:
            _check_result(r)
    # gdp: the CLT μ² = q²(e^{1/z²} − 1) (q < 1) can exceed the exact μ² = 1/z² (q = 1), so its
    # monotonicity in q holds only between two CLT results or two exact ones
    same_gdp_regime = (
        name == "gdp" and low and high and low.details["exact"] == high.details["exact"]
    )
    if (_certified(low) and _certified(high)) or same_gdp_regime:
        _count("compared:monotone_in_q")
        assert low.epsilon <= high.epsilon + _slack(name, low, high, t), (low, high)


@FUZZ
@given(
    name=names,
    q=q_values,
    z=z_values,
    factor=st.floats(1.0, 1e6),
    t=st.integers(1, 400),
    delta=delta_values,
)
@pytest.mark.slow
def test_epsilon_is_monotone_in_noise(
    name: str, q: float, z: float, factor: float, t: int, delta: float
) -> None:
    _count("monotone_in_z")
    acc = ACCOUNTANTS[name]
    more_noise = _call(acc.epsilon, _ledger((q, z * factor, t)), delta=delta)
    less_noise = _call(acc.epsilon, _ledger((q, z, t)), delta=delta)
    for r in (more_noise, less_noise):
        if r is not None:
            _check_result(r)
    if (_certified(more_noise) and _certified(less_noise)) or (
        name == "gdp" and more_noise and less_noise
    ):
        _count("compared:monotone_in_z")
        assert more_noise.epsilon <= less_noise.epsilon + _slack(name, more_noise, less_noise, t), (
            more_noise,
            less_noise,
        )


@settings(max_examples=30, deadline=20_000, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=names,
    runs=st.lists(st.tuples(q_values, z_values, st.integers(1, 300)), min_size=1, max_size=3),
    delta=delta_values,
    points=st.one_of(
        st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8),  # fractions of the ledger
        st.sampled_from([range(10**21), range(0), [True], [-1], [10**400], "abc", 5]),
    ),
)
def test_epsilon_curve_is_typed_valid_and_monotone(
    name: str, runs: list[tuple[float, float, int]], delta: float, points: Any
) -> None:
    _count("epsilon_curve")
    acc = ACCOUNTANTS[name]
    ledger = _ledger(*runs)
    if isinstance(points, list) and points and isinstance(points[0], float):
        points = [int(f * ledger.num_steps) for f in points]
    results = _call(acc.epsilon_curve, ledger, delta=delta, steps=points)
    if results is None:
        return
    for r in results:
        _check_result(r)
    by_steps = sorted(zip(list(points), results, strict=True), key=lambda pair: pair[0])
    for (_, a), (t_b, b) in itertools.pairwise(by_steps):
        if (_certified(a) and _certified(b)) or name == "gdp":
            _count("compared:epsilon_curve")
            assert a.epsilon <= b.epsilon + _slack(name, a, b, t_b), (a, b)


@settings(max_examples=40, deadline=20_000, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=names,
    which=st.sampled_from(("noise", "q", "steps")),
    target=st.one_of(
        st.sampled_from([5e-324, 1e-300, 1e300, math.inf, 10**400]), st.floats(0.1, 20)
    ),
    delta=delta_values,
    q=q_values,
    z=z_values,
    t=st.one_of(st.sampled_from([1, 10**12, 10**24]), st.integers(1, 500)),
)
def test_calibration_is_typed_and_meets_the_target(
    name: str, which: str, target: float, delta: float, q: float, z: float, t: int
) -> None:
    _count("calibration")
    acc = ACCOUNTANTS[name]
    common = dict(
        target_epsilon=target,
        delta=delta,
        accountant=acc,
        allow_approximation=True,
        time_budget_s=10.0,
    )
    if which == "noise":
        result = _call(calibrate_noise_multiplier, sampling_probability=q, steps=t, **common)
    elif which == "q":
        result = _call(calibrate_sampling_probability, noise_multiplier=z, steps=t, **common)
    else:
        result = _call(
            calibrate_steps,
            noise_multiplier=z,
            sampling_probability=q,
            max_steps=max(1, min(t, 10**6)),
            **common,
        )
    if result is None:
        return
    _count("calibrated")
    assert not math.isnan(result.epsilon) and result.epsilon >= 0.0
    assert result.epsilon <= result.target_epsilon
    assert np.isfinite(result.value) and result.value > 0


# Counterexamples the fuzzing found, kept as explicit cases of the same properties. Both are in
# the RDP bound itself (dp-accounting's RDP accountant gives the same numbers): at q < 1 it can
# exceed the full-batch (q = 1) bound, and fractional orders near 1 that fail to converge are
# dropped, so ε can grow with z. They fail until the RDP bound is made monotone.
@pytest.mark.parametrize(
    ("q", "factor", "z", "t", "delta"),
    [(0.7702206390637627, 2.753516237860083, 0.798127318292282, 9193, 0.9999999999999999)],
)
def test_rdp_is_monotone_in_q_at_fuzzed_counterexamples(
    q: float, factor: float, z: float, t: int, delta: float
) -> None:
    test_epsilon_is_monotone_in_q.hypothesis.inner_test(
        name="rdp", q=q, factor=factor, z=z, t=t, delta=delta
    )


@pytest.mark.parametrize(
    ("q", "z", "factor", "t", "delta"),
    [
        (0.1645884941183869, 0.23334414963038608, 1.1974244593737688, 1167, 5.169630574548272e-07),
        (0.020304866368874498, 0.26824822608053417, 1.1109208544460973, 3556, 0.9999999999999999),
    ],
)
def test_rdp_is_monotone_in_noise_at_fuzzed_counterexamples(
    q: float, z: float, factor: float, t: int, delta: float
) -> None:
    test_epsilon_is_monotone_in_noise.hypothesis.inner_test(
        name="rdp", q=q, z=z, factor=factor, t=t, delta=delta
    )


@pytest.mark.slow  # counts the examples of the fuzz tests above, which are slow
def test_examples_were_run() -> None:
    """Runs last (file order): every fuzz test above drew its examples."""
    if not _COUNTS:
        pytest.skip("run together with the fuzz tests above to count their examples")
    print("fuzz examples per test:", _COUNTS)
    assert all(_COUNTS.get(key, 0) > 0 for key in _EXPECTED_COUNTS), _COUNTS


_EXPECTED_COUNTS = (
    "epsilon_and_delta",
    "monotone_in_steps",
    "monotone_in_q",
    "monotone_in_z",
    "epsilon_curve",
    "calibration",
    "compared:monotone_in_steps",
    "compared:monotone_in_q",
    "compared:monotone_in_z",
    "compared:epsilon_curve",
    "calibrated",
)
