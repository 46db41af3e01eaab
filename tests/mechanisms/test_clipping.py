"""Clipping strategies: every clipped record stays within its bound, whatever the input."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dpledger.errors import InvalidParameterError
from dpledger.mechanisms import AutomaticClipping, FlatClipping, GlobalClipping
from dpledger.mechanisms.clipping import ClippingStrategy, check_record_norms
from dpledger.mechanisms.sum_query import clip_records
from tests.mechanisms.conftest import exact_record_norms, rounding_allowance

STRATEGIES = ["flat", "global", "automatic"]

# Finite floats across the whole float64 range, denormals included.
finite64 = st.floats(allow_nan=False, allow_infinity=False, allow_subnormal=True, width=64)
finite32 = st.floats(allow_nan=False, allow_infinity=False, allow_subnormal=True, width=32)
bounds = st.floats(min_value=1e-30, max_value=1e30, allow_nan=False)


def records_arrays(dtype: type, elements: st.SearchStrategy) -> st.SearchStrategy:
    return hnp.arrays(
        dtype, hnp.array_shapes(min_dims=2, max_dims=3, min_side=1, max_side=6), elements=elements
    )


# ----------------------------------------------------------------------- factor formulas
def test_flat_factors() -> None:
    f = FlatClipping().factors(np.array([0.0, 0.5, 1.0, 4.0]), l2_norm_bound=1.0)
    assert f.tolist() == [1.0, 1.0, 1.0, 0.25]


def test_global_factors_keep_exactly_the_records_within_the_bound() -> None:
    norms = np.array([0.0, 0.999999, 1.0, np.nextafter(1.0, 2.0), 3.0])
    f = GlobalClipping().factors(norms, l2_norm_bound=1.0)
    assert f.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_automatic_factors() -> None:
    f = AutomaticClipping(stability=0.5).factors(np.array([0.0, 1.5]), l2_norm_bound=2.0)
    assert f.tolist() == [4.0, 1.0]
    assert AutomaticClipping().stability == 0.01


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_non_finite_or_negative_norms_are_rejected(strategy: str, bad: float) -> None:
    with pytest.raises(InvalidParameterError, match=r"norms\[1\]") as err:
        ClippingStrategy.parse(strategy).factors(np.array([1.0, bad]), l2_norm_bound=1.0)
    assert err.value.parameter == "norms[1]"


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, "1"])
def test_bad_bound_is_rejected(bad: object) -> None:
    with pytest.raises(InvalidParameterError, match="l2_norm_bound"):
        FlatClipping().factors(np.ones(2), l2_norm_bound=bad)  # type: ignore[arg-type]


def test_bad_norm_vectors_are_rejected() -> None:
    with pytest.raises(InvalidParameterError, match="norms"):
        check_record_norms("norms", np.ones((2, 2)))
    with pytest.raises(InvalidParameterError, match="norms"):
        check_record_norms("norms", ["a"])
    assert check_record_norms("norms", [1, 2]).dtype == np.float64


@pytest.mark.parametrize("bad", [0.0, -0.1, math.nan, math.inf])
def test_automatic_stability_must_be_positive(bad: float) -> None:
    with pytest.raises(InvalidParameterError, match="stability"):
        AutomaticClipping(stability=bad)


def test_parse() -> None:
    assert isinstance(ClippingStrategy.parse("global"), GlobalClipping)
    auto = AutomaticClipping(stability=0.1)
    assert ClippingStrategy.parse(auto) is auto
    for bad in ["local", 3, None]:
        with pytest.raises(InvalidParameterError, match="clipping"):
            ClippingStrategy.parse(bad)


# ----------------------------------------------------------------------- adversarial inputs
ADVERSARIAL = np.array(
    [
        [1e300, -1e300, 1e300],  # huge: the sum of squares overflows float64
        [1.2e308, -1.2e308, 0.0],  # norm 1.7e308, just below the float64 maximum
        [0.0, 0.0, 0.0],  # zero vector
        [5e-324, -5e-324, 1e-310],  # denormals
        [3.0, 4.0, 0.0],
        [1e-3, 0.0, 0.0],
    ]
)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("bound", [1e-300, 1e-5, 1.0, 1e250])
def test_adversarial_records_stay_within_the_bound(strategy: str, bound: float) -> None:
    (clipped,) = clip_records(ADVERSARIAL, l2_norm_bound=bound, clipping=strategy)
    assert np.isfinite(clipped).all()
    norms = exact_record_norms(clipped)
    assert (norms <= bound * (1 + rounding_allowance(np.float64, 3))).all(), norms


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_single_record_and_zero_record(strategy: str) -> None:
    (one,) = clip_records(np.array([[30.0, 40.0]]), l2_norm_bound=5.0, clipping=strategy)
    assert exact_record_norms(one)[0] <= 5.0 * (1 + rounding_allowance(np.float64, 2))
    (zero,) = clip_records(np.zeros((1, 4)), l2_norm_bound=5.0, clipping=strategy)
    assert not zero.any()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_records_with_nan_or_inf_are_rejected_not_summed(strategy: str) -> None:
    for bad in (np.nan, np.inf):
        x = np.ones((3, 2))
        x[2, 1] = bad
        with pytest.raises(InvalidParameterError, match=r"records\[0\]\[2\]"):
            clip_records(x, l2_norm_bound=1.0, clipping=strategy)


def test_record_whose_norm_exceeds_float64_is_rejected() -> None:
    # Every element is finite but the norm (2.4e308) is not representable: an error, not a sum.
    x = np.array([[1.0, 0.0, 0.0], [1.7e308, 1.7e308, 0.0]])
    with pytest.raises(InvalidParameterError, match=r"records\[0\]\[1\]"):
        clip_records(x, l2_norm_bound=1.0)


def test_float32_huge_records_are_clipped_not_overflowed() -> None:
    x = np.full((2, 8), 3e38, dtype=np.float32)
    (clipped,) = clip_records(x, l2_norm_bound=1e-5)
    assert clipped.dtype == np.float32
    norms = exact_record_norms(clipped)
    assert (norms <= 1e-5 * (1 + rounding_allowance(np.float32, 8))).all()


def test_group_records_share_one_factor() -> None:
    kernel = np.array([[3.0, 0.0], [0.0, 0.3]])
    bias = np.array([[4.0], [0.4]])
    k, b = clip_records([kernel, bias], l2_norm_bound=1.0)
    np.testing.assert_allclose(k[0], [0.6, 0.0])
    np.testing.assert_allclose(b[0], [0.8])
    np.testing.assert_array_equal(k[1], kernel[1])  # norm 0.5: unchanged
    np.testing.assert_array_equal(b[1], bias[1])


# ----------------------------------------------------------------------- property tests
def clip_or_unrepresentable(x: np.ndarray, bound: float, strategy: str) -> np.ndarray | None:
    """Clip, or None when (and only when) some record's norm exceeds the float64 range."""
    representable = all(math.isfinite(n) for n in exact_record_norms(x))
    if representable:
        (clipped,) = clip_records(x, l2_norm_bound=bound, clipping=strategy)
        return clipped
    with pytest.raises(InvalidParameterError, match="records"):
        clip_records(x, l2_norm_bound=bound, clipping=strategy)
    return None


