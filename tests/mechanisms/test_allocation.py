"""Clip splits and noise allocations (paper section 4) hit their targets exactly."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpledger import PrivacyLedger
from dpledger.errors import InvalidParameterError
from dpledger.mechanisms import (
    GroupedSumQuery,
    dimension_adjusted_noise,
    effective_noise_multiplier,
    proportional_noise,
    sampled_step,
    split_clip_by_dimension,
    split_clip_equally,
)
from dpledger.mechanisms.allocation import NoiseAllocation, allocate

ULP_TOL = 16 * np.finfo(np.float64).eps  # float precision: a handful of roundings

dims_st = st.lists(st.integers(min_value=1, max_value=10**7), min_size=1, max_size=40)
z_st = st.floats(min_value=1e-3, max_value=1e3)
total_st = st.floats(min_value=1e-6, max_value=1e6)


def test_equal_split() -> None:
    assert split_clip_equally(total_l2_norm_bound=2.0, num_groups=4) == (1.0, 1.0, 1.0, 1.0)
    assert split_clip_equally(total_l2_norm_bound=3.0, num_groups=1) == (3.0,)


def test_dimension_split_keeps_the_total_and_puts_more_on_bigger_groups() -> None:
    bounds = split_clip_by_dimension(total_l2_norm_bound=1.0, dimensions=[30, 1])
    assert bounds == (math.sqrt(30 / 31), math.sqrt(1 / 31))
    assert bounds[0] > bounds[1]


@settings(max_examples=200, deadline=None)
@given(total=total_st, dims=dims_st)
def test_clip_splits_preserve_the_total_bound(total: float, dims: list[int]) -> None:
    for bounds in (
        split_clip_by_dimension(total_l2_norm_bound=total, dimensions=dims),
        split_clip_equally(total_l2_norm_bound=total, num_groups=len(dims)),
    ):
        assert len(bounds) == len(dims)
        assert math.sqrt(math.fsum(s * s for s in bounds)) == pytest.approx(total, rel=ULP_TOL)


@settings(max_examples=200, deadline=None)
@given(z=z_st, total=total_st, dims=dims_st)
def test_noise_allocations_hit_the_target_exactly(z: float, total: float, dims: list[int]) -> None:
    for bounds in (
        split_clip_by_dimension(total_l2_norm_bound=total, dimensions=dims),
        split_clip_equally(total_l2_norm_bound=total, num_groups=len(dims)),
    ):
        for alloc in (
            proportional_noise(noise_multiplier=z, l2_norm_bounds=bounds),
            dimension_adjusted_noise(noise_multiplier=z, l2_norm_bounds=bounds, dimensions=dims),
        ):
            assert alloc.target_noise_multiplier == z
            assert alloc.effective_noise_multiplier == pytest.approx(z, rel=ULP_TOL)
            # Eq. 1 computed independently with exact summation
            exact = math.fsum(
                (s / sig) ** 2 for s, sig in zip(bounds, alloc.noise_stddevs, strict=True)
            )
            assert exact**-0.5 == pytest.approx(z, rel=ULP_TOL)


def test_allocation_formulas() -> None:
    prop = proportional_noise(noise_multiplier=2.0, l2_norm_bounds=[1.0, 3.0, 0.5, 0.5])
    assert prop.noise_stddevs == (4.0, 12.0, 2.0, 2.0)  # σ̃_g = z·√G·S_g with √G = 2
    dim = dimension_adjusted_noise(
        noise_multiplier=1.0, l2_norm_bounds=[1.0, 2.0], dimensions=[3, 1]
    )
    assert dim.noise_stddevs == (math.sqrt(4 / 3), 2.0 * 2.0)  # z·√(D/d_g)·S_g with D = 4
    # dimension split + dimension-adjusted noise gives every group the same σ̃ = z·S*
    bounds = split_clip_by_dimension(total_l2_norm_bound=2.0, dimensions=[100, 10, 1])
    same = dimension_adjusted_noise(
        noise_multiplier=1.5, l2_norm_bounds=bounds, dimensions=[100, 10, 1]
    )
    np.testing.assert_allclose(same.noise_stddevs, 3.0, rtol=1e-15)


def test_effective_noise_multiplier_squares_like_the_ledger() -> None:
    # x**2 (C pow) and x*x (what the ledger computes) differ in the last bit for some x; these
    # tuples are such a case, so the two z_eff would differ if the arithmetic did.
    from dpledger.ledger.steps import step_noise_multiplier

    bounds = [5.668278702526101, 7.69731181902336, 3.559123472125851, 2.0189153265212827]
    stddevs = [6.684546066998, 4.356144727984485, 4.2369725522515465, 4.540466455734331]
    expected = step_noise_multiplier(list(zip(bounds, stddevs, strict=True)))
    assert effective_noise_multiplier(l2_norm_bounds=bounds, noise_stddevs=stddevs) == expected


def test_allocation_matches_the_ledger_exactly() -> None:
    bounds = split_clip_by_dimension(total_l2_norm_bound=1.0, dimensions=[500, 20, 1])
    alloc = proportional_noise(noise_multiplier=0.9, l2_norm_bounds=bounds)
    group = GroupedSumQuery(list(alloc.queries(labels=["a", "b", "c"], clipping="global")))
    assert [q.clipping.name for q in group.queries] == ["global"] * 3
    ledger = PrivacyLedger()
    rng = np.random.default_rng(0)
    with sampled_step(ledger, sampling_probability=0.1, population_size=100, generator=rng) as step:
        step.run(group, [[np.ones((3, 500))], [np.ones((3, 20))], [np.ones((3, 1))]])
    assert ledger.runs()[0].noise_multiplier == alloc.effective_noise_multiplier


def test_effective_noise_multiplier() -> None:
    assert effective_noise_multiplier(l2_norm_bounds=[2.0], noise_stddevs=[3.0]) == 1.5
    assert effective_noise_multiplier(l2_norm_bounds=[1.0, 1.0], noise_stddevs=[1.0, 0.0]) == 0.0
    assert effective_noise_multiplier(
        l2_norm_bounds=[3.0, 4.0], noise_stddevs=[1.0, 1.0]
    ) == pytest.approx(0.2)


SPLIT_EQ, SPLIT_DIM = split_clip_equally, split_clip_by_dimension
PROP, DIM_ADJ, Z_EFF = proportional_noise, dimension_adjusted_noise, effective_noise_multiplier


@pytest.mark.parametrize(
    ("function", "kwargs", "parameter"),
    [
        (SPLIT_EQ, {"total_l2_norm_bound": 0.0, "num_groups": 2}, "total_l2_norm_bound"),
        (SPLIT_EQ, {"total_l2_norm_bound": math.nan, "num_groups": 2}, "total_l2_norm_bound"),
        (SPLIT_EQ, {"total_l2_norm_bound": 1.0, "num_groups": 0}, "num_groups"),
        (SPLIT_EQ, {"total_l2_norm_bound": 1.0, "num_groups": 2.0}, "num_groups"),
        (SPLIT_DIM, {"total_l2_norm_bound": 1.0, "dimensions": []}, "dimensions"),
        (SPLIT_DIM, {"total_l2_norm_bound": 1.0, "dimensions": [3, 0]}, "dimensions[1]"),
        (SPLIT_DIM, {"total_l2_norm_bound": 1.0, "dimensions": [1.5]}, "dimensions[0]"),
        (SPLIT_DIM, {"total_l2_norm_bound": 1.0, "dimensions": 3}, "dimensions"),
        (SPLIT_DIM, {"total_l2_norm_bound": -1.0, "dimensions": [3]}, "total_l2_norm_bound"),
        (PROP, {"noise_multiplier": 0.0, "l2_norm_bounds": [1.0]}, "noise_multiplier"),
        (PROP, {"noise_multiplier": math.inf, "l2_norm_bounds": [1.0]}, "noise_multiplier"),
        (PROP, {"noise_multiplier": 1.0, "l2_norm_bounds": []}, "l2_norm_bounds"),
        (PROP, {"noise_multiplier": 1.0, "l2_norm_bounds": [1.0, -1.0]}, "l2_norm_bounds[1]"),
        (PROP, {"noise_multiplier": 1.0, "l2_norm_bounds": [math.nan]}, "l2_norm_bounds[0]"),
        (
            DIM_ADJ,
            {"noise_multiplier": 1.0, "l2_norm_bounds": [1.0], "dimensions": [1, 2]},
            "dimensions",
        ),
        (Z_EFF, {"l2_norm_bounds": [1.0], "noise_stddevs": [1.0, 2.0]}, "noise_stddevs"),
        (Z_EFF, {"l2_norm_bounds": [1.0], "noise_stddevs": [-1.0]}, "noise_stddevs[0]"),
        (Z_EFF, {"l2_norm_bounds": [0.0], "noise_stddevs": [1.0]}, "l2_norm_bounds[0]"),
    ],
)
def test_bad_allocation_inputs(function: object, kwargs: dict, parameter: str) -> None:
    with pytest.raises(InvalidParameterError) as err:
        function(**kwargs)  # type: ignore[operator]
    assert err.value.parameter == parameter


def test_allocation_queries_bad_inputs() -> None:
    alloc = NoiseAllocation((1.0, 1.0), (1.0, 1.0), 0.7)
    with pytest.raises(InvalidParameterError, match="labels"):
        alloc.queries(labels=["a"])
    with pytest.raises(InvalidParameterError, match="clipping"):
        alloc.queries(clipping=["flat"])
    assert [q.clipping.name for q in alloc.queries(clipping=["flat", "automatic"])] == [
        "flat",
        "automatic",
    ]


@pytest.mark.parametrize("clip_split", ["equal", "dimension"])
@pytest.mark.parametrize("noise_allocation", ["proportional", "dimension"])
def test_allocate_composes_the_split_and_the_allocation(clip_split, noise_allocation):
    dims = [30, 5, 1]
    got = allocate(
        l2_norm_bound=2.0,
        noise_multiplier=1.3,
        dimensions=dims,
        clip_split=clip_split,
        noise_allocation=noise_allocation,
    )
    if clip_split == "equal":
        bounds = split_clip_equally(total_l2_norm_bound=2.0, num_groups=3)
    else:
        bounds = split_clip_by_dimension(total_l2_norm_bound=2.0, dimensions=dims)
    if noise_allocation == "proportional":
        want = proportional_noise(noise_multiplier=1.3, l2_norm_bounds=bounds)
    else:
        want = dimension_adjusted_noise(
            noise_multiplier=1.3, l2_norm_bounds=bounds, dimensions=dims
        )
    assert got == want
    assert got.effective_noise_multiplier == pytest.approx(1.3, rel=ULP_TOL)


def test_allocate_one_group_and_zero_noise():
    one = allocate(l2_norm_bound=2.0, noise_multiplier=1.5, dimensions=[7])
    assert (one.l2_norm_bounds, one.noise_stddevs) == ((2.0,), (3.0,))
    silent = allocate(l2_norm_bound=2.0, noise_multiplier=0.0, dimensions=[3, 4])
    assert silent.l2_norm_bounds == split_clip_equally(total_l2_norm_bound=2.0, num_groups=2)
    assert silent.noise_stddevs == (0.0, 0.0) and silent.effective_noise_multiplier == 0.0


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        ({"clip_split": "layer"}, "clip_split"),
        ({"noise_allocation": "equal"}, "noise_allocation"),
        ({"l2_norm_bound": 0.0}, "l2_norm_bound"),
        ({"noise_multiplier": -1.0}, "noise_multiplier"),
        ({"dimensions": []}, "dimensions"),
        ({"dimensions": 3}, "dimensions"),
        ({"dimensions": [3, 0], "clip_split": "dimension"}, "dimensions[1]"),
    ],
)
def test_allocate_names_the_bad_argument(kwargs, parameter):
    args = {"l2_norm_bound": 1.0, "noise_multiplier": 1.0, "dimensions": [3, 4]} | kwargs
    with pytest.raises(InvalidParameterError) as info:
        allocate(**args)
    assert info.value.parameter == parameter
