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
seed), in parallel across processes (``workers=1`` runs inline), with an optional progress bar.
With ``results_path`` every finished run is appended to a JSON Lines file at once, so an
interrupted audit keeps its runs and a second call with the same arguments runs only what is
missing (and, the seeds being the same, gives the same scores as an uninterrupted audit).

File format: the first line is a header
``{"format": "dpledger.audit_game", "version": 1, "seed": …, "train": …}``; each further line is
one run ``{"canary": true, "index": 0, "seed": …, "score": …, "seconds": …}``. A cut-short final
line (a crash mid-write) is dropped with a warning when the audit resumes.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import json
import logging
import math
import multiprocessing
import numbers
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import numpy as np

from dpledger.audit.privacy_bounds import BoundMethod, EpsilonLowerBound
from dpledger.audit.threshold_selection import ThresholdSelection, epsilon_bound_from_scores
from dpledger.errors import InvalidParameterError
from dpledger.validation import check_positive_int

__all__ = [
    "RESULTS_FORMAT",
    "GameRun",
    "GameScores",
    "TrainFunction",
    "derive_run_seed",
    "run_distinguishing_game",
]

logger = logging.getLogger(__name__)

RESULTS_FORMAT = "dpledger.audit_game"
RESULTS_VERSION = 1

TrainFunction = Callable[[bool, int], float]
"""``train(include_canary, seed) -> score``; higher scores mean "the canary was included"."""