@settings(max_examples=150, deadline=None)
@given(x=records_arrays(np.float64, finite64), bound=bounds)
def test_flat_and_automatic_never_exceed_the_bound_float64(x: np.ndarray, bound: float) -> None:
    size = math.prod(x.shape[1:])
    for strategy in ("flat", "automatic"):
        clipped = clip_or_unrepresentable(x, bound, strategy)
        if clipped is None:
            continue
        norms = exact_record_norms(clipped)
        assert (norms <= bound * (1 + rounding_allowance(np.float64, size))).all()


@settings(max_examples=100, deadline=None)
@given(x=records_arrays(np.float32, finite32), bound=bounds)
def test_flat_and_automatic_never_exceed_the_bound_float32(x: np.ndarray, bound: float) -> None:
    size = math.prod(x.shape[1:])
    for strategy in ("flat", "automatic"):
        (clipped,) = clip_records(x, l2_norm_bound=bound, clipping=strategy)
        norms = exact_record_norms(clipped)
        assert (norms <= bound * (1 + rounding_allowance(np.float32, size))).all()


@settings(max_examples=150, deadline=None)
@given(x=records_arrays(np.float64, finite64), bound=bounds)
def test_global_clipping_drops_exactly_the_records_above_the_bound(
    x: np.ndarray, bound: float
) -> None:
    clipped = clip_or_unrepresentable(x, bound, "global")
    if clipped is None:
        return
    true_norms = exact_record_norms(x)
    size = math.prod(x.shape[1:])
    slack = rounding_allowance(np.float64, size)
    for i, n in enumerate(true_norms):
        if n <= bound * (1 - slack):
            np.testing.assert_array_equal(clipped[i], x[i])  # kept unchanged
        elif n > bound * (1 + slack):
            assert not clipped[i].any()  # dropped
        else:  # within rounding of the bound: either outcome, but nothing in between
            assert np.array_equal(clipped[i], x[i]) or not clipped[i].any()


@settings(max_examples=100, deadline=None)
@given(
    x=records_arrays(np.float64, st.floats(-1e6, 1e6)),
    bound=st.floats(min_value=1e-3, max_value=1e3),
)
@pytest.mark.slow
def test_flat_clipping_is_the_projection_onto_the_ball(x: np.ndarray, bound: float) -> None:
    (clipped,) = clip_records(x, l2_norm_bound=bound)
    norms = exact_record_norms(x)
    for i, n in enumerate(norms):
        expected = x[i] if n <= bound else x[i] * (bound / n)
        np.testing.assert_allclose(clipped[i], expected, rtol=1e-12, atol=1e-300)


def test_clip_factors_with_a_margin_clip_to_the_reduced_bound_and_record_s():
    from dpledger import PrivacyLedger
    from dpledger.mechanisms import GaussianSumQuery, sampled_step
    from dpledger.mechanisms.clipping import rounding_clip_margin

    query = GaussianSumQuery(l2_norm_bound=2.0, noise_stddev=0.0)
    norms = np.array([0.5, 1.99, 2.0, 4.0])
    rho = 0.01
    expected = np.minimum(1.0, 2.0 * (1 - rho) / norms)
    np.testing.assert_array_equal(query.clip_factors(norms, margin=rho), expected)
    np.testing.assert_array_equal(query.clip_factors(norms), np.minimum(1.0, 2.0 / norms))
    ledger = PrivacyLedger()
    with sampled_step(ledger, sampling_probability=1.0, generator=np.random.default_rng(0)) as step:
        step.release(query, [np.ones(3)], num_records=1)
    assert next(iter(ledger.steps())).queries[0].l2_norm_bound == 2.0
    assert rounding_clip_margin(np.finfo(np.float32).eps) == 2.0**13 * np.finfo(np.float32).eps
    assert rounding_clip_margin(0.01) == 0.05


@pytest.mark.parametrize("margin", [-0.01, 0.5, 1.0, float("nan"), True, "0.1"])
def test_bad_clip_margins_are_refused(margin):
    from dpledger.mechanisms import GaussianSumQuery

    query = GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=1.0)
    with pytest.raises(InvalidParameterError, match="margin"):
        query.clip_factors(np.ones(2), margin=margin)
