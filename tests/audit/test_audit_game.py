"""Tests of the distinguishing-game harness on a NumPy Gaussian mechanism."""

from __future__ import annotations

import functools
import json
import logging

import numpy as np
import pytest

from dpledger.audit import audit_game
from dpledger.audit.audit_game import GameScores, derive_run_seed, run_distinguishing_game
from dpledger.audit.threshold_selection import HeldOutSplit
from dpledger.audit.verdict import audit_verdict
from dpledger.errors import InvalidParameterError
from tests.audit import gaussian_mechanism as gm

DELTA = 1e-5
CLAIMED_EPSILON = gm.true_epsilon(noise_stddev=gm.CORRECT_NOISE, delta=DELTA)  # ≈ 1.99


def scores_of(game: GameScores) -> tuple[list[float], list[float]]:
    return list(game.scores_with_canary), list(game.scores_without_canary)


# ------------------------------------------------------------------ seeds


def test_run_seeds_come_from_seed_sequence():
    for include, side in ((True, 1), (False, 0)):
        for index in (0, 1, 17):
            ss = np.random.SeedSequence(42, spawn_key=(side, index))
            want = int(ss.generate_state(1, dtype=np.uint64)[0]) >> 1
            assert derive_run_seed(42, include_canary=include, index=index) == want
    seeds = {
        derive_run_seed(7, include_canary=inc, index=i) for inc in (True, False) for i in range(500)
    }
    assert len(seeds) == 1000  # no two runs share a seed
    assert all(0 <= s < 2**63 for s in seeds)
    with pytest.raises(InvalidParameterError):
        derive_run_seed(-1, include_canary=True, index=0)
    with pytest.raises(InvalidParameterError):
        derive_run_seed(0, include_canary=True, index=-1)


def test_runs_use_the_derived_seeds_and_are_reproducible():
    game = run_distinguishing_game(gm.noisy_sum, runs_per_side=5, seed=3)
    for i, run in enumerate(game.runs_with_canary):
        assert run.seed == derive_run_seed(3, include_canary=True, index=i)
        assert run.score == gm.noisy_sum(True, run.seed)
        assert run.include_canary and run.index == i
    again = run_distinguishing_game(gm.noisy_sum, runs_per_side=5, seed=3)
    assert scores_of(again) == scores_of(game)
    other = run_distinguishing_game(gm.noisy_sum, runs_per_side=5, seed=4)
    assert scores_of(other) != scores_of(game)


@pytest.mark.slow
def test_parallel_equals_serial():
    serial = run_distinguishing_game(gm.noisy_sum, runs_per_side=30, seed=11)
    parallel = run_distinguishing_game(
        gm.noisy_sum, runs_per_side=30, seed=11, workers=2, chunk_size=7
    )
    assert scores_of(parallel) == scores_of(serial)
    assert [r.seed for r in parallel.runs_without_canary] == [
        r.seed for r in serial.runs_without_canary
    ]


@pytest.mark.slow
def test_parallel_failure_propagates(tmp_path):
    path = tmp_path / "r.jsonl"
    with pytest.raises(RuntimeError, match="training failed"):
        run_distinguishing_game(gm.failing, runs_per_side=4, seed=0, workers=2, results_path=path)
    # The file is left valid (its header), so the audit can be resumed once the bug is fixed.
    assert json.loads(path.read_text().splitlines()[0])["seed"] == 0


# ------------------------------------------------------------------ results file and resume


def test_results_file_has_a_header_and_one_line_per_run(tmp_path):
    path = tmp_path / "audit.jsonl"
    game = run_distinguishing_game(gm.noisy_sum, runs_per_side=4, seed=5, results_path=path)
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    assert header["format"] == audit_game.RESULTS_FORMAT
    assert header["seed"] == 5
    assert header["train"] == "tests.audit.gaussian_mechanism.noisy_sum"
    records = [json.loads(x) for x in lines[1:]]
    assert len(records) == 8
    by_key = {(r["canary"], r["index"]): r["score"] for r in records}
    assert [by_key[(True, i)] for i in range(4)] == list(game.scores_with_canary)


