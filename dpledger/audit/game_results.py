"""The results file of the distinguishing game, its runs and their seeds.

File format (JSON Lines): the first line is a header
``{"format": "dpledger.audit_game", "version": 1, "seed": …, "train": …}``; each further line is
one run ``{"canary": true, "index": 0, "seed": …, "score": …, "seconds": …}``. Only the process
that runs :func:`~dpledger.audit.audit_game.run_distinguishing_game` writes the file, appending
one whole line per run in a single write followed by a flush (and an ``os.fsync`` unless turned
off), so the file is never written by two processes at once. A cut-short final line (a crash
mid-write) is dropped with a warning when the audit resumes.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
from typing import Any

import attrs
import numpy as np

from dpledger.errors import InvalidParameterError

__all__ = ["RESULTS_FORMAT", "RESULTS_VERSION", "GameRun", "derive_run_seed"]

logger = logging.getLogger("dpledger.audit.audit_game")

RESULTS_FORMAT = "dpledger.audit_game"
RESULTS_VERSION = 1


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
