"""The DP step written once in the core (:mod:`dpledger.mechanisms.dp_step`), on NumPy arrays.

Oracles: closed forms (flat clip factors min(1, S(1 − ρ)/‖v‖), the fixed-denominator average
sum/(q·n) and sum/b), the ledger's own events, and the file's lines read back with ``open()``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dpledger import PrivacyLedger
from dpledger.errors import InvalidParameterError
from dpledger.ledger import SamplingEvent
from dpledger.mechanisms.backend import NoiseOrder, NumpyBackend, SummaryBackend, SumSummary
from dpledger.mechanisms.dp_step import DPStep
from dpledger.mechanisms.gradient_queries import GradientQueries
from dpledger.mechanisms.step import StepEvents
from dpledger.mechanisms.sum_query_checks import SensitivityCheckError

SIZES = {"a.w": 3, "a.b": 1, "b.w": 2}
LAYERS = {"a.w": "a", "a.b": "a", "b.w": "b"}


def _queries(**kwargs: object) -> GradientQueries:
    kwargs.setdefault("l2_norm_bound", 1.0)
    kwargs.setdefault("noise_multiplier", 0.0)
    return GradientQueries(SIZES, layers=LAYERS, **kwargs)  # type: ignore[arg-type]


def _flat_sums(rng: np.random.Generator, count: int, bound: float) -> list[list[np.ndarray]]:
    """One group of clipped sums, |R| = ``count`` records each of norm ≤ ``bound``."""
    records = rng.normal(size=(count, 6))
    records *= np.minimum(1.0, bound / np.linalg.norm(records, axis=1))[:, None]
    return [[records.sum(axis=0)]]


def test_release_records_the_event_then_one_query_and_averages_by_its_denominator() -> None:
    ledger = PrivacyLedger()
    step = DPStep(_queries(l2_norm_bound=2.0), ledger=ledger)
    sums = _flat_sums(np.random.default_rng(0), 5, 2.0)
    fixed = SamplingEvent.fixed_size(4, 100)
    poisson = SamplingEvent.poisson(0.05, 100)
    for event, denominator in ((fixed, 4.0), (poisson, 0.05 * 100)):
        (average,) = step.release(
            sums,
            num_records=5,
            event=event,
            backend=NumpyBackend(),
            generator=np.random.default_rng(9),
        )
        # z = 0: no noise; the average multiplies by 1/denominator (two roundings at most)
        np.testing.assert_allclose(average, sums[0][0] / denominator, rtol=2.0**-51, atol=0)
    steps = list(ledger.steps())
    assert [s.sampling for s in steps] == [fixed, poisson]
    assert [[(q.l2_norm_bound, q.noise_stddev, q.label) for q in s.queries] for s in steps] == [
        [(2.0, 0.0, "gradient")]
    ] * 2


def test_a_refused_step_records_nothing_and_names_records_with_non_finite_norms() -> None:
    ledger = PrivacyLedger()
    step = DPStep(_queries(), ledger=ledger)
    too_long = [[np.full(6, 10.0)]]  # |R|·S = 1 < ‖sum‖
    with pytest.raises(SensitivityCheckError):
        step.release(
            too_long, num_records=1, event=SamplingEvent.poisson(0.1, 10), backend=NumpyBackend()
        )
    nan = [[np.full(6, np.nan)]]
    with pytest.raises(InvalidParameterError, match="2 record"):
        step.release(
            nan,
            num_records=3,
            event=SamplingEvent.poisson(0.1, 10),
            backend=NumpyBackend(),
            bad_records=lambda: 2,
        )
    assert ledger.num_events == 0


def test_the_events_are_in_the_file_before_the_noisy_sums_return(tmp_path: Path) -> None:
    path = tmp_path / "run.dpl"
    with PrivacyLedger(path) as ledger:
        step = DPStep(_queries(noise_multiplier=1.0), ledger=ledger)
        step.noise(
            _flat_sums(np.random.default_rng(1), 3, 1.0),
            num_records=3,
            event=SamplingEvent.shuffle(3, 30),
            backend=NumpyBackend(),
            generator=np.random.default_rng(2),
        )
        with open(path, encoding="utf-8") as fp:
            lines = [json.loads(line) for line in fp.read().splitlines()[1:]]
    assert [line["kind"] for line in lines][:2] == ["sample", "sum_query"]


def test_clip_factors_are_the_flat_closed_form_per_group_with_the_margin() -> None:
    step = DPStep(_queries(groups="per_layer"), ledger=None, margins=0.25)
    rng = np.random.default_rng(3)
    squared = [rng.uniform(0.0, 2.0, size=7) for _ in SIZES]
    factors = step.clip_factors(squared)
    bound = 1.0 / np.sqrt(2.0) * 0.75  # S_g = C/√G, clipped to S_g(1 − ρ)
    for got, members in zip(factors, ([0, 1], [2]), strict=True):
        norms = np.sqrt(sum(squared[j] for j in members))
        np.testing.assert_allclose(got, np.minimum(1.0, bound / norms), rtol=1e-15)
    host = step.factors_of_norms(np.array([[np.inf, 4.0], [1.0, np.nan]]))
    np.testing.assert_allclose(host, [[1.0, bound / 4.0], [min(1.0, bound), 1.0]])


def test_factor_layout_weights_scaled_members_and_bounds_with_margins() -> None:
    queries = _queries(groups="per_layer", scales={"a.w": 2.0, "a.b": 1.0})
    step = DPStep(queries, ledger=None, margins=(0.1, 0.0))
    weights, bounds, mixed = step.factor_layout(["b.w", "a.w", "a.b"])
    np.testing.assert_array_equal(weights, [[0.0, 0.25, 1.0], [1.0, 0.0, 0.0]])
    s = [q.l2_norm_bound for q in queries.queries]
    np.testing.assert_array_equal(bounds, [[s[0] * 0.9], [s[1]]])
    assert mixed is False


def test_claim_reads_the_sampler_or_the_events_at_a_position_or_counted() -> None:
    class Sampler:
        epoch_based = True
        steps_per_epoch = 3
        sampling_event = SamplingEvent.shuffle(2, 6)

        def event_for_step(self, step: int) -> SamplingEvent:
            return SamplingEvent.shuffle(2, 6, epoch_start=step == 0)

        def claim_draw(self, num_records: int) -> SamplingEvent:
            return SamplingEvent.fixed_size(num_records, 6)

    step = DPStep(_queries(), ledger=None, events=StepEvents(Sampler.sampling_event, Sampler()))
    starts = [step.claim(2).epoch_start for _ in range(4)]
    assert starts == [True, False, False, True]
    assert step.claim(2, position=3).epoch_start is True
    assert step.claim(2, position=-1).epoch_start is False  # counted on from position 3
    assert step.claim(5, sampler=Sampler()) == SamplingEvent.fixed_size(5, 6)
    with pytest.raises(InvalidParameterError, match="sampler"):
        DPStep(_queries(), ledger=None).claim(2)


def test_set_values_and_set_queries_check_their_arguments() -> None:
    step = DPStep(_queries(groups="per_layer"), ledger=None)
    step.set_values(l2_norm_bound=3.0, noise_multiplier=0.5)
    assert (step.queries.l2_norm_bound, step.queries.noise_multiplier) == (3.0, 0.5)
    assert step.queries.grouped.effective_noise_multiplier == pytest.approx(0.5, rel=1e-12)
    built = step.queries
    step.set_values(l2_norm_bound=1.0, noise_multiplier=0.0)
    step.set_values(l2_norm_bound=3.0, noise_multiplier=0.5)
    assert step.queries is built  # kept built
    for bad in ({"l2_norm_bound": 0.0}, {"noise_multiplier": -1.0}):
        values = {"l2_norm_bound": 1.0, "noise_multiplier": 1.0, **bad}
        with pytest.raises(InvalidParameterError, match=next(iter(bad))):
            step.set_values(**values)
    with pytest.raises(InvalidParameterError, match="same groups"):
        step.set_queries(_queries())
    with pytest.raises(InvalidParameterError, match="margins"):
        DPStep(_queries(groups="per_layer"), ledger=None, margins=(0.1, 0.1, 0.1))
    with pytest.raises(InvalidParameterError, match="clip_margin"):
        DPStep(_queries(), ledger=None, margins=0.5)
    with pytest.raises(InvalidParameterError, match="ledger"):
        DPStep(_queries(), ledger=None).noise(
            [[np.zeros(6)]],
            num_records=0,
            event=SamplingEvent.poisson(0.1, 10),
            backend=NumpyBackend(),
        )


def test_a_release_on_summaries_returns_the_recorded_noise_orders() -> None:
    ledger = PrivacyLedger()
    queries = _queries(groups="per_layer", noise_multiplier=2.0)
    step = DPStep(queries, ledger=ledger)
    summary = SumSummary(norm=0.5, shape=(4,), eps=2.0**-52, tiny=2.0**-1022)
    orders = step.noise(
        [[summary], [summary]],
        num_records=1,
        event=SamplingEvent.poisson(0.1, 10),
        backend=SummaryBackend(),
    )
    stddevs = [o.stddev for group in orders for o in group]
    assert all(isinstance(o, NoiseOrder) for group in orders for o in group)
    assert stddevs == [q.noise_stddev for q in queries.queries]
    assert [q.noise_stddev for q in next(iter(ledger.steps())).queries] == stddevs