def test_resume_after_interruption_runs_only_the_missing_runs(tmp_path):
    path = tmp_path / "audit.jsonl"
    n = 20
    # Fail on run 6 with the canary: runs are interleaved (with, without) by index, so the 12
    # runs of indices 0..5 are done when it fails.
    gm.CALLS.clear()
    gm.FAIL_ON_SEED["seed"] = derive_run_seed(9, include_canary=True, index=6)
    try:
        with pytest.raises(gm.InterruptedRunError):
            run_distinguishing_game(gm.logged_noisy_sum, runs_per_side=n, seed=9, results_path=path)
        assert len(gm.CALLS) == 12
        assert len(path.read_text().splitlines()) == 1 + 12
        gm.CALLS.clear()
        gm.FAIL_ON_SEED["seed"] = None
        resumed = run_distinguishing_game(
            gm.logged_noisy_sum, runs_per_side=n, seed=9, results_path=path
        )
        done_before = {(inc, derive_run_seed(9, include_canary=inc, index=i)) for i in range(6)
                       for inc in (True, False)}  # fmt: skip
        assert len(gm.CALLS) == 2 * n - 12
        assert not done_before & set(gm.CALLS)
    finally:
        gm.FAIL_ON_SEED["seed"] = None
        gm.CALLS.clear()
    uninterrupted = run_distinguishing_game(gm.noisy_sum, runs_per_side=n, seed=9)
    assert scores_of(resumed) == scores_of(uninterrupted)
    kwargs = {"delta": DELTA, "confidence": 0.95, "selection": HeldOutSplit(seed=1)}
    assert resumed.epsilon_lower_bound(**kwargs) == uninterrupted.epsilon_lower_bound(**kwargs)
    # A third call finds everything done and runs nothing.
    again = run_distinguishing_game(gm.logged_noisy_sum, runs_per_side=n, seed=9, results_path=path)
    assert gm.CALLS == []
    assert scores_of(again) == scores_of(uninterrupted)


def test_resume_extends_an_audit_to_more_runs(tmp_path):
    path = tmp_path / "audit.jsonl"
    small = run_distinguishing_game(gm.noisy_sum, runs_per_side=5, seed=2, results_path=path)
    large = run_distinguishing_game(gm.noisy_sum, runs_per_side=8, seed=2, results_path=path)
    assert list(large.scores_with_canary[:5]) == list(small.scores_with_canary)
    assert len(path.read_text().splitlines()) == 1 + 16
    # Asking for fewer runs than the file holds returns the first ones.
    fewer = run_distinguishing_game(gm.noisy_sum, runs_per_side=3, seed=2, results_path=path)
    assert scores_of(fewer) == scores_of(large.prefix(3))


def test_resume_drops_a_cut_short_final_line(tmp_path, caplog):
    path = tmp_path / "audit.jsonl"
    run_distinguishing_game(gm.noisy_sum, runs_per_side=3, seed=4, results_path=path)
    with open(path, "a") as fh:
        fh.write('{"canary":true,"index":3,"se')  # a crash in the middle of a write
    with caplog.at_level(logging.WARNING, logger="dpledger.audit.audit_game"):
        game = run_distinguishing_game(gm.noisy_sum, runs_per_side=4, seed=4, results_path=path)
    assert "cut-short final line" in caplog.text
    assert scores_of(game) == scores_of(
        run_distinguishing_game(gm.noisy_sum, runs_per_side=4, seed=4)
    )
    for line in path.read_text().splitlines():
        json.loads(line)  # every line is whole again


def test_resume_refuses_a_file_from_another_audit(tmp_path):
    path = tmp_path / "audit.jsonl"
    run_distinguishing_game(gm.noisy_sum, runs_per_side=2, seed=1, results_path=path)
    with pytest.raises(InvalidParameterError) as info:
        run_distinguishing_game(gm.noisy_sum, runs_per_side=2, seed=2, results_path=path)
    assert info.value.parameter == "seed"
    with pytest.raises(InvalidParameterError) as info:
        run_distinguishing_game(gm.buggy_noisy_sum, runs_per_side=2, seed=1, results_path=path)
    assert info.value.parameter == "train"
    other = tmp_path / "other.jsonl"
    other.write_text('{"format": "something else"}\n')
    with pytest.raises(InvalidParameterError) as info:
        run_distinguishing_game(gm.noisy_sum, runs_per_side=2, seed=1, results_path=other)
    assert info.value.parameter == "results_path"


def test_partial_training_functions_are_named_with_their_arguments(tmp_path):
    path = tmp_path / "audit.jsonl"
    train = functools.partial(gm.noisy_sum, noise_stddev=0.5)
    run_distinguishing_game(train, runs_per_side=2, seed=1, results_path=path)
    header = json.loads(path.read_text().splitlines()[0])
    assert "noise_stddev=0.5" in header["train"]
    with pytest.raises(InvalidParameterError):
        run_distinguishing_game(
            functools.partial(gm.noisy_sum, noise_stddev=0.6),
            runs_per_side=2,
            seed=1,
            results_path=path,
        )


def test_bad_arguments_and_bad_scores_are_refused():
    with pytest.raises(InvalidParameterError) as info:
        run_distinguishing_game(gm.nan_score, runs_per_side=2, seed=0)
    assert "return value" in info.value.parameter
    for kwargs, parameter in [
        ({"runs_per_side": 0, "seed": 0}, "runs_per_side"),
        ({"runs_per_side": 2, "seed": -1}, "seed"),
        ({"runs_per_side": 2, "seed": 0, "workers": 0}, "workers"),
        ({"runs_per_side": 2, "seed": 0, "chunk_size": 0}, "chunk_size"),
        ({"runs_per_side": 2, "seed": 0, "start_method": "teleport"}, "start_method"),
    ]:
        with pytest.raises(InvalidParameterError) as info:
            run_distinguishing_game(gm.noisy_sum, **kwargs)
        assert info.value.parameter == parameter
    with pytest.raises(InvalidParameterError):
        run_distinguishing_game("train", runs_per_side=2, seed=0)  # type: ignore[arg-type]


