"""Several queries on one sample, and their z_eff in the ledger (paper Eq. 1)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dpledger import PrivacyLedger
from dpledger.errors import InvalidParameterError, LedgerStateError
from dpledger.ledger import SumQueryEvent
from dpledger.mechanisms import (
    GaussianSumQuery,
    GroupedSumQuery,
    ScaledGaussianSumQuery,
    sampled_step,
)
from dpledger.mechanisms.sum_query import SensitivityCheckError


def mixed_group() -> GroupedSumQuery:
    return GroupedSumQuery(
        [
            GaussianSumQuery(l2_norm_bound=0.8, noise_stddev=1.2, label="conv"),
            ScaledGaussianSumQuery(
                l2_norm_bound=1.5, noise_stddev=2.0, scales=(1.0, 10.0), label="dense",
                clipping="global",
            ),
            GaussianSumQuery(
                l2_norm_bound=1.0, noise_stddev=3.0, clipping="automatic", label="loss"
            ),
        ]
    )  # fmt: skip


def mixed_records(rng: np.random.Generator, batch: int = 8) -> list:
    return [
        [rng.normal(size=(batch, 3, 3))],
        [rng.normal(size=(batch, 4)), rng.normal(size=(batch, 2)) * 10],
        [rng.uniform(size=batch)],
    ]


def test_step_with_several_groups_has_z_eff_of_eq1() -> None:
    ledger = PrivacyLedger()
    group = mixed_group()
    rng = np.random.default_rng(1)
    with sampled_step(
        ledger, sampling_probability=0.05, population_size=1000, generator=rng
    ) as step:
        out = step.run(group, mixed_records(rng))
    assert [len(o) for o in out] == [1, 2, 1]
    by_hand = ((0.8 / 1.2) ** 2 + (1.5 / 2.0) ** 2 + (1.0 / 3.0) ** 2) ** -0.5
    (run,) = ledger.runs()
    assert run.sampling_probability == 0.05
    assert run.noise_multiplier == pytest.approx(by_hand, rel=1e-15)
    assert run.noise_multiplier == group.effective_noise_multiplier  # same arithmetic: exact
    (ledger_step,) = ledger.steps()
    assert ledger_step.queries == (
        SumQueryEvent(0.8, 1.2, "conv"),
        SumQueryEvent(1.5, 2.0, "dense"),
        SumQueryEvent(1.0, 3.0, "loss"),
    )


def test_each_group_uses_its_own_strategy() -> None:
    ledger = PrivacyLedger()
    ledger.record_sample(sampling_probability=0.5)
    big = np.array([[30.0, 40.0], [0.3, 0.4]])
    group = GroupedSumQuery(
        [
            GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=0.0, label="flat"),
            GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=0.0, clipping="global", label="g"),
        ]
    )
    (flat,), (glob,) = group.run([[big], [big]], ledger=ledger, generator=np.random.default_rng())
    np.testing.assert_allclose(flat, [0.9, 1.2])  # (0.6, 0.8) + (0.3, 0.4)
    np.testing.assert_allclose(glob, [0.3, 0.4])  # the long record is dropped


def test_grouped_release_of_clipped_sums() -> None:
    ledger = PrivacyLedger()
    ledger.record_sample(sampling_probability=0.5)
    group = GroupedSumQuery(
        [
            GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=1.0, label="a"),
            GaussianSumQuery(l2_norm_bound=2.0, noise_stddev=1.0, label="b"),
        ]
    )
    out = group.release(
        [[np.zeros(3)], [np.zeros(2), np.zeros(1)]],
        num_records=4,
        ledger=ledger,
        generator=np.random.default_rng(2),
    )
    assert [[a.shape for a in o] for o in out] == [[(3,)], [(2,), (1,)]]
    assert ledger.labels == ("a", "b")


def test_grouped_call_is_all_or_nothing() -> None:
    ledger = PrivacyLedger()
    ledger.record_sample(sampling_probability=0.5)
    group = GroupedSumQuery(
        [
            GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=1.0, label="ok"),
            GaussianSumQuery(l2_norm_bound=0.01, noise_stddev=1.0, label="wrong"),
        ]
    )
    before = list(ledger.events())
    with pytest.raises(SensitivityCheckError):
        group.release(
            [[np.ones(2) * 0.5], [np.ones(2)]],
            num_records=1,
            ledger=ledger,
            generator=np.random.default_rng(),
        )
    nan_records = np.ones((2, 2))
    nan_records[0, 0] = np.nan
    with pytest.raises(InvalidParameterError, match="records"):
        group.run(
            [[np.ones((2, 2))], [nan_records]], ledger=ledger, generator=np.random.default_rng()
        )
    with pytest.raises(InvalidParameterError, match="records"):
        group.run(
            [[np.ones((2, 2))], [np.ones((3, 2))]], ledger=ledger, generator=np.random.default_rng()
        )
    assert list(ledger.events()) == before
    with pytest.raises(LedgerStateError):
        group.run(
            [[np.ones((2, 2))], [np.ones((2, 2))]],
            ledger=PrivacyLedger(),
            generator=np.random.default_rng(),
        )


@pytest.mark.parametrize(
    ("queries", "parameter"),
    [
        ([], "queries"),
        ("abc", "queries"),
        ([GaussianSumQuery(l2_norm_bound=1, noise_stddev=1), "q"], "queries[1]"),
        (
            [
                GaussianSumQuery(l2_norm_bound=1, noise_stddev=1, label="x"),
                GaussianSumQuery(l2_norm_bound=1, noise_stddev=2, label="x"),
            ],
            "queries[1].label",
        ),
    ],
)
def test_bad_groups(queries: object, parameter: str) -> None:
    with pytest.raises(InvalidParameterError) as err:
        GroupedSumQuery(queries)  # type: ignore[arg-type]
    assert err.value.parameter == parameter


def test_wrong_number_of_record_groups() -> None:
    ledger = PrivacyLedger()
    ledger.record_sample(sampling_probability=0.5)
    group = mixed_group()
    with pytest.raises(InvalidParameterError, match="records"):
        group.run([[np.ones((2, 2))]], ledger=ledger, generator=np.random.default_rng())
    with pytest.raises(InvalidParameterError, match="clipped_sums"):
        group.release(np.ones(2), num_records=2, ledger=ledger, generator=np.random.default_rng())
    assert ledger.num_events == 1


def test_group_accessors() -> None:
    group = mixed_group()
    assert len(group) == 3 and group.labels == ("conv", "dense", "loss")
    assert group.queries[0].label == "conv"
    assert "GroupedSumQuery" in repr(group)
    zero = GroupedSumQuery(
        [
            GaussianSumQuery(l2_norm_bound=1, noise_stddev=1),
            GaussianSumQuery(l2_norm_bound=1, noise_stddev=0),
        ]
    )
    assert zero.effective_noise_multiplier == 0.0
    assert math.isclose(
        GroupedSumQuery(
            [GaussianSumQuery(l2_norm_bound=2, noise_stddev=3)]
        ).effective_noise_multiplier,
        1.5,
    )


def test_prepare_checks_before_anything_is_recorded_and_commits_once() -> None:
    group = GroupedSumQuery(
        [
            GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=1.0, label="a"),
            GaussianSumQuery(l2_norm_bound=2.0, noise_stddev=0.5, label="b"),
        ]
    )
    ledger = PrivacyLedger()
    with pytest.raises(SensitivityCheckError):  # no step is needed to refuse a release
        group.prepare([[np.full(4, 1.0)], [np.zeros(2)]], num_records=1)
    assert ledger.num_events == 0
    sums = [[np.full(4, 0.25)], [np.zeros(2), np.ones(1)]]
    prepared = group.prepare(sums, num_records=3)
    assert prepared.num_records == 3
    with sampled_step(ledger, sampling_probability=0.5, generator=np.random.default_rng(4)) as step:
        out = step.commit(prepared)
        with pytest.raises(LedgerStateError, match="committed"):
            step.commit(prepared)
    assert ledger.labels == ("a", "b") and ledger.num_steps == 1
    # the same values as a release in one call with the same generator
    again = PrivacyLedger()
    again.record_sample(sampling_probability=0.5)
    want = group.release(sums, num_records=3, ledger=again, generator=np.random.default_rng(4))
    for got_group, want_group in zip(out, want, strict=True):
        for got, expected in zip(got_group, want_group, strict=True):
            np.testing.assert_array_equal(got, expected)
    with (
        sampled_step(ledger, sampling_probability=0.5) as step,
        pytest.raises(InvalidParameterError, match="prepared"),
    ):
        step.commit(sums)  # type: ignore[arg-type]
