"""Fuzzing every public constructor and recording method with extreme legal and illegal values.

Each test feeds one argument from a strategy of extreme numbers (subnormals, 1e±300, ±∞, NaN,
−0.0, huge Python ints with thousands of digits, numpy scalars, bools, strings, None) while the
others stay valid, and asserts that the call either succeeds or raises a
:class:`dpledger.errors.DPLedgerError` — never an untyped exception (OverflowError,
ZeroDivisionError, the int-to-string limit's ValueError, a numpy warning turned into an error,
MemoryError, …) — and that building the error message itself cannot fail.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpledger import PrivacyLedger
from dpledger.accountants import (
    calibrate_noise_multiplier,
    calibrate_sampling_probability,
    calibrate_steps,
    make_accountant,
)
from dpledger.errors import DPLedgerError, describe_value
from dpledger.ledger.events import SamplingEvent, SumQueryEvent
from dpledger.ledger.steps import CompressedLedger, StepRun
from dpledger.mechanisms import (
    AdaptiveClipping,
    GaussianSumQuery,
    GroupedSumQuery,
    ScaledGaussianSumQuery,
    dimension_adjusted_noise,
    effective_noise_multiplier,
    proportional_noise,
    sampled_step,
    split_clip_by_dimension,
    split_clip_equally,
)
from dpledger.mechanisms.adaptive import adaptive_noise_multiplier
from dpledger.mechanisms.allocation import allocate
from dpledger.sampling import PoissonSampler

HUGE = 10**5000  # more digits than Python's int-to-string limit (4300)

EXTREMES: list[Any] = [
    0,
    -0.0,
    5e-324,
    1e-320,
    1e-300,
    1e-6,
    1,
    1e300,
    1.7976931348623157e308,
    math.inf,
    -math.inf,
    math.nan,
    -1,
    -5e-324,
    10**24,
    HUGE,
    -HUGE,
    np.float64(1e308),
    np.float32(3e38),
    np.int64(2**62),
    np.array(1e-300),
    True,
    None,
    "1",
    1j,
]
_NUMBERS = (
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(10**30), max_value=10**30),
)
values = st.one_of(st.sampled_from(EXTREMES), *_NUMBERS)
values_without_huge_ints = st.one_of(
    st.sampled_from([v for v in EXTREMES if not (isinstance(v, int) and abs(v) > 10**4000)]),
    *_NUMBERS,
)
FUZZ = settings(max_examples=80, deadline=5_000, suppress_health_check=[HealthCheck.too_slow])

_COUNTS: dict[str, int] = {}


def _typed_or_success(name: str, fn: Callable[[], Any]) -> Any:
    """Call ``fn``; a dpledger error is fine, anything else fails the test. Warnings are errors
    (as under ``python -W error``), so a numpy overflow warning must not escape either."""
    _COUNTS[name] = _COUNTS.get(name, 0) + 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=".*noise_stddev=0.*")  # a documented warning
        try:
            result = fn()
        except DPLedgerError as exc:
            str(exc)  # the message can be built and read
            describe_value(getattr(exc, "value", None))
            return None
    repr(result)  # a result's repr must not fail either
    return result


def _length_and_first(bounds: tuple[float, ...]) -> tuple[int, float]:
    """A split's size and first bound: its repr would be millions of floats (seconds) when the
    fuzzed count is in the millions."""
    return len(bounds), bounds[0]


def _ledger_with_step() -> PrivacyLedger:
    ledger = PrivacyLedger()
    ledger.record_sample(sampling_probability=0.5)
    return ledger


CONSTRUCTORS: dict[str, Callable[[Any], Any]] = {
    "GaussianSumQuery.l2_norm_bound": lambda v: GaussianSumQuery(l2_norm_bound=v, noise_stddev=1.0),
    "GaussianSumQuery.noise_stddev": lambda v: GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=v),
    "ScaledGaussianSumQuery.scales": lambda v: ScaledGaussianSumQuery(
        l2_norm_bound=1.0, noise_stddev=1.0, scales=(v, 1.0)
    ),
    "GroupedSumQuery": lambda v: GroupedSumQuery(
        [
            GaussianSumQuery(l2_norm_bound=v, noise_stddev=1.0, label="a"),
            GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=v, label="b"),
        ]
    ),
    "PoissonSampler.sampling_probability": lambda v: PoissonSampler(
        population_size=10, sampling_probability=v, generator=np.random.default_rng(0)
    ),
    "PoissonSampler.population_size": lambda v: PoissonSampler(
        population_size=v, sampling_probability=0.5, generator=np.random.default_rng(0)
    ),
    "AdaptiveClipping": lambda v: AdaptiveClipping(
        initial_l2_norm_bound=v,
        target_unclipped_quantile=0.5,
        noise_multiplier=v,
        count_noise_stddev=10.0,
        expected_batch_size=v,
    ),
    "adaptive_noise_multiplier.noise_multiplier": lambda v: adaptive_noise_multiplier(
        noise_multiplier=v, count_noise_stddev=10.0
    ),
    "adaptive_noise_multiplier.count_noise_stddev": lambda v: adaptive_noise_multiplier(
        noise_multiplier=1.0, count_noise_stddev=v
    ),
    "allocate": lambda v: allocate(
        l2_norm_bound=v, noise_multiplier=v, dimensions=(3, 4), noise_allocation="dimension"
    ),
    "allocate.dimensions": lambda v: allocate(
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        dimensions=(v, 4),
        clip_split="dimension",
        noise_allocation="dimension",
    ),
    "proportional_noise": lambda v: proportional_noise(noise_multiplier=v, l2_norm_bounds=(1.0, v)),
    "dimension_adjusted_noise": lambda v: dimension_adjusted_noise(
        noise_multiplier=1e300, l2_norm_bounds=(1e300, 1.0), dimensions=(v, 1)
    ),
    "split_clip_equally": lambda v: _length_and_first(
        split_clip_equally(total_l2_norm_bound=v, num_groups=v)
    ),
    "split_clip_by_dimension": lambda v: split_clip_by_dimension(
        total_l2_norm_bound=1e-300, dimensions=(v, 2)
    ),
    "effective_noise_multiplier": lambda v: effective_noise_multiplier(
        l2_norm_bounds=(v, 1e300), noise_stddevs=(1e-300, v)
    ),
    "SumQueryEvent": lambda v: SumQueryEvent(l2_norm_bound=v, noise_stddev=v),
    "SamplingEvent.sampling_probability": lambda v: SamplingEvent(sampling_probability=v),
    "StepRun.sampling_probability": lambda v: StepRun(v, 1.0, 1),
    "CompressedLedger.from_runs.sampling_probability": lambda v: CompressedLedger.from_runs(
        [(0.5, 1.0, 3), (v, 1.0, 2)]
    ),
    "record_sample.sampling_probability": lambda v: PrivacyLedger().record_sample(
        sampling_probability=v
    ),
    "record_sum_query": lambda v: _ledger_with_step().record_sum_query(
        l2_norm_bound=v, noise_stddev=v
    ),
    "record_sum_query.mixed": lambda v: (
        _ledger_with_step().record_sum_query(l2_norm_bound=1e300, noise_stddev=v),
    ),
}

# Where the untyped exception comes from code outside the accountants and mechanisms (the
# ledger's own validators and dpledger.errors.InvalidParameterError, which formats the value
# with repr(): Python refuses to turn an int of more than 4300 digits into a string).
LEDGER_HUGE_INT = {
    "SamplingEvent.population_size": lambda v: SamplingEvent(
        sampling_probability=0.5, population_size=v
    ),
    "StepRun.noise_multiplier": lambda v: StepRun(0.5, v, 1),
    "record_sample.population_size": lambda v: PrivacyLedger().record_sample(
        sampling_probability=0.5, population_size=v
    ),
    "StepRun.count": lambda v: StepRun(0.5, 1.0, v),  # accepted, but its repr() fails
    "CompressedLedger.from_runs.noise_multiplier": lambda v: CompressedLedger.from_runs(
        [(0.5, 1.0, 3), (0.5, v, 2)]
    ),
}

ACCOUNTANT_SETTINGS = {
    "rdp": ("bucketing",),
    "prv": (
        "eps_error",
        "delta_error",
        "bucketing",
        "max_points",
        "memory_budget",
        "time_budget_s",
    ),
    "gdp": (
        "lower_bound_interval",
        "lower_bound_bucketing",
        "bucketing",
        "memory_budget",
        "time_budget_s",
    ),
    "pld": ("value_discretization_interval", "bucketing", "memory_budget", "time_budget_s"),
}


@pytest.mark.parametrize("name", sorted(CONSTRUCTORS))
@FUZZ
@given(value=values)
def test_constructors_raise_only_typed_errors(name: str, value: Any) -> None:
    _typed_or_success(name, lambda: CONSTRUCTORS[name](value))


@pytest.mark.parametrize("name", sorted(LEDGER_HUGE_INT))
@FUZZ
@given(value=values_without_huge_ints)
def test_ledger_constructors_raise_only_typed_errors(name: str, value: Any) -> None:
    _typed_or_success(name, lambda: LEDGER_HUGE_INT[name](value))


@pytest.mark.parametrize("name", sorted(LEDGER_HUGE_INT))
def test_ledger_constructors_with_a_huge_int(name: str) -> None:
    for value in (HUGE, -HUGE):
        _typed_or_success(name, lambda: LEDGER_HUGE_INT[name](value))  # noqa: B023


@pytest.mark.parametrize(
    ("accountant", "setting"),
    [(a, s) for a, settings_ in ACCOUNTANT_SETTINGS.items() for s in settings_],
)
@FUZZ
@given(value=values)
def test_accountant_settings_raise_only_typed_errors(
    accountant: str, setting: str, value: Any
) -> None:
    _typed_or_success(
        f"{accountant}.{setting}", lambda: make_accountant(accountant, **{setting: value})
    )


@settings(max_examples=60, deadline=20_000, suppress_health_check=[HealthCheck.too_slow])
@given(
    which=st.sampled_from(("noise", "q", "steps")),
    argument=st.sampled_from(("target_epsilon", "delta", "other", "bracket", "time_budget_s")),
    value=values,
)
@pytest.mark.slow
def test_calibration_arguments_raise_only_typed_errors(
    which: str, argument: str, value: Any
) -> None:
    kwargs: dict[str, Any] = {"target_epsilon": 1.0, "delta": 1e-5, "accountant": "rdp"}
    if which == "noise":
        fn: Any = calibrate_noise_multiplier
        kwargs.update(sampling_probability=0.01, steps=100)
        other = "steps"
    elif which == "q":
        fn = calibrate_sampling_probability
        kwargs.update(noise_multiplier=1.0, steps=100)
        other = "noise_multiplier"
    else:
        fn = calibrate_steps
        kwargs.update(noise_multiplier=1.0, sampling_probability=0.01, max_steps=10_000)
        other = "sampling_probability"
    if argument == "bracket":
        if which == "steps":
            kwargs["max_steps"] = value
        else:
            kwargs["bracket"] = (1e-3 if which == "q" else 0.5, value)
    else:
        kwargs[other if argument == "other" else argument] = value
    _typed_or_success(f"calibrate.{argument}", lambda: fn(**kwargs))


@settings(max_examples=60, deadline=5_000, suppress_health_check=[HealthCheck.too_slow])
@given(bound=values, stddev=values, q=values)
def test_running_a_query_in_a_step_raises_only_typed_errors(
    bound: Any, stddev: Any, q: Any
) -> None:
    def run() -> Any:
        ledger = PrivacyLedger()
        query = GaussianSumQuery(l2_norm_bound=bound, noise_stddev=stddev)
        records = np.array([[3.0, 4.0], [1e-300, 0.0], [1e300, -1e300]])
        with sampled_step(
            ledger, sampling_probability=q, population_size=10, generator=np.random.default_rng(0)
        ) as step:
            (noised,) = step.run(query, records)
        return ledger.compressed(), noised

    _typed_or_success("step.run", run)


def test_examples_were_run() -> None:
    """Runs last (file order): reports how many examples each fuzzed entry point drew."""
    if not _COUNTS:
        pytest.skip("run together with the fuzz tests above to count their examples")
    print("fuzz examples per entry point:", _COUNTS, "total:", sum(_COUNTS.values()))
    assert all(count > 0 for count in _COUNTS.values())
