"""Progress of a distinguishing game: runs done, runs/s and the current bound."""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dpledger.audit.game_results import GameRun
from dpledger.audit.privacy_bounds import BoundMethod
from dpledger.errors import InvalidParameterError

__all__ = ["ProgressBound", "bound_progress"]

logger = logging.getLogger("dpledger.audit.audit_game")

ProgressBound = Callable[[np.ndarray, np.ndarray], Any]
"""``bound(scores_with_canary, scores_without_canary)`` on the runs finished so far: a number or
an :class:`~dpledger.audit.privacy_bounds.EpsilonLowerBound`, shown as the current bound."""


def bound_progress(
    *,
    delta: float,
    confidence: float,
    selection: Any,
    method: BoundMethod | str = BoundMethod.CLOPPER_PEARSON,
) -> ProgressBound:
    """A ``progress_bound`` for :func:`~dpledger.audit.audit_game.run_distinguishing_game`: the
    bound :func:`~dpledger.audit.threshold_selection.epsilon_bound_from_scores` gives on the runs
    finished so far, with these arguments (the game's final bound, when all runs are in).

    Args:
        delta: δ of the bound.
        confidence: 1 − α of the bound.
        selection: how the threshold is chosen (``HeldOutSplit``, ``BonferroniThresholds``, …).
        method: ``"clopper_pearson"`` or ``"gaussian_dp"``.
    """
    from dpledger.audit.threshold_selection import epsilon_bound_from_scores

    method = BoundMethod.parse(method)

    def bound(scores_with: np.ndarray, scores_without: np.ndarray) -> Any:
        return epsilon_bound_from_scores(
            scores_with,
            scores_without,
            selection=selection,
            delta=delta,
            confidence=confidence,
            method=method,
        )

    return bound


class _Progress:
    """Progress of a game: a tqdm bar on a terminal, INFO log lines otherwise.

    Shows runs done, runs/s (of the runs run by this call) and, given ``bound``, the bound on the
    runs finished so far, recomputed at most once every ``interval`` seconds.
    """

    def __init__(
        self,
        enabled: bool | None,
        *,
        total: int,
        initial: int,
        bound: ProgressBound | None,
        interval: float,
    ) -> None:
        self.total = total
        self.done = initial
        self.initial = initial
        self.bound = bound
        self.interval = interval
        self.start = time.perf_counter()
        self.last_report = -math.inf
        self.current_bound: float | None = None
        if enabled is None:
            isatty = getattr(sys.stderr, "isatty", None)
            enabled = bool(isatty()) if callable(isatty) else False
        self.bar: Any = None
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:  # pragma: no cover - tqdm is an optional extra
                logger.warning("progress=True but tqdm is not installed; progress is logged")
            else:
                self.bar = tqdm(total=total, initial=initial, desc="audit runs", unit="run")

    @property
    def runs_per_second(self) -> float:
        """Runs finished by this call per second of wall time."""
        elapsed = time.perf_counter() - self.start
        return (self.done - self.initial) / elapsed if elapsed > 0 else 0.0

    def _bound_now(self, done: dict[tuple[bool, int], GameRun]) -> float | None:
        if self.bound is None:
            return None
        s_in = np.array([r.score for r in done.values() if r.include_canary], dtype=np.float64)
        s_out = np.array([r.score for r in done.values() if not r.include_canary], np.float64)
        if s_in.size == 0 or s_out.size == 0:
            return None
        try:
            value = self.bound(s_in, s_out)
        except InvalidParameterError:  # too few runs yet (e.g. for a held-out split)
            return None
        epsilon: Any = getattr(value, "epsilon", value)
        return float(epsilon)

    def update(self, n: int, done: dict[tuple[bool, int], GameRun], *, final: bool = False) -> None:
        self.done += n
        now = time.perf_counter()
        if not final and now - self.last_report < self.interval:
            if self.bar is not None:
                self.bar.update(n)
            return
        self.last_report = now
        self.current_bound = self._bound_now(done)
        if self.bar is not None:
            if self.current_bound is not None:
                self.bar.set_postfix_str(f"bound ε ≥ {self.current_bound:.3f}", refresh=False)
            self.bar.update(n)
        else:
            bound = "" if self.current_bound is None else f", bound ε ≥ {self.current_bound:.3f}"
            logger.info(
                "audit runs: %d/%d done, %.2f runs/s%s",
                self.done,
                self.total,
                self.runs_per_second,
                bound,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
