"""The distinguishing game: train many times with and without a canary, score each run.

The privacy audit of Jagielski et al. (2020) and Tramèr et al. (2022, §3): train on D and on
D' = D ∪ {canary} many times with fresh randomness, score each trained model (black box: the
negative loss on the canary; white box: the inner product of a gradient canary with the update),
and turn the two sets of scores into a lower bound on ε
(:func:`~dpledger.audit.threshold_selection.epsilon_bound_from_scores`).

This module is the framework-free harness. The user supplies a picklable training function::

    def train(include_canary: bool, seed: int) -> float:   # higher score = "canary included"
        ...

and :func:`run_distinguishing_game` runs it ``runs_per_side`` times per side, with seeds derived
from one master seed by :class:`numpy.random.SeedSequence` (run i of a side always gets the same
seed), inline, on a local process pool (``workers``) or on any
:class:`concurrent.futures.Executor` (``executor``: a thread pool, a Dask cluster's
``distributed.Client(...).get_executor()``, …), with progress (runs done, runs/s and, given
``progress_bound``, the current bound). With ``results_path`` every finished run is appended to a
JSON Lines file at once, so an interrupted audit keeps its runs and a second call with the same
arguments runs only what is missing (and, the seeds being the same, gives the same scores as an
uninterrupted audit).

Only the calling process writes the results file, one whole line per run (a single write, then
flush and, by default, fsync), so workers on any executor never write to it concurrently. A worker
that dies mid-run (a crash, a killed process, a lost cluster node) loses only the runs it was
running: the runs that finished are kept, :class:`GameInterruptedError` says how many are
missing, and a second call runs them.

File format: the first line is a header
``{"format": "dpledger.audit_game", "version": 1, "seed": …, "train": …}``; each further line is
one run ``{"canary": true, "index": 0, "seed": …, "score": …, "seconds": …}``. A cut-short final
line (a crash mid-write) is dropped with a warning when the audit resumes.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import logging
import math
import multiprocessing
import numbers
import os
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import numpy as np

from dpledger.audit.game_progress import ProgressBound, _Progress, bound_progress
from dpledger.audit.game_results import (
    RESULTS_FORMAT,
    RESULTS_VERSION,
    GameRun,
    _check_seed,
    _ResultsFile,
    derive_run_seed,
)
from dpledger.audit.privacy_bounds import BoundMethod, EpsilonLowerBound
from dpledger.audit.threshold_selection import ThresholdSelection, epsilon_bound_from_scores
from dpledger.errors import DPLedgerError, InvalidParameterError
from dpledger.validation import check_positive_int

__all__ = [
    "RESULTS_FORMAT",
    "RESULTS_VERSION",
    "GameInterruptedError",
    "GameRun",
    "GameScores",
    "ProgressBound",
    "TrainFunction",
    "bound_progress",
    "derive_run_seed",
    "run_distinguishing_game",
]

logger = logging.getLogger(__name__)

TrainFunction = Callable[[bool, int], float]
"""``train(include_canary, seed) -> score``; higher scores mean "the canary was included"."""


class GameInterruptedError(DPLedgerError, RuntimeError):
    """Some runs of a distinguishing game did not finish (a worker died or the executor broke).

    The runs that finished are in the results file (when one was given); calling
    :func:`run_distinguishing_game` again with the same arguments runs only the missing ones.

    Attributes:
        finished: runs finished (including runs reused from the results file).
        missing: runs that still have to be run.
    """

    def __init__(self, message: str, *, finished: int, missing: int) -> None:
        super().__init__(message)
        self.finished = finished
        self.missing = missing


@attrs.frozen
class GameScores:
    """The scores of a finished game, run i of each side at position i.

    Attributes:
        seed: the master seed.
        runs_with_canary: the runs trained with the canary, by index.
        runs_without_canary: the runs trained without it, by index.
    """

    seed: int
    runs_with_canary: tuple[GameRun, ...]
    runs_without_canary: tuple[GameRun, ...]

    @property
    def runs_per_side(self) -> int:
        """Number of runs on each side."""
        return len(self.runs_with_canary)

    @property
    def scores_with_canary(self) -> np.ndarray:
        """Scores of the runs with the canary (a new array)."""
        return np.array([r.score for r in self.runs_with_canary], dtype=np.float64)

    @property
    def scores_without_canary(self) -> np.ndarray:
        """Scores of the runs without the canary (a new array)."""
        return np.array([r.score for r in self.runs_without_canary], dtype=np.float64)

    def prefix(self, runs_per_side: int) -> GameScores:
        """The game restricted to its first ``runs_per_side`` runs per side."""
        n = check_positive_int("runs_per_side", runs_per_side)
        if n > self.runs_per_side:
            raise InvalidParameterError(
                "runs_per_side", runs_per_side, f"at most {self.runs_per_side}"
            )
        return GameScores(self.seed, self.runs_with_canary[:n], self.runs_without_canary[:n])

    def epsilon_lower_bound(
        self,
        *,
        delta: float,
        confidence: float,
        selection: ThresholdSelection,
        method: BoundMethod | str = BoundMethod.CLOPPER_PEARSON,
    ) -> EpsilonLowerBound:
        """The ε lower bound from these scores; see
        :func:`~dpledger.audit.threshold_selection.epsilon_bound_from_scores`."""
        return epsilon_bound_from_scores(
            self.scores_with_canary,
            self.scores_without_canary,
            selection=selection,
            delta=delta,
            confidence=confidence,
            method=method,
        )

    def bound_versus_runs(
        self,
        run_counts: Iterable[int],
        *,
        delta: float,
        confidence: float,
        selection: ThresholdSelection,
        method: BoundMethod | str = BoundMethod.CLOPPER_PEARSON,
    ) -> tuple[tuple[int, EpsilonLowerBound], ...]:
        """The bound on the first n runs per side, for each n in ``run_counts``.

        Each entry is a separate audit (its own confidence); read the sequence as "what an audit of
        this size would have shown", not as simultaneous bounds.
        """
        out = []
        for n in run_counts:
            b = self.prefix(n).epsilon_lower_bound(
                delta=delta, confidence=confidence, selection=selection, method=method
            )
            out.append((int(n), b))
        return tuple(out)


# ---------------------------------------------------------------------------------- running
def _train_name(train: Any) -> str:
    if isinstance(train, functools.partial):
        args = ", ".join(
            [repr(a) for a in train.args]
            + [f"{k}={v!r}" for k, v in sorted(train.keywords.items())]
        )
        return f"functools.partial({_train_name(train.func)}, {args})"
    module = getattr(train, "__module__", None) or type(train).__module__
    qualname = getattr(train, "__qualname__", None) or type(train).__qualname__
    if module == "__mp_main__":
        module = "__main__"
    return f"{module}.{qualname}"


def _run_chunk(
    train: TrainFunction, chunk: Sequence[tuple[bool, int, int]], call_id: str = ""
) -> list[tuple[bool, int, int, Any, float]]:
    """Run ``train`` on each (include_canary, index, seed); in a worker process or inline.

    ``call_id`` is unused here: it makes each call's tasks distinct for executors that cache
    results by the task's arguments (Dask's default ``pure=True`` would otherwise hand a resumed
    game the failure of the same chunk in the previous call).
    """
    out = []
    for include, index, seed in chunk:
        start = time.perf_counter()
        score = train(include, seed)
        out.append((include, index, seed, score, time.perf_counter() - start))
    return out


def _check_score(value: Any, include: bool, seed: int) -> float:
    ok = (
        not isinstance(value, bool)
        and isinstance(value, (numbers.Real, np.floating, np.integer))
        and math.isfinite(float(value))
    )
    if not ok:
        raise InvalidParameterError(
            f"train(include_canary={include}, seed={seed}) return value",
            value,
            "a finite real score",
        )
    return float(value)


def _is_lost_worker(exc: BaseException) -> bool:
    """True for failures of the executor rather than of the training function."""
    if isinstance(exc, (cf.BrokenExecutor, cf.CancelledError)):
        return True
    # Dask raises distributed.scheduler.KilledWorker (or a CommClosedError, a lost connection);
    # matched by name so that this module does not import Dask.
    return type(exc).__name__ in {"KilledWorker", "CommClosedError", "FutureCancelledError"}


def _run_on_executor(
    pool: cf.Executor,
    train: TrainFunction,
    chunks: Sequence[Sequence[tuple[bool, int, int]]],
    record: Callable[[list[tuple[bool, int, int, Any, float]]], None],
) -> BaseException | None:
    """Submit every chunk, record each as it finishes; return the first failure, if any.

    After a failure the chunks not yet started are cancelled and those already running are
    waited for and recorded, so that a dead worker loses only its own runs.
    """
    call_id = uuid.uuid4().hex
    futures = [pool.submit(_run_chunk, train, chunk, call_id) for chunk in chunks]
    failure: BaseException | None = None
    try:
        for fut in cf.as_completed(futures):
            if fut.cancelled():
                continue
            exc = fut.exception()
            if exc is None:
                record(fut.result())
                continue
            if failure is None:
                failure = exc
            if not _is_lost_worker(exc):
                # A bug in the training function: stop submitting work. A lost worker costs
                # only its own runs; the others keep going.
                for other in futures:
                    other.cancel()
    except BaseException:  # KeyboardInterrupt while waiting: cancel what has not started
        for fut in futures:
            fut.cancel()
        raise
    return failure


def run_distinguishing_game(
    train: TrainFunction,
    *,
    runs_per_side: int,
    seed: int,
    results_path: str | os.PathLike[str] | None = None,
    workers: int = 1,
    chunk_size: int = 1,
    progress: bool | None = None,
    start_method: str | None = "spawn",
    fsync: bool = True,
    executor: cf.Executor | None = None,
    progress_bound: ProgressBound | None = None,
    progress_interval: float = 2.0,
) -> GameScores:
    """Run the distinguishing game: ``runs_per_side`` runs with the canary and as many without.

    Run i on side b gets the seed :func:`derive_run_seed` (seed, include_canary=b, index=i), so the
    scores depend only on ``seed`` (given a deterministic ``train``), whatever ``workers`` or
    ``executor`` is.

    Args:
        train: ``train(include_canary, seed) -> score``, picklable when it runs in other
            processes (a module-level function, or a ``functools.partial`` of one; with the
            ``"spawn"`` start method a function defined in a script needs the script's work
            under ``if __name__ == "__main__":``; on a Dask cluster the workers must be able to
            import its module). Higher score must mean "more likely trained with the canary".
            It must be deterministic given its seed for resumed audits to equal uninterrupted
            ones.
        runs_per_side: runs on each side (≥ 1).
        seed: master seed (integer ≥ 0).
        results_path: JSON Lines file to append each finished run to; if it exists, its runs are
            reused (it must have been written with the same seed and training function) and only
            the missing runs are run. None keeps everything in memory.
        workers: processes of the local pool (``concurrent.futures.ProcessPoolExecutor``) when
            no ``executor`` is given; 1 runs inline in this process.
        chunk_size: runs per task sent to a worker (larger amortises the overhead of cheap runs;
            results are written when a chunk finishes, and a dead worker loses its chunk).
        progress: show a progress bar (tqdm) with runs done, runs/s and the current bound; None
            shows one when stderr is a terminal. Without a bar, progress is logged at INFO.
        start_method: multiprocessing start method of the local pool (``"spawn"`` is safe with
            PyTorch and TensorFlow; ``"fork"`` starts faster).
        fsync: ``os.fsync`` the results file after each line (on by default; off saves a disk
            flush per run when runs are very cheap, at the risk of losing the last runs to an
            operating-system crash, never of a corrupt file).
        executor: any :class:`concurrent.futures.Executor` to run the runs on (a thread pool,
            a process pool you manage, ``distributed.Client(...).get_executor()``); it is used,
            not shut down. None uses the local process pool of ``workers`` processes.
        progress_bound: ``bound(scores_with, scores_without)`` on the runs finished so far (a
            float or an :class:`~dpledger.audit.privacy_bounds.EpsilonLowerBound`), shown as the
            current bound, e.g. ``bound_progress(delta=…, confidence=…, selection=…)``;
            informational only (a bound watched as runs come in is not the audit's bound).
        progress_interval: seconds between progress reports (and bound evaluations).

    Returns:
        The scores of all ``runs_per_side`` runs on each side.

    Raises:
        GameInterruptedError: a worker died or the executor broke; the runs that finished are
            kept (in the results file, when given) and a second call runs the others.
        Exception: an exception raised by ``train`` (after the runs that finished meanwhile are
            recorded).
    """
    runs_per_side = check_positive_int("runs_per_side", runs_per_side)
    seed = _check_seed(seed)
    workers = check_positive_int("workers", workers)
    chunk_size = check_positive_int("chunk_size", chunk_size)
    if not callable(train):
        raise InvalidParameterError("train", train, "a callable train(include_canary, seed)")
    if start_method is not None and start_method not in multiprocessing.get_all_start_methods():
        raise InvalidParameterError(
            "start_method", start_method, f"one of {multiprocessing.get_all_start_methods()}"
        )
    if executor is not None and not isinstance(executor, cf.Executor):
        raise InvalidParameterError("executor", executor, "a concurrent.futures.Executor")
    if executor is not None and workers != 1:
        raise InvalidParameterError(
            "workers", workers, "1 when an executor is given (the executor sets the parallelism)"
        )
    if progress_bound is not None and not callable(progress_bound):
        raise InvalidParameterError(
            "progress_bound", progress_bound, "a callable bound(scores_with, scores_without)"
        )
    if (
        isinstance(progress_interval, bool)
        or not isinstance(progress_interval, numbers.Real)
        or not progress_interval >= 0
    ):
        raise InvalidParameterError("progress_interval", progress_interval, "a number >= 0")

    results: _ResultsFile | None = None
    done: dict[tuple[bool, int], GameRun] = {}
    if results_path is not None:
        results = _ResultsFile(
            os.fspath(results_path), seed=seed, train_name=_train_name(train), fsync=fsync
        )
        done = {k: v for k, v in results.existing.items() if k[1] < runs_per_side}
        if done:
            logger.info(
                "resuming from %s: %d of %d runs already done",
                results.path,
                len(done),
                2 * runs_per_side,
            )
    todo = [
        (include, i, derive_run_seed(seed, include_canary=include, index=i))
        for i in range(runs_per_side)
        for include in (True, False)
        if (include, i) not in done
    ]
    chunks = [todo[k : k + chunk_size] for k in range(0, len(todo), chunk_size)]
    reporter = _Progress(
        progress,
        total=2 * runs_per_side,
        initial=len(done),
        bound=progress_bound,
        interval=float(progress_interval),
    )

    def record(outputs: list[tuple[bool, int, int, Any, float]]) -> None:
        for include, index, run_seed, score, seconds in outputs:
            run = GameRun(include, index, run_seed, _check_score(score, include, run_seed), seconds)
            done[(include, index)] = run
            if results is not None:
                results.append(run)
        reporter.update(len(outputs), done)

    failure: BaseException | None = None
    try:
        if executor is not None:
            failure = _run_on_executor(executor, train, chunks, record)
        elif workers == 1 or len(chunks) <= 1:
            for chunk in chunks:
                record(_run_chunk(train, chunk))
        else:
            context = None if start_method is None else multiprocessing.get_context(start_method)
            with cf.ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
                failure = _run_on_executor(pool, train, chunks, record)
        if failure is None and reporter.done != reporter.initial:
            reporter.update(0, done, final=True)
    finally:
        reporter.close()
        if results is not None:
            results.close()

    if failure is not None:
        missing = 2 * runs_per_side - len(done)
        where = f" in {results.path}" if results is not None else " (no results_path: not kept)"
        message = (
            f"{missing} of {2 * runs_per_side} runs of the game did not finish "
            f"({type(failure).__name__}: {failure}); the {len(done)} finished runs are kept"
            f"{where}; call again with the same arguments to run the missing ones"
        )
        logger.error("%s", message)
        if _is_lost_worker(failure):
            raise GameInterruptedError(message, finished=len(done), missing=missing) from failure
        if hasattr(failure, "add_note"):
            failure.add_note(message)
        raise failure

    with_canary = tuple(done[(True, i)] for i in range(runs_per_side))
    without_canary = tuple(done[(False, i)] for i in range(runs_per_side))
    return GameScores(seed, with_canary, without_canary)
