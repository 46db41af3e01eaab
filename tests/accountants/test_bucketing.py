"""Bucketing: conservative rounding keeps ε an upper bound, moves it little, collapses runs."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dpledger.accountants.bucketing import (
    bucket_noise_multiplier,
    bucket_sampling_probability,
    check_bucketing,
    conservative_buckets,
    maybe_bucket,
    optimistic_buckets,
)
from dpledger.accountants.gdp import GdpAccountant
from dpledger.accountants.pld import PldAccountant
from dpledger.accountants.rdp import RdpAccountant
from dpledger.errors import InvalidParameterError
from dpledger.ledger.steps import CompressedLedger

DELTA = 1e-5
R = 1e-3


@given(
    q=st.floats(min_value=1e-12, max_value=1.0),
    z=st.floats(min_value=1e-6, max_value=1e6),
    r=st.sampled_from([1e-4, 1e-3, 1e-2, 0.1]),
)
def test_grid_rounding_is_conservative_and_fine(q: float, z: float, r: float) -> None:
    q_up = bucket_sampling_probability(q, r)
    z_down = bucket_noise_multiplier(z, r)
    assert q <= q_up <= min(1.0, q * (1 + r) * (1 + 1e-12))
    assert z / ((1 + r) * (1 + 1e-12)) <= z_down <= z
    ledger = CompressedLedger.from_runs([(q, z, 1)])
    low = optimistic_buckets(ledger, relative_precision=r).runs[0]
    assert q / ((1 + r) * (1 + 1e-12)) <= low.sampling_probability <= q
    assert z <= low.noise_multiplier <= z * (1 + r) * (1 + 1e-12)


def _schedule(n: int, q: float = 0.01, steps: int = 1) -> CompressedLedger:
    return CompressedLedger.from_runs([(q, float(z), steps) for z in np.linspace(0.8, 2.0, n)])


@pytest.mark.parametrize(
    "ledger",
    [
        _schedule(2000),
        _schedule(300, q=0.2, steps=3),
        CompressedLedger.from_runs([(float(q), 1.0, 5) for q in np.geomspace(1e-4, 0.5, 500)]),
        CompressedLedger.from_runs([(256 / 60000, 1.1, 14062)]),
    ],
)
def test_bucketed_rdp_is_an_upper_bound_within_one_percent(ledger: CompressedLedger) -> None:
    plain = RdpAccountant().epsilon(ledger, delta=DELTA).epsilon
    bucketed = RdpAccountant(bucketing=R).epsilon(ledger, delta=DELTA)
    assert plain <= bucketed.epsilon <= 1.01 * plain
    assert bucketed.settings["bucketing"] == R
    assert len(conservative_buckets(ledger, relative_precision=R).distinct()) <= len(
        ledger.distinct()
    )


def test_bucketing_collapses_a_noise_schedule() -> None:
    ledger = _schedule(20_000)
    buckets = conservative_buckets(ledger, relative_precision=R)
    assert len(buckets.distinct()) <= math.ceil(math.log(2.0 / 0.8) / math.log1p(R)) + 1
    assert buckets.num_steps == ledger.num_steps
    assert buckets.prefix(777) == conservative_buckets(ledger.prefix(777), relative_precision=R)


def test_bucketed_pld_and_gdp_are_at_least_the_plain_values() -> None:
    ledger = _schedule(6, q=0.02, steps=30)
    plain = PldAccountant(value_discretization_interval=1e-3).epsilon(ledger, delta=DELTA).epsilon
    bucketed = PldAccountant(value_discretization_interval=1e-3, bucketing=R).epsilon(
        ledger, delta=DELTA
    )
    assert plain <= bucketed.epsilon <= 1.01 * plain
    g_plain = GdpAccountant(lower_bound=False).epsilon(ledger, delta=DELTA).epsilon
    g_bucketed = GdpAccountant(lower_bound=False, bucketing=R).epsilon(ledger, delta=DELTA).epsilon
    assert g_plain <= g_bucketed <= 1.01 * g_plain


def test_maybe_bucket_and_setting_validation() -> None:
    ledger = _schedule(5)
    assert maybe_bucket(ledger, None) is ledger
    assert maybe_bucket(ledger, R) == conservative_buckets(ledger, relative_precision=R)
    assert check_bucketing(None) is None and check_bucketing(1e-3) == 1e-3
    for bad in (0.0, 1.0, -1.0, True, "0.01", math.nan):
        with pytest.raises(InvalidParameterError, match="bucketing"):
            check_bucketing(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError, match="relative_precision"):
        optimistic_buckets(ledger, relative_precision=0.0)


def test_special_values_are_kept() -> None:
    ledger = CompressedLedger.from_runs([(0.0, 1.0, 1), (1.0, math.inf, 1), (0.5, 0.0, 1)])
    for view in (
        conservative_buckets(ledger, relative_precision=R),
        optimistic_buckets(ledger, relative_precision=R),
    ):
        assert [(r.sampling_probability, r.noise_multiplier) for r in view.runs][:2] == [
            (0.0, view.runs[0].noise_multiplier),
            (1.0, math.inf),
        ]
        assert view.runs[2].noise_multiplier == 0.0
