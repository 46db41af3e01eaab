"""Steps, the effective noise multiplier (paper Eq. 1) and the run-length view."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpledger import InvalidParameterError, PrivacyLedger
from dpledger.errors import LedgerStateError
from dpledger.ledger import StepRun
from dpledger.ledger.steps import (
    CompressedLedger,
    noise_multiplier_from_inverse_square_sum,
    step_noise_multiplier,
)


def test_z_eff_of_several_groups_against_hand_computation() -> None:
    # Three groups: (S, σ̃) = (1, 2), (2, 2), (0.5, 1):
    # Σ (S/σ̃)² = 0.25 + 1 + 0.25 = 1.5, z_eff = 1.5^(-1/2) = 0.8164965809277260...
    ledger = PrivacyLedger()
    ledger.record_sample(sampling_probability=0.02, population_size=5000)
    ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=2.0, label="a")
    ledger.record_sum_query(l2_norm_bound=2.0, noise_stddev=2.0, label="b")
    ledger.record_sum_query(l2_norm_bound=0.5, noise_stddev=1.0, label="c")
    (step,) = ledger.steps()
    assert step.noise_multiplier == pytest.approx(0.8164965809277260, rel=1e-15)
    assert ledger.runs() == (StepRun(0.02, step.noise_multiplier, 1),)


def test_proportional_allocation_gives_back_the_target_multiplier() -> None:
    # Paper: σ̃_g = z·√G·S_g for G groups gives z_eff = z. With z = 1.1, G = 4:
    z, bounds = 1.1, [0.1, 1.0, 3.0, 0.25]
    sigmas = [z * math.sqrt(len(bounds)) * s for s in bounds]
    assert step_noise_multiplier(zip(bounds, sigmas, strict=True)) == pytest.approx(z, rel=1e-14)


def test_single_query_is_exactly_sigma_over_s() -> None:
    assert step_noise_multiplier([(3.0, 0.3)]) == 0.3 / 3.0  # not 1/sqrt((3/0.3)**2)
    assert step_noise_multiplier([]) == math.inf
    assert step_noise_multiplier([(1.0, 1.0), (1.0, 0.0)]) == 0.0
    assert noise_multiplier_from_inverse_square_sum(0.0, 0) == math.inf
    assert noise_multiplier_from_inverse_square_sum(math.inf, 3) == 0.0
    assert noise_multiplier_from_inverse_square_sum(4.0, 2) == 0.5


def test_compressed_view_with_different_q_and_special_steps() -> None:
    ledger = PrivacyLedger()
    for _ in range(3):  # q = 0.01, z = 1 (two groups of z = √2 each)
        ledger.record_sample(sampling_probability=0.01)
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=math.sqrt(2.0))
        ledger.record_sum_query(l2_norm_bound=2.0, noise_stddev=2.0 * math.sqrt(2.0))
    for _ in range(2):  # q = 0.05, z = 0.5
        ledger.record_sample(sampling_probability=0.05)
        ledger.record_sum_query(l2_norm_bound=2.0, noise_stddev=1.0)
    ledger.record_sample(sampling_probability=0.05)  # a step without queries: z = ∞
    ledger.record_sample(sampling_probability=0.05)  # σ̃ = 0: z = 0, not private
    ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=0.0)
    ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=5.0)
    for _ in range(4):
        ledger.record_sample(sampling_probability=0.01)
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=math.sqrt(2.0))
        ledger.record_sum_query(l2_norm_bound=2.0, noise_stddev=2.0 * math.sqrt(2.0))
    runs = ledger.runs()
    assert [(r.sampling_probability, r.count) for r in runs] == [
        (0.01, 3),
        (0.05, 2),
        (0.05, 1),
        (0.05, 1),
        (0.01, 4),
    ]
    z = [r.noise_multiplier for r in runs]
    assert z[0] == pytest.approx(1.0, rel=1e-15) and z[4] == z[0]
    assert z[1] == 0.5 and z[2] == math.inf and z[3] == 0.0
    assert [r.is_private for r in runs] == [True, True, True, False, True]
    assert [r.releases_nothing for r in runs] == [False, False, True, False, False]
    comp = ledger.compressed()
    assert comp.num_steps == ledger.num_steps == 11
    assert comp.distinct() == {(0.01, z[0]): 7, (0.05, 0.5): 2, (0.05, math.inf): 1, (0.05, 0.0): 1}
    assert list(comp.prefix(4)) == [runs[0], StepRun(0.05, 0.5, 1)]
    assert comp.prefix(0).runs == () and comp.prefix(11) == comp


def test_runs_include_the_open_step_and_update_as_it_grows() -> None:
    ledger = PrivacyLedger()
    ledger.record_sample(sampling_probability=0.1)
    assert ledger.runs() == (StepRun(0.1, math.inf, 1),)
    ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=2.0)
    assert ledger.runs() == (StepRun(0.1, 2.0, 1),)
    ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=2.0)
    assert ledger.runs()[0].noise_multiplier == pytest.approx(2.0 / math.sqrt(2.0), rel=1e-15)


def test_step_accessors() -> None:
    ledger = PrivacyLedger()
    ledger.record_sample(sampling_probability=0.5, population_size=10)
    ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=3.0, label="g")
    ledger.record_sample(sampling_probability=1.0)
    steps = list(ledger.steps())
    assert [s.index for s in steps] == [0, 1]
    assert steps[0].sampling_probability == 0.5 and steps[0].population_size == 10
    assert steps[0].queries[0].label == "g" and steps[0].noise_multiplier == 3.0
    assert steps[1].population_size is None and steps[1].queries == ()


def test_compressed_ledger_merges_adjacent_equal_runs() -> None:
    comp = CompressedLedger.from_runs([(0.1, 1.0, 2), StepRun(0.1, 1.0, 3), (0.2, 1.0, 1)])
    assert comp.runs == (StepRun(0.1, 1.0, 5), StepRun(0.2, 1.0, 1))
    assert len(comp) == 2 and comp.num_steps == 6


@pytest.mark.parametrize(
    ("runs", "parameter"),
    [
        ([(1.5, 1.0, 1)], "sampling_probability"),
        ([(0.1, -1.0, 1)], "noise_multiplier"),
        ([(0.1, math.nan, 1)], "noise_multiplier"),
        ([(0.1, "1", 1)], "noise_multiplier"),
        ([(0.1, 1.0, 0)], "count"),
        ([(0.1, 1.0, 2.0)], "count"),
        ([(0.1, 1.0)], "runs[0]"),
        ([0.1], "runs[0]"),
        (5, "runs"),
    ],
)
def test_compressed_ledger_refuses(runs, parameter) -> None:
    with pytest.raises(InvalidParameterError) as info:
        CompressedLedger.from_runs(runs)
    assert info.value.parameter == parameter


def test_compressed_ledger_refuses_bad_relation_and_prefix() -> None:
    with pytest.raises(InvalidParameterError, match="neighboring='both'"):
        CompressedLedger.from_runs([], neighboring="both")
    comp = CompressedLedger.from_runs([(0.1, 1.0, 3)])
    for bad in (-1, 4, 1.0, True):
        with pytest.raises(InvalidParameterError, match="num_steps"):
            comp.prefix(bad)


def test_steps_and_events_need_kept_events(small_file) -> None:
    ledger = PrivacyLedger.load(small_file, keep_events=False)
    with pytest.raises(LedgerStateError, match="keep_events=True"):
        list(ledger.steps())
    with pytest.raises(LedgerStateError):
        list(ledger.events())
    assert ledger.runs() == PrivacyLedger.load(small_file).runs()


# ---------------------------------------------------------------------------- properties
QS = st.sampled_from([0.0, 0.01, 0.01 + 1e-17, 0.02, 0.5, 1.0])
QUERIES = st.tuples(
    st.sampled_from([0.1, 1.0, 2.0, 1e-200, 1e200]),
    st.sampled_from([0.0, 0.5, 1.0, 3.0, 1e-200, 1e200]),
)
STEPS = st.lists(st.tuples(QS, st.lists(QUERIES, max_size=4)), max_size=40)


def _hand_z(queries: list[tuple[float, float]]) -> float:
    if not queries:
        return math.inf
    if len(queries) == 1:
        s, sigma = queries[0]
        return sigma / s
    if any(sigma == 0.0 for _, sigma in queries):
        return 0.0
    total = math.fsum((s / sigma) * (s / sigma) for s, sigma in queries)
    return math.inf if total == 0.0 else 1.0 / math.sqrt(total)


@settings(max_examples=150, deadline=None)
@given(steps=STEPS)
def test_runs_equal_a_recomputation_from_steps(steps) -> None:
    ledger = PrivacyLedger()
    for q, queries in steps:
        ledger.record_sample(sampling_probability=q)
        for s, sigma in queries:
            ledger.record_sum_query(l2_norm_bound=s, noise_stddev=sigma)
    recorded = list(ledger.steps())
    assert len(recorded) == len(steps) == ledger.num_steps
    keys = [(step.sampling_probability, step.noise_multiplier) for step in recorded]
    expected = tuple(
        StepRun(q, z, sum(1 for _ in group)) for (q, z), group in itertools.groupby(keys)
    )
    assert ledger.runs() == expected
    assert ledger.compressed().num_steps == len(steps)
    for step, (_, queries) in zip(recorded, steps, strict=True):
        hand = _hand_z(queries)
        if len(queries) <= 1 or math.isinf(hand) or hand == 0.0:
            assert step.noise_multiplier == hand
        else:
            assert step.noise_multiplier == pytest.approx(hand, rel=1e-14)
