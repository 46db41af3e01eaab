"""Write-ahead: a release's events are in the ledger file before its output can be applied.

Every test keeps the ledger's default buffering (``buffer_size=1024``, ``flush_interval=1.0``)
and reads the file through a separate ``open()`` right after the call, before any later call on
the ledger.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dpledger import PrivacyLedger
from dpledger.mechanisms import (
    AdaptiveClipping,
    GaussianSumQuery,
    GroupedSumQuery,
    sampled_step,
)
from dpledger.mechanisms.correlated import (
    CorrelatedNoiseRelease,
    ParticipationSchema,
    optimize_banded_toeplitz,
)
from tests.killed_runs import run_until_killed

HERE = Path(__file__).resolve().parent
QUERY = GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=1.0, label="w")


def on_disk(path: Path) -> list[dict]:
    """The event and marker lines the file holds now (the header left out)."""
    with open(path, encoding="utf-8") as fp:
        return [json.loads(line) for line in fp.read().splitlines()[1:]]


def kinds(path: Path) -> list[str]:
    """The kinds of the event lines on disk (the notes, e.g. the noise's provenance, are no
    events)."""
    return [line["kind"] for line in on_disk(path) if line["kind"] != "note"]


@pytest.mark.parametrize("steps", [7, 23, 41])
def test_a_loop_killed_after_saving_its_parameters_keeps_every_applied_step(
    tmp_path: Path, steps: int
) -> None:
    ledger_path, weights = tmp_path / "run.dpl", tmp_path / "theta.npy"
    run_until_killed(
        HERE / "killed_after_checkpoint.py", str(ledger_path), str(weights), str(steps)
    )
    assert np.load(weights).shape == (3,)  # the checkpoint was saved
    ledger = PrivacyLedger.load(ledger_path)
    assert ledger.num_steps == steps  # each step was written before theta changed
    assert [len(s.queries) for s in ledger.steps()] == [1] * steps


def test_run_and_release_write_the_step_before_they_return(tmp_path: Path) -> None:
    path = tmp_path / "run.dpl"
    rng = np.random.default_rng(0)
    with PrivacyLedger(path) as ledger:
        for taken in range(1, 4):
            with sampled_step(
                ledger, sampling_probability=0.1, population_size=100, generator=rng
            ) as step:
                step.run(QUERY, np.ones((9, 3)))
                assert kinds(path)[-2:] == ["sample", "sum_query"]
                step.release(QUERY, [np.ones(3)], num_records=9)
                assert kinds(path).count("sum_query") == 2 * taken
        assert kinds(path) == ["sample", "sum_query", "sum_query"] * 3


def test_a_grouped_release_writes_all_its_groups_before_it_returns(tmp_path: Path) -> None:
    group = GroupedSumQuery(
        [
            GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=2.0, label="kernel"),
            GaussianSumQuery(l2_norm_bound=0.5, noise_stddev=1.0, label="bias"),
        ]
    )
    path = tmp_path / "run.dpl"
    rng = np.random.default_rng(1)
    with PrivacyLedger(path) as ledger:
        with sampled_step(ledger, sampling_probability=0.1, generator=rng) as step:
            step.run(group, [[np.ones((5, 4))], [np.ones((5, 1))]])
        assert [(line["kind"], line.get("label")) for line in on_disk(path)] == [
            ("note", None),  # the noise's provenance, written before the step
            ("sample", None),
            ("sum_query", "kernel"),
            ("sum_query", "bias"),
        ]
        with sampled_step(ledger, sampling_probability=0.1, generator=rng) as step:
            prepared = group.prepare([[np.zeros(4)], [np.zeros(1)]], num_records=0)
            step.commit(prepared)
        assert kinds(path).count("sum_query") == 4


def test_adaptive_clipping_writes_its_query_and_count_before_it_returns(tmp_path: Path) -> None:
    adaptive = AdaptiveClipping(
        initial_l2_norm_bound=1.0,
        target_unclipped_quantile=0.5,
        noise_multiplier=1.0,
        count_noise_stddev=5.0,
        expected_batch_size=10.0,
    )
    path = tmp_path / "run.dpl"
    with (
        PrivacyLedger(path) as ledger,
        sampled_step(
            ledger, sampling_probability=0.1, population_size=100, generator=np.random.default_rng()
        ) as step,
    ):
        step.run(adaptive, np.ones((8, 2)))
        assert kinds(path) == ["sample", "sum_query", "sum_query"]


def test_a_correlated_release_writes_the_release_and_each_stream_step_first(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run.dpl"
    with PrivacyLedger(path) as ledger:
        release = CorrelatedNoiseRelease(
            ledger,
            optimize_banded_toeplitz(num_steps=6, bands=2),
            ParticipationSchema.cyclic(num_steps=6, period=3),
            l2_norm_bound=1.0,
            noise_stddev=2.0,
            dim=2,
        )
        assert kinds(path) == ["correlated_release"]
        release.release(np.ones((3, 2)))
        assert kinds(path) == ["correlated_release", "stream_step"]
        release.next_noise()
        assert [line.get("step") for line in on_disk(path)[2:]] == [0, 1]  # after the note


def test_events_recorded_directly_are_written_at_a_flush(tmp_path: Path) -> None:
    """Recording without a mechanism batches (buffer_size, flush_interval) until flush()."""
    path = tmp_path / "run.dpl"
    with PrivacyLedger(path, flush_interval=3600.0) as ledger:
        ledger.record_sample(sampling_probability=0.1)
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0)
        assert kinds(path) == []
        ledger.flush()
        assert kinds(path) == ["sample", "sum_query"]
