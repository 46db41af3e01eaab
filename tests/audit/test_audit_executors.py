"""The distinguishing game on any ``concurrent.futures.Executor``: a process pool, a thread pool
and a Dask cluster give the same scores for the same master seed, share one results file format,
and resume after a worker dies mid-run.

The oracle is the inline (``workers=1``) game: every run's score is ``noisy_sum(b, seed)`` with the
seed derived from the master seed, whatever executor ran it.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import json
import multiprocessing

import pytest

from dpledger.audit.audit_game import (
    GameInterruptedError,
    derive_run_seed,
    run_distinguishing_game,
)
from tests.audit import executor_training as et
from tests.audit import gaussian_mechanism as gm

RUNS = 12
SEED = 2024


def scores(game):
    return list(game.scores_with_canary), list(game.scores_without_canary)


@pytest.fixture(scope="module")
def inline_game():
    return run_distinguishing_game(gm.noisy_sum, runs_per_side=RUNS, seed=SEED)


@pytest.fixture(scope="module")
def dask_client():
    """Two Dask worker processes on this machine (one thread each), shut down after the module.

    ``allowed-failures`` is 0 so that a killed worker surfaces as a lost run (KilledWorker) instead
    of being retried silently by the scheduler.
    """
    dask = pytest.importorskip("dask", reason="Dask is the optional extra dpledger[dask]")
    distributed = pytest.importorskip("distributed")
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        cluster = distributed.LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            silence_logs=50,
        )
        client = distributed.Client(cluster)
    try:
        yield client
    finally:
        client.close()
        cluster.close()


def _check_file(path, game):
    lines = path.read_text().splitlines()
    assert json.loads(lines[0])["seed"] == SEED
    runs = [json.loads(line) for line in lines[1:]]
    assert len(runs) == 2 * RUNS
    by_key = {(r["canary"], r["index"]): r["score"] for r in runs}
    assert [by_key[(True, i)] for i in range(RUNS)] == list(game.scores_with_canary)
    assert [by_key[(False, i)] for i in range(RUNS)] == list(game.scores_without_canary)


@pytest.mark.slow
def test_process_pool_executor_gives_the_inline_scores(tmp_path, inline_game):
    ctx = multiprocessing.get_context("spawn")
    path = tmp_path / "pool.jsonl"
    with cf.ProcessPoolExecutor(max_workers=2, mp_context=ctx) as pool:
        game = run_distinguishing_game(
            gm.noisy_sum, runs_per_side=RUNS, seed=SEED, executor=pool, chunk_size=3,
            results_path=path,
        )  # fmt: skip
    assert scores(game) == scores(inline_game)
    _check_file(path, game)


def test_thread_pool_executor_gives_the_inline_scores(tmp_path, inline_game):
    path = tmp_path / "threads.jsonl"
    with cf.ThreadPoolExecutor(max_workers=3) as pool:
        game = run_distinguishing_game(
            gm.noisy_sum, runs_per_side=RUNS, seed=SEED, executor=pool, results_path=path
        )
        # The executor is used, not shut down: it still takes work.
        assert pool.submit(int, "7").result() == 7
    assert scores(game) == scores(inline_game)
    _check_file(path, game)


@pytest.mark.slow
def test_dask_executor_gives_the_inline_scores(tmp_path, inline_game, dask_client):
    path = tmp_path / "dask.jsonl"
    game = run_distinguishing_game(
        gm.noisy_sum,
        runs_per_side=RUNS,
        seed=SEED,
        executor=dask_client.get_executor(),
        chunk_size=2,
        results_path=path,
    )
    assert scores(game) == scores(inline_game)
    assert [r.seed for r in game.runs_with_canary] == [
        derive_run_seed(SEED, include_canary=True, index=i) for i in range(RUNS)
    ]
    _check_file(path, game)


def test_a_file_written_on_one_executor_resumes_on_another(tmp_path, inline_game, dask_client):
    path = tmp_path / "mixed.jsonl"
    run_distinguishing_game(gm.noisy_sum, runs_per_side=RUNS // 2, seed=SEED, results_path=path)
    with cf.ThreadPoolExecutor(max_workers=2) as pool:
        run_distinguishing_game(
            gm.noisy_sum, runs_per_side=RUNS - 2, seed=SEED, executor=pool, results_path=path
        )
    game = run_distinguishing_game(
        gm.noisy_sum,
        runs_per_side=RUNS,
        seed=SEED,
        executor=dask_client.get_executor(),
        results_path=path,
    )
    assert scores(game) == scores(inline_game)
    _check_file(path, game)


def _killed_worker_then_resume(tmp_path, inline_game, make_executor):
    """A run kills its worker: the game raises GameInterruptedError, the file holds exactly the
    finished runs (with their correct scores), and a second call completes the game with the
    scores of an uninterrupted one."""
    path = tmp_path / "killed.jsonl"
    fatal_seed = derive_run_seed(SEED, include_canary=True, index=RUNS // 2)
    train = functools.partial(et.dies_once, marker=str(tmp_path / "marker"), fatal_seed=fatal_seed)
    with make_executor() as executor, pytest.raises(GameInterruptedError) as err:
        run_distinguishing_game(
            train, runs_per_side=RUNS, seed=SEED, executor=executor, results_path=path
        )
    assert (tmp_path / "marker").exists()
    assert err.value.missing >= 1
    assert err.value.finished + err.value.missing == 2 * RUNS
    lines = path.read_text().splitlines()
    kept = [json.loads(line) for line in lines[1:]]
    assert len(kept) == err.value.finished
    for run in kept:
        side = (
            inline_game.scores_with_canary if run["canary"] else inline_game.scores_without_canary
        )
        assert run["score"] == side[run["index"]]
        assert run["seed"] != fatal_seed
    with make_executor() as executor:
        resumed = run_distinguishing_game(
            train, runs_per_side=RUNS, seed=SEED, executor=executor, results_path=path
        )
    assert scores(resumed) == scores(inline_game)
    assert len(path.read_text().splitlines()) == 1 + 2 * RUNS


@pytest.mark.slow
def test_resume_after_a_killed_process_pool_worker(tmp_path, inline_game):
    ctx = multiprocessing.get_context("spawn")
    _killed_worker_then_resume(
        tmp_path, inline_game, lambda: cf.ProcessPoolExecutor(max_workers=2, mp_context=ctx)
    )


def test_resume_after_a_killed_dask_worker(tmp_path, inline_game, dask_client):
    class _Borrowed:  # the fixture owns the client; the test only borrows its executor
        def __enter__(self):
            return dask_client.get_executor()

        def __exit__(self, *exc):
            return False

    _killed_worker_then_resume(tmp_path, inline_game, _Borrowed)


def test_a_training_error_on_an_executor_is_raised_after_recording_the_finished_runs(tmp_path):
    path = tmp_path / "failing.jsonl"
    with cf.ThreadPoolExecutor(max_workers=2) as pool, pytest.raises(RuntimeError) as err:
        run_distinguishing_game(
            gm.failing, runs_per_side=3, seed=0, executor=pool, results_path=path
        )
    assert "training failed" in str(err.value)
    assert not isinstance(err.value, GameInterruptedError)
    assert json.loads(path.read_text().splitlines()[0])["seed"] == 0


def test_executor_arguments_are_checked():
    from dpledger.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="executor"):
        run_distinguishing_game(gm.noisy_sum, runs_per_side=2, seed=0, executor="pool")
    with (
        cf.ThreadPoolExecutor(max_workers=1) as pool,
        pytest.raises(InvalidParameterError, match="workers"),
    ):
        run_distinguishing_game(gm.noisy_sum, runs_per_side=2, seed=0, executor=pool, workers=2)