def test_progress_bar_when_asked(capsys):
    pytest.importorskip("tqdm", reason="tqdm (the audit extra) is not installed")
    run_distinguishing_game(gm.noisy_sum, runs_per_side=3, seed=0, progress=True)
    assert "audit runs" in capsys.readouterr().err
    run_distinguishing_game(gm.noisy_sum, runs_per_side=3, seed=0, progress=False)
    assert capsys.readouterr().err == ""


def test_prefix_and_bound_versus_runs():
    game = run_distinguishing_game(gm.buggy_noisy_sum, runs_per_side=100, seed=0)
    with pytest.raises(InvalidParameterError):
        game.prefix(101)
    curve = game.bound_versus_runs(
        [20, 50, 100], delta=DELTA, confidence=0.95, selection=HeldOutSplit()
    )
    assert [n for n, _ in curve] == [20, 50, 100]
    eps = [b.epsilon for _, b in curve]
    # Perfect separation: each bound is the Clopper–Pearson ceiling of its evaluation half.
    assert eps == sorted(eps) and eps[0] > 0
    for n, b in curve:
        assert b.counts["tp"] + b.counts["fn"] == n - n // 2


# ------------------------------------------------------------------ the audit itself


@pytest.mark.statistical
@pytest.mark.parametrize("method", ["clopper_pearson", "gaussian_dp"])
def test_audit_of_a_correct_gaussian_mechanism_never_exceeds_its_epsilon(method):
    for seed in range(5):
        game = run_distinguishing_game(gm.noisy_sum, runs_per_side=500, seed=seed)
        bound = game.epsilon_lower_bound(
            delta=DELTA, confidence=0.95, selection=HeldOutSplit(seed=seed), method=method
        )
        assert bound.epsilon <= CLAIMED_EPSILON
        assert audit_verdict(bound, CLAIMED_EPSILON, claimed_delta=DELTA).consistent


@pytest.mark.statistical
@pytest.mark.parametrize("method", ["clopper_pearson", "gaussian_dp"])
def test_audit_refutes_the_mechanism_with_ten_times_too_little_noise(method):
    for seed in range(3):
        game = run_distinguishing_game(gm.buggy_noisy_sum, runs_per_side=500, seed=seed)
        bound = game.epsilon_lower_bound(
            delta=DELTA, confidence=0.95, selection=HeldOutSplit(seed=seed), method=method
        )
        verdict = audit_verdict(bound, CLAIMED_EPSILON, claimed_delta=DELTA)
        assert verdict.refuted
        assert bound.epsilon > CLAIMED_EPSILON
        assert "claim refuted at confidence 1 − α = 0.95" in str(verdict)


def test_progress_reports_runs_rate_and_the_current_bound(caplog):
    """Without a terminal, progress is logged: runs done, runs/s and the bound given by
    ``progress_bound`` on the runs finished so far (here the mean-score gap, an exact oracle)."""
    seen = []

    def gap(s_in, s_out):
        seen.append((s_in.size, s_out.size))
        return float(s_in.mean() - s_out.mean())

    with caplog.at_level(logging.INFO, logger="dpledger.audit.audit_game"):
        game = run_distinguishing_game(
            gm.noisy_sum,
            runs_per_side=4,
            seed=1,
            progress=False,
            progress_bound=gap,
            progress_interval=0.0,
        )
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("audit runs")]
    assert lines[-1].startswith("audit runs: 8/8 done")
    assert "runs/s" in lines[-1]
    want = float(game.scores_with_canary.mean() - game.scores_without_canary.mean())
    assert f"bound ε ≥ {want:.3f}" in lines[-1]
    assert seen[-1] == (4, 4)
    with pytest.raises(InvalidParameterError, match="progress_bound"):
        run_distinguishing_game(gm.noisy_sum, runs_per_side=1, seed=0, progress_bound=3)


def test_bound_progress_reports_the_final_bound_of_the_game(caplog):
    """bound_progress(...) on all the runs is the game's own epsilon_lower_bound (same args)."""
    from dpledger.audit import bound_progress

    kwargs = {"delta": DELTA, "confidence": 0.95, "selection": HeldOutSplit(seed=2)}
    with caplog.at_level(logging.INFO, logger="dpledger.audit.audit_game"):
        game = run_distinguishing_game(
            gm.buggy_noisy_sum,
            runs_per_side=30,
            seed=4,
            progress=False,
            progress_bound=bound_progress(**kwargs),
            progress_interval=0.0,
        )
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("audit runs")]
    want = game.epsilon_lower_bound(**kwargs).epsilon
    assert want > 0
    assert lines[-1].endswith(f"bound ε ≥ {want:.3f}")
    # Too few runs for a held-out split: the progress shows no bound instead of failing.
    assert "bound" not in lines[0]