def _check_seed(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise InvalidParameterError("seed", value, "an integer >= 0")
    return int(value)


def derive_run_seed(master_seed: int, *, include_canary: bool, index: int) -> int:
    """The seed of run ``index`` on one side of the game, derived from ``master_seed``.

    ``SeedSequence(master_seed, spawn_key=(side, index))`` with side 1 for runs with the canary and
    0 without, reduced to a 63-bit integer (accepted by NumPy, PyTorch and TensorFlow seeding).
    The two sides never share a seed.
    """
    master_seed = _check_seed(master_seed)
    if isinstance(index, bool) or not isinstance(index, numbers.Integral) or index < 0:
        raise InvalidParameterError("index", index, "an integer >= 0")
    ss = np.random.SeedSequence(master_seed, spawn_key=(int(bool(include_canary)), int(index)))
    return int(ss.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


@attrs.frozen
class GameRun:
    """One finished run of the game.

    Attributes:
        include_canary: whether the run trained with the canary.
        index: the run's number on its side (0-based).
        seed: the seed it was given.
        score: what the training function returned.
        seconds: wall time of the run (informational).
    """

    include_canary: bool
    index: int
    seed: int
    score: float
    seconds: float = 0.0

    def to_json(self) -> str:
        """The run as one JSON Lines record."""
        return json.dumps(
            {
                "canary": self.include_canary,
                "index": self.index,
                "seed": self.seed,
                "score": self.score,
                "seconds": round(self.seconds, 6),
            },
            separators=(",", ":"),
        )


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
    train: TrainFunction, chunk: Sequence[tuple[bool, int, int]]
) -> list[tuple[bool, int, int, Any, float]]:
    """Run ``train`` on each (include_canary, index, seed); in a worker process or inline."""
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


class _ResultsFile:
    """The append-only JSON Lines results file of one game."""

    def __init__(self, path: str, *, seed: int, train_name: str, fsync: bool) -> None:
        self.path = path
        self.fsync = fsync
        self.existing: dict[tuple[bool, int], GameRun] = {}
        header = {
            "format": RESULTS_FORMAT,
            "version": RESULTS_VERSION,
            "seed": seed,
            "train": train_name,
        }
        if os.path.exists(path) and os.path.getsize(path) > 0:
            self._load(seed=seed, train_name=train_name)
            self._fh = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        else:
            self._fh = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
            self._write_line(json.dumps(header, separators=(",", ":")))

    def _bad(self, line_number: int, reason: str) -> InvalidParameterError:
        return InvalidParameterError(
            "results_path",
            self.path,
            f"a {RESULTS_FORMAT} results file (line {line_number}: {reason})",
        )

    def _load(self, *, seed: int, train_name: str) -> None:
        with open(self.path, "rb") as fh:
            data = fh.read()
        end_of_good = data.rfind(b"\n") + 1
        if end_of_good < len(data):
            tail = data[end_of_good:]
            logger.warning(
                "%s: dropping a cut-short final line of %d bytes (an interrupted write)",
                self.path,
                len(tail),
            )
            with open(self.path, "r+b") as fh:
                fh.truncate(end_of_good)
        lines = data[:end_of_good].decode("utf-8").splitlines()
        if not lines:
            raise self._bad(1, "empty file without a header")
        try:
            header = json.loads(lines[0])
        except json.JSONDecodeError:
            raise self._bad(1, "the header is not JSON") from None
        if not isinstance(header, dict) or header.get("format") != RESULTS_FORMAT:
            raise self._bad(1, f"the header does not name the format {RESULTS_FORMAT!r}")
        if header.get("version") != RESULTS_VERSION:
            raise self._bad(1, f"unsupported version {header.get('version')!r}")
        if header.get("seed") != seed:
            raise InvalidParameterError(
                "seed",
                seed,
                f"the seed the results file {self.path!r} was written with ({header.get('seed')}); "
                "use a new results file for a new seed",
            )
        if header.get("train") != train_name:
            raise InvalidParameterError(
                "train",
                train_name,
                f"the training function the results file {self.path!r} was written with "
                f"({header.get('train')!r}); use a new results file for a different function",
            )
        for number, line in enumerate(lines[1:], start=2):
            try:
                rec = json.loads(line)
                run = GameRun(
                    include_canary=bool(rec["canary"]),
                    index=int(rec["index"]),
                    seed=int(rec["seed"]),
                    score=float(rec["score"]),
                    seconds=float(rec.get("seconds", 0.0)),
                )
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                raise self._bad(number, "not a run record") from None
            expected = derive_run_seed(seed, include_canary=run.include_canary, index=run.index)
            if run.seed != expected:
                raise self._bad(number, f"seed {run.seed} is not the derived seed {expected}")
            if not math.isfinite(run.score):
                raise self._bad(number, "the score is not finite")
            key = (run.include_canary, run.index)
            if key in self.existing:
                if self.existing[key].score != run.score:
                    logger.warning(
                        "%s: run %s appears twice with different scores (%r, %r); the training "
                        "function is not deterministic given its seed; keeping the first",
                        self.path,
                        key,
                        self.existing[key].score,
                        run.score,
                    )
                continue
            self.existing[key] = run

    def _write_line(self, line: str) -> None:
        self._fh.write(line + "\n")
        self._fh.flush()
        if self.fsync:
            os.fsync(self._fh.fileno())

    def append(self, run: GameRun) -> None:
        self._write_line(run.to_json())

    def close(self) -> None:
        self._fh.close()


def _progress_bar(enabled: bool | None, total: int, initial: int) -> Any:
    if enabled is None:
        isatty = getattr(sys.stderr, "isatty", None)
        enabled = bool(isatty()) if callable(isatty) else False
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is an optional extra
        logger.warning("progress=True but tqdm is not installed; no progress bar")
        return None
    return tqdm(total=total, initial=initial, desc="audit runs", unit="run")


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
    fsync: bool = False,
) -> GameScores:
    """Run the distinguishing game: ``runs_per_side`` runs with the canary and as many without.

    Run i on side b gets the seed :func:`derive_run_seed` (seed, include_canary=b, index=i), so the
    scores depend only on ``seed`` (given a deterministic ``train``), whatever ``workers`` is.

    Args:
        train: ``train(include_canary, seed) -> score``, picklable when ``workers > 1`` (a
            module-level function, or a ``functools.partial`` of one; with the ``"spawn"`` start
            method a function defined in a script needs the script's work under
            ``if __name__ == "__main__":``). Higher score must mean "more likely trained with the
            canary". It must be deterministic given its seed for resumed audits to equal
            uninterrupted ones.
        runs_per_side: runs on each side (≥ 1).
        seed: master seed (integer ≥ 0).
        results_path: JSON Lines file to append each finished run to; if it exists, its runs are
            reused (it must have been written with the same seed and training function) and only
            the missing runs are run. None keeps everything in memory.
        workers: processes to run in parallel (``concurrent.futures.ProcessPoolExecutor``); 1 runs
            inline in this process.
        chunk_size: runs per task sent to a worker (larger amortises process overhead for cheap
            runs; results are written when a chunk finishes).
        progress: show a progress bar (tqdm); None shows one when stderr is a terminal.
        start_method: multiprocessing start method for the workers (``"spawn"`` is safe with
            PyTorch and TensorFlow; ``"fork"`` starts faster).
        fsync: also ``os.fsync`` the results file after each run.

    Returns:
        The scores of all ``runs_per_side`` runs on each side.
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
    bar = _progress_bar(progress, 2 * runs_per_side, len(done))

    def record(outputs: list[tuple[bool, int, int, Any, float]]) -> None:
        for include, index, run_seed, score, seconds in outputs:
            run = GameRun(include, index, run_seed, _check_score(score, include, run_seed), seconds)
            done[(include, index)] = run
            if results is not None:
                results.append(run)
            if bar is not None:
                bar.update(1)

    try:
        if workers == 1 or len(chunks) <= 1:
            for chunk in chunks:
                record(_run_chunk(train, chunk))
        else:
            context = None if start_method is None else multiprocessing.get_context(start_method)
            with cf.ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
                futures = [pool.submit(_run_chunk, train, chunk) for chunk in chunks]
                try:
                    for fut in cf.as_completed(futures):
                        record(fut.result())
                except BaseException:
                    for fut in futures:
                        fut.cancel()
                    raise
    finally:
        if bar is not None:
            bar.close()
        if results is not None:
            results.close()

    with_canary = tuple(done[(True, i)] for i in range(runs_per_side))
    without_canary = tuple(done[(False, i)] for i in range(runs_per_side))
    return GameScores(seed, with_canary, without_canary)
