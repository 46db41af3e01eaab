"""Gaussian sum queries: separate and joint scaled clipping, staged and one-call APIs."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
from scipy import stats

from dpledger import PrivacyLedger
from dpledger.errors import InvalidParameterError, LedgerStateError
from dpledger.ledger import SumQueryEvent
from dpledger.mechanisms import GaussianSumQuery, ScaledGaussianSumQuery
from dpledger.mechanisms.backend import NumpyBackend
from dpledger.mechanisms.sum_query import SensitivityCheckError

BE = NumpyBackend()


def events(ledger: PrivacyLedger) -> list:
    return list(ledger.events())


def queries_of(ledger: PrivacyLedger) -> list[SumQueryEvent]:
    return [e for e in ledger.events() if isinstance(e, SumQueryEvent)]


def assert_std_matches(sample: np.ndarray, sigma: float, *, num_se: float = 5.0) -> None:
    """Sample mean and standard deviation within num_se standard errors of N(0, σ²)."""
    n = sample.size
    assert abs(sample.mean()) <= num_se * sigma / math.sqrt(n)
    assert abs(sample.std(ddof=1) - sigma) <= num_se * sigma / math.sqrt(2 * n)


# ----------------------------------------------------------------------- construction
@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        ({"l2_norm_bound": 0.0, "noise_stddev": 1.0}, "l2_norm_bound"),
        ({"l2_norm_bound": -1.0, "noise_stddev": 1.0}, "l2_norm_bound"),
        ({"l2_norm_bound": math.nan, "noise_stddev": 1.0}, "l2_norm_bound"),
        ({"l2_norm_bound": math.inf, "noise_stddev": 1.0}, "l2_norm_bound"),
        ({"l2_norm_bound": True, "noise_stddev": 1.0}, "l2_norm_bound"),
        ({"l2_norm_bound": 1.0, "noise_stddev": -0.1}, "noise_stddev"),
        ({"l2_norm_bound": 1.0, "noise_stddev": math.nan}, "noise_stddev"),
        ({"l2_norm_bound": 1.0, "noise_stddev": math.inf}, "noise_stddev"),
        ({"l2_norm_bound": 1.0, "noise_stddev": 1.0, "clipping": "local"}, "clipping"),
        ({"l2_norm_bound": 1.0, "noise_stddev": 1.0, "label": 3}, "label"),
        ({"l2_norm_bound": 1.0, "noise_stddev": 1.0, "check_sensitivity": 1}, "check_sensitivity"),
    ],
)
def test_bad_query_parameters(kwargs: dict, parameter: str) -> None:
    with pytest.raises(InvalidParameterError) as err:
        GaussianSumQuery(**kwargs)
    assert err.value.parameter == parameter


@pytest.mark.parametrize(
    ("scales", "parameter"),
    [
        ((), "scales"),
        ((1.0, 0.0), "scales[1]"),
        ((-2.0,), "scales[0]"),
        ((1.0, math.nan), "scales[1]"),
        ((math.inf,), "scales[0]"),
        ("ab", "scales"),
    ],
)
def test_bad_scales(scales: object, parameter: str) -> None:
    with pytest.raises(InvalidParameterError) as err:
        ScaledGaussianSumQuery(l2_norm_bound=1.0, noise_stddev=1.0, scales=scales)
    assert err.value.parameter == parameter


def test_queries_are_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        GaussianSumQuery(1.0, 1.0)  # type: ignore[misc]
    q = GaussianSumQuery(l2_norm_bound=2, noise_stddev=3)
    assert (q.l2_norm_bound, q.noise_stddev, q.noise_multiplier) == (2.0, 3.0, 1.5)
    with pytest.raises(AttributeError):
        q.l2_norm_bound = 5.0  # type: ignore[misc]
    assert ScaledGaussianSumQuery(l2_norm_bound=1, noise_stddev=1, scales=np.array([1, 2])).scales
    assert ScaledGaussianSumQuery(l2_norm_bound=1, noise_stddev=1, scales=[1, 2]).scales == (
        1.0,
        2.0,
    )


def test_from_noise_multiplier() -> None:
    q = GaussianSumQuery.from_noise_multiplier(l2_norm_bound=2.0, noise_multiplier=1.5, label="a")
    assert (q.noise_stddev, q.label) == (3.0, "a")
    s = ScaledGaussianSumQuery.from_noise_multiplier(
        l2_norm_bound=1.0, noise_multiplier=0.5, scales=(1, 2)
    )
    assert isinstance(s, ScaledGaussianSumQuery) and s.noise_stddev == 0.5
    with pytest.raises(InvalidParameterError, match="noise_multiplier"):
        GaussianSumQuery.from_noise_multiplier(l2_norm_bound=1.0, noise_multiplier=-1.0)


# ----------------------------------------------------------------------- recording
def test_run_records_exactly_one_event_with_the_values_used(
    ledger: PrivacyLedger, rng: np.random.Generator
) -> None:
    q = GaussianSumQuery(l2_norm_bound=0.7, noise_stddev=1.3, label="dense")
    before = ledger.num_events
    out = q.run([np.ones((5, 3, 2)), np.ones((5, 2))], ledger=ledger, generator=rng)
    assert [a.shape for a in out] == [(3, 2), (2,)]
    assert ledger.num_events == before + 1
    assert queries_of(ledger) == [SumQueryEvent(0.7, 1.3, "dense")]
    q.release([np.zeros(3)], num_records=0, ledger=ledger, generator=rng)
    assert len(queries_of(ledger)) == 2


def test_single_array_is_a_group_of_one(ledger: PrivacyLedger) -> None:
    q = GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=0.5)
    x = np.random.default_rng(0).normal(size=(4, 6))
    a = q.run(x, ledger=ledger, generator=np.random.default_rng(1))
    b = q.run([x], ledger=ledger, generator=np.random.default_rng(1))
    np.testing.assert_array_equal(a[0], b[0])


def test_empty_sample_releases_pure_noise(ledger: PrivacyLedger) -> None:
    q = GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=2.0)
    (out,) = q.run(np.zeros((0, 4)), ledger=ledger, generator=np.random.default_rng(5))
    np.testing.assert_array_equal(out, 2.0 * np.random.default_rng(5).standard_normal(4))
    assert queries_of(ledger) == [SumQueryEvent(1.0, 2.0)]


def test_query_outside_an_open_step_is_refused_and_draws_nothing() -> None:
    q = GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=1.0)
    empty = PrivacyLedger()
    gen = np.random.default_rng(0)
    state = copy.deepcopy(gen.bit_generator.state)
    with pytest.raises(LedgerStateError):
        q.run(np.ones((2, 2)), ledger=empty, generator=gen)
    with pytest.raises(LedgerStateError):
        q.release([np.ones(2)], num_records=2, ledger=empty, generator=gen)
    assert empty.num_events == 0
    assert gen.bit_generator.state == state
    closed = PrivacyLedger()
    closed.record_sample(sampling_probability=0.5)
    closed.close()
    with pytest.raises(LedgerStateError):
        q.run(np.ones((2, 2)), ledger=closed, generator=gen)
    assert closed.num_events == 1
    with pytest.raises(InvalidParameterError, match="ledger"):
        q.run(np.ones((2, 2)), ledger=None, generator=gen)  # type: ignore[arg-type]


def rejected_calls() -> list:
    q = GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=1.0)
    s = ScaledGaussianSumQuery(l2_norm_bound=1.0, noise_stddev=1.0, scales=(1.0, 2.0))
    nan_record = np.ones((3, 2))
    nan_record[1, 0] = np.nan

    def run(query: GaussianSumQuery, records: object, **kw: object) -> object:
        kw.setdefault("generator", np.random.default_rng())
        return lambda led: query.run(records, ledger=led, **kw)

    def release(query: GaussianSumQuery, sums: object, count: object) -> object:
        gen = np.random.default_rng()
        return lambda led: query.release(sums, num_records=count, ledger=led, generator=gen)

    return [
        ("records", run(q, [np.ones((3, 2)), np.ones((4,))])),
        ("records", run(q, [])),
        ("records[0][1]", run(q, nan_record)),
        ("records", run(s, [np.ones((3, 2))])),
        ("clipped_sums", release(s, [np.ones(2)], 3)),
        ("clipped_sums", release(q, [np.full(2, 10.0)], 3)),
        ("clipped_sums[0]", release(q, [np.array([np.inf])], 3)),
        ("num_records", release(q, [np.zeros(2)], -1)),
        ("num_records", release(q, [np.zeros(2)], 2.0)),
        ("num_records", release(q, [np.zeros(2)], True)),
        ("generator", run(q, np.ones((3, 2)), generator=None)),
        ("backend", run(q, np.ones((3, 2)), backend=3)),
    ]


@pytest.mark.parametrize(("parameter", "call"), rejected_calls())
def test_rejected_calls_name_the_parameter_and_leave_the_ledger_unchanged(
    ledger: PrivacyLedger, parameter: str, call: object
) -> None:
    before = events(ledger)
    with pytest.raises(InvalidParameterError) as err:
        call(ledger)  # type: ignore[operator]
    assert err.value.parameter == parameter
    assert events(ledger) == before


# ----------------------------------------------------------------------- noise
@pytest.mark.statistical
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_noise_standard_deviation_matches(dtype: type, ledger: PrivacyLedger) -> None:
    sigma = 2.5
    q = GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=sigma)
    records = [np.zeros((3, 60_000), dtype=dtype), np.zeros((3, 200, 200), dtype=dtype)]
    a, b = q.run(records, ledger=ledger, generator=np.random.default_rng(11))
    assert a.dtype == dtype and b.dtype == dtype
    for noise in (a, b.ravel()):
        assert_std_matches(noise.astype(np.float64), sigma)
    pvalue = stats.kstest(a.astype(np.float64) / sigma, "norm").pvalue
    assert pvalue > 1e-4


@pytest.mark.statistical
def test_joint_noise_is_alpha_times_sigma_per_block(ledger: PrivacyLedger) -> None:
    sigma, scales = 0.3, (1.0, 100.0, 0.01)
    q = ScaledGaussianSumQuery(l2_norm_bound=1.0, noise_stddev=sigma, scales=scales)
    sums = [np.zeros(50_000) for _ in scales]
    out = q.release(sums, num_records=0, ledger=ledger, generator=np.random.default_rng(12))
    for block, alpha in zip(out, scales, strict=True):
        assert_std_matches(block, alpha * sigma)
    assert queries_of(ledger) == [SumQueryEvent(1.0, sigma)]


# ----------------------------------------------------------------------- joint clipping
@pytest.mark.statistical
def test_paper_joint_clipping_example(ledger: PrivacyLedger) -> None:
    """‖v1‖ ≤ 1, ‖v2‖ ≤ 100, one of them zero per record; α = (1, 100), σ_g = 0.01, S = 1."""
    rng = np.random.default_rng(13)
    records, d1, d2 = 40, 20_000, 20_000
    v1 = rng.normal(size=(records, d1))
    v2 = rng.normal(size=(records, d2))
    v1 *= (rng.uniform(0.1, 1.0, records) / np.linalg.norm(v1, axis=1))[:, None]
    v2 *= (rng.uniform(1.0, 100.0, records) / np.linalg.norm(v2, axis=1))[:, None]
    first = np.arange(records) % 2 == 0
    v1[~first] = 0.0
    v2[first] = 0.0
    q = ScaledGaussianSumQuery(l2_norm_bound=1.0, noise_stddev=0.01, scales=(1.0, 100.0))
    norms = q.record_norms([v1, v2])
    assert (norms <= 1.0).all()
    np.testing.assert_array_equal(q.clip_factors(norms), np.ones(records))  # nothing clipped
    out1, out2 = q.run([v1, v2], ledger=ledger, generator=np.random.default_rng(14))
    assert_std_matches(out1 - v1.sum(axis=0), 0.01)
    assert_std_matches(out2 - v2.sum(axis=0), 1.0)
    assert queries_of(ledger) == [SumQueryEvent(1.0, 0.01)]
    # Separate clipping at the same S would have to clip every v2 record down to norm 1.
    separate = GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=0.01)
    assert (separate.clip_factors(separate.record_norms([v1, v2]))[~first] < 1.0).all()


@pytest.mark.parametrize("clipping", ["flat", "global", "automatic"])
def test_joint_with_unit_scales_is_separate_clipping_bit_for_bit(
    clipping: str, ledger: PrivacyLedger
) -> None:
    rng = np.random.default_rng(15)
    group = [rng.normal(size=(9, 4, 3)) * 2, rng.normal(size=(9, 5))]
    sep = GaussianSumQuery(l2_norm_bound=1.5, noise_stddev=0.8, clipping=clipping, label="g")
    joint = ScaledGaussianSumQuery(
        l2_norm_bound=1.5, noise_stddev=0.8, clipping=clipping, label="g", scales=(1.0, 1.0)
    )
    a = sep.run(group, ledger=ledger, generator=np.random.default_rng(16))
    b = joint.run(group, ledger=ledger, generator=np.random.default_rng(16))
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    first, second = queries_of(ledger)
    assert first == second == SumQueryEvent(1.5, 0.8, "g")


def test_joint_is_post_processing_of_one_gaussian_sum_query(ledger: PrivacyLedger) -> None:
    """Joint = rescale block j by α_j of a separate query run on the scaled records s(v)."""
    rng = np.random.default_rng(17)
    scales = (0.5, 20.0, 3.0)
    group = [
        rng.normal(size=(12, 7)) * 0.4,
        rng.normal(size=(12, 2, 2)) * 15,
        rng.normal(size=(12,)),
    ]
    joint = ScaledGaussianSumQuery(l2_norm_bound=1.2, noise_stddev=0.9, scales=scales)
    out = joint.run(group, ledger=ledger, generator=np.random.default_rng(18))
    scaled = [v / a for v, a in zip(group, scales, strict=True)]
    plain = GaussianSumQuery(l2_norm_bound=1.2, noise_stddev=0.9).run(
        scaled, ledger=ledger, generator=np.random.default_rng(18)
    )
    for block, ref, alpha in zip(out, plain, scales, strict=True):
        np.testing.assert_allclose(block, alpha * ref, rtol=1e-12, atol=1e-12)
    first, second = queries_of(ledger)
    assert first == second == SumQueryEvent(1.2, 0.9)


# ----------------------------------------------------------------------- staged API
@pytest.mark.parametrize("clipping", ["flat", "global", "automatic"])
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_staged_api_is_bit_identical_to_one_call(
    clipping: str, scaled: bool, dtype: type, ledger: PrivacyLedger
) -> None:
    rng = np.random.default_rng(19)
    group = [
        (rng.normal(size=(16, 5, 4)) * 0.5).astype(dtype),
        rng.normal(size=(16, 4)).astype(dtype),
    ]
    kwargs = {"l2_norm_bound": 1.0, "noise_stddev": 1.1, "clipping": clipping, "label": "layer"}
    q = (
        ScaledGaussianSumQuery(**kwargs, scales=(2.0, 0.5))
        if scaled
        else GaussianSumQuery(**kwargs)
    )
    one_call = q.run(group, ledger=ledger, generator=np.random.default_rng(20))
    # (a) per-record norms of each array, as a fast path would supply them
    member_norms = [BE.record_norms(x) for x in group]
    norms = q.group_norms(norms=member_norms)
    np.testing.assert_array_equal(norms, q.record_norms(group))
    factors = q.clip_factors(norms)  # (b)
    sums = [BE.weighted_sum(x, factors) for x in group]  # the caller's book-keeping
    staged = q.release(sums, num_records=16, ledger=ledger, generator=np.random.default_rng(20))
    for x, y in zip(one_call, staged, strict=True):
        assert x.dtype == y.dtype == dtype
        np.testing.assert_array_equal(x, y)
    first, second = queries_of(ledger)
    assert first == second


@pytest.mark.parametrize("scaled", [False, True])
def test_squared_norm_input_agrees_with_norm_input(scaled: bool) -> None:
    rng = np.random.default_rng(21)
    group = [rng.normal(size=(10, 6)), rng.normal(size=(10, 3, 3))]
    q = (
        ScaledGaussianSumQuery(l2_norm_bound=1.0, noise_stddev=1.0, scales=(3.0, 0.25))
        if scaled
        else GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=1.0)
    )
    norms = [BE.record_norms(x) for x in group]
    by_norms = q.group_norms(norms=norms)
    by_squares = q.group_norms(squared_norms=[n**2 for n in norms])
    np.testing.assert_allclose(by_squares, by_norms, rtol=1e-14)
    alphas = (3.0, 0.25) if scaled else (1.0, 1.0)
    expected = np.sqrt(sum((n / a) ** 2 for n, a in zip(norms, alphas, strict=True)))
    np.testing.assert_allclose(by_norms, expected, rtol=1e-14)


def test_group_norms_from_host_conversion_and_huge_norms() -> None:
    q = GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=1.0)
    got = q.group_norms(norms=[[3.0, 1e300], [4.0, 1e300]], backend=BE)
    np.testing.assert_allclose(got, [5.0, math.sqrt(2) * 1e300], rtol=1e-15)


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        ({}, "norms"),
        ({"norms": [np.ones(2)], "squared_norms": [np.ones(2)]}, "norms"),
        ({"norms": []}, "norms"),
        ({"norms": [np.ones(2), np.ones(3)]}, "norms"),
        ({"norms": [np.array([1.0, np.nan])]}, "norms[0][1]"),
        ({"squared_norms": [np.array([1.0, -1e-12])]}, "squared_norms[0][1]"),
        ({"squared_norms": [np.array([1.0, np.inf])]}, "squared_norms[0][1]"),
        ({"squared_norms": [np.array([1e308]), np.array([1e308])]}, "squared_norms"),
        ({"norms": [np.ones((2, 2))]}, "norms[0]"),
    ],
)
def test_bad_group_norm_inputs(kwargs: dict, parameter: str) -> None:
    q = GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=1.0)
    with pytest.raises(InvalidParameterError) as err:
        q.group_norms(**kwargs)
    assert err.value.parameter == parameter


def test_scaled_group_norms_need_one_vector_per_scale() -> None:
    q = ScaledGaussianSumQuery(l2_norm_bound=1.0, noise_stddev=1.0, scales=(1.0, 2.0))
    with pytest.raises(InvalidParameterError, match="scales"):
        q.group_norms(norms=[np.ones(3)])


def test_clipped_sums_checks_the_factor_count() -> None:
    q = GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=1.0)
    with pytest.raises(InvalidParameterError, match="factors"):
        q.clipped_sums(np.ones((3, 2)), np.ones(2))


# ----------------------------------------------------------------------- sensitivity check
def test_sensitivity_check_catches_a_batch_size_bug(ledger: PrivacyLedger) -> None:
    """Records clipped to C but the query claims C/|B| (the backpropagation-clipping bug)."""
    batch, clip = 10, 1.0
    records = np.tile([[0.6, 0.8]], (batch, 1)) * 5.0  # aligned records of norm 5
    (clipped,) = GaussianSumQuery(l2_norm_bound=clip, noise_stddev=1.0).clip(records)
    wrong = GaussianSumQuery(l2_norm_bound=clip / batch, noise_stddev=1.0 / batch)
    gen = np.random.default_rng(22)
    state = copy.deepcopy(gen.bit_generator.state)
    before = events(ledger)
    with pytest.raises(SensitivityCheckError) as err:
        wrong.release([clipped.sum(axis=0)], num_records=batch, ledger=ledger, generator=gen)
    assert err.value.parameter == "clipped_sums"
    assert err.value.norm == pytest.approx(batch * clip)
    assert err.value.limit == pytest.approx(clip)
    assert events(ledger) == before and gen.bit_generator.state == state
    # the correct bound passes, even with every record exactly on the sphere and aligned
    right = GaussianSumQuery(l2_norm_bound=clip, noise_stddev=1.0)
    right.release([clipped.sum(axis=0)], num_records=batch, ledger=ledger, generator=gen)


def test_sensitivity_check_can_be_turned_off(ledger: PrivacyLedger) -> None:
    q = GaussianSumQuery(l2_norm_bound=0.1, noise_stddev=1.0, check_sensitivity=False)
    q.release([np.full(4, 100.0)], num_records=1, ledger=ledger, generator=np.random.default_rng(0))
    assert queries_of(ledger) == [SumQueryEvent(0.1, 1.0)]
    # but a non-finite sum is never released
    with pytest.raises(InvalidParameterError, match=r"clipped_sums\[0\]"):
        q.release(
            [np.array([np.nan])], num_records=1, ledger=ledger, generator=np.random.default_rng(0)
        )


def test_sensitivity_check_for_joint_clipping_uses_the_scaled_space(ledger: PrivacyLedger) -> None:
    q = ScaledGaussianSumQuery(l2_norm_bound=1.0, noise_stddev=1.0, scales=(1.0, 100.0))
    gen = np.random.default_rng(0)
    # block 2 of norm 100 is norm 1 in the scaled space: one record's worth, allowed
    q.release([np.zeros(2), np.array([60.0, 80.0])], num_records=1, ledger=ledger, generator=gen)
    with pytest.raises(SensitivityCheckError):
        q.release(
            [np.array([0.6, 0.8]), np.array([60.0, 80.0])],
            num_records=1,
            ledger=ledger,
            generator=gen,
        )


def test_sensitivity_check_passes_for_honest_clipping_at_scale(ledger: PrivacyLedger) -> None:
    # float32, many aligned records clipped exactly onto the sphere: rounding must not trip it
    records = np.tile(np.full((1, 1000), 3.0, dtype=np.float32), (4096, 1))
    q = GaussianSumQuery(l2_norm_bound=0.5, noise_stddev=1.0)
    q.run(records, ledger=ledger, generator=np.random.default_rng(0))
    assert len(queries_of(ledger)) == 1
