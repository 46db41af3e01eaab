"""The PRV accountant's numerical-failure error and its per-question time budget.

A deadline (a context variable, so nested or concurrent questions each keep their own) is set
for each ε or δ question; the long loops of the computation check it and raise
:class:`PrvNumericalError`, which ε questions answer with the labelled RDP fallback.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import time
from collections.abc import Iterator

from dpledger.errors import DPLedgerError

__all__ = ["PrvNumericalError", "deadline_passed"]


class PrvNumericalError(DPLedgerError, ArithmeticError):
    """A numerical check of the PRV accountant failed and no certified fallback applies."""


_DEADLINE: contextvars.ContextVar[float] = contextvars.ContextVar("prv_deadline", default=math.inf)


@contextlib.contextmanager
def _time_budget(seconds: float) -> Iterator[None]:
    """Set the deadline of the PRV computations in this context to now + ``seconds``."""
    token = _DEADLINE.set(time.perf_counter() + seconds)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def deadline_passed() -> bool:
    """True once the current question's deadline has passed."""
    return time.perf_counter() > _DEADLINE.get()


def _check_deadline(seconds: float = math.nan) -> None:
    """Raise :class:`PrvNumericalError` once the current computation's deadline has passed."""
    if deadline_passed():
        budget = "its time_budget_s" if math.isnan(seconds) else f"time_budget_s={seconds:g} s"
        raise PrvNumericalError(
            f"the PRV computation exceeded {budget}; use a larger eps_error, a larger "
            "time_budget_s, or the rdp accountant"
        )
