"""The certified lower bound on ε that the GDP accountant checks its CLT approximation against.

:class:`~dpledger.accountants.gdp.GdpAccountant` (its module docstring, "Certified lower bound",
gives the argument) asks :func:`_prv_lower_bound` first: the PRV accountant's certified lower
bound on an optimistically bucketed copy of the ledger. Where that fails it builds
dp-accounting's optimistic privacy-loss distribution of the composition
(:func:`_optimistic_pld`), whose δ(ε) is a lower bound on the true one except for the tail mass
each composition moves to an infinite loss, which it returns alongside.
"""

from __future__ import annotations

import math
import time
from typing import Any

from dpledger.accountants.bucketing import optimistic_buckets
from dpledger.errors import DPLedgerError
from dpledger.ledger.steps import CompressedLedger

__all__: list[str] = []


_PRV_LOWER_BOUND_BUCKETING = 1e-3


def _prv_lower_bound(
    ledger: CompressedLedger, delta: float, *, memory_budget: int, time_budget_s: float
) -> tuple[float | None, dict[str, Any]]:
    """The PRV accountant's certified lower bound on an optimistically bucketed copy, or None
    (within the given memory and time budgets)."""
    from dpledger.accountants.prv import PrvAccountant

    start = time.perf_counter()
    coarse = optimistic_buckets(ledger, relative_precision=_PRV_LOWER_BOUND_BUCKETING)
    info: dict[str, Any] = {
        "lower_bound_method": "PRV accountant's certified lower bound",
        "lower_bound_bucketing": _PRV_LOWER_BOUND_BUCKETING,
    }
    try:
        result = PrvAccountant(memory_budget=memory_budget, time_budget_s=time_budget_s).epsilon(
            coarse, delta=delta
        )
    except DPLedgerError as exc:  # a refusal or a failed numerical check: use the fallback
        info["lower_bound_prv_failed"] = str(exc)
        return None, info
    if result.lower is None:
        info["lower_bound_prv_failed"] = "the PRV accountant could not certify a lower bound"
        return None, info
    info["lower_bound_seconds"] = time.perf_counter() - start
    return max(0.0, float(result.lower)), info


_PLD_TAIL_TRUNCATION = 1e-15  # dp-accounting's default tail_mass_truncation, passed explicitly
_PLD_DELTA_FLOOR_FACTOR = 10.0  # the fallback bound needs δ ≥ this × the truncated tail mass


def _optimistic_pld(
    distinct: dict[tuple[float, float], int], *, factor: float, interval: float
) -> tuple[Any, float]:
    """dp-accounting's optimistic PLD of the composition (None if nothing is costly), and the
    total tail mass its compositions moved to an infinite loss (at most
    ``_PLD_TAIL_TRUNCATION`` per self-composition or composition)."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    from dpledger.accountants.pld_composition import self_compose

    full_mu_sq = 0.0
    parts = []
    self_compositions = 0
    for (q, z), count in distinct.items():
        if q == 0.0 or math.isinf(z):
            continue
        if q == 1.0:
            full_mu_sq += count * (factor / z) ** 2
            continue
        composed, operations = self_compose(
            pld_lib.from_gaussian_mechanism(
                standard_deviation=z,
                sampling_prob=q,
                pessimistic_estimate=False,
                use_connect_dots=False,
                value_discretization_interval=interval,
            ),
            count,
            tail_mass_truncation=_PLD_TAIL_TRUNCATION,
        )
        parts.append(composed)
        self_compositions += operations
    if full_mu_sq > 0.0:
        parts.append(
            pld_lib.from_gaussian_mechanism(
                standard_deviation=1.0 / math.sqrt(full_mu_sq),
                pessimistic_estimate=False,
                use_connect_dots=False,
                value_discretization_interval=interval,
            )
        )
    if not parts:
        return None, 0.0
    operations = self_compositions + len(parts) - 1
    total = parts[0]
    for p in parts[1:]:
        total = total.compose(p, tail_mass_truncation=_PLD_TAIL_TRUNCATION)
    return total, operations * _PLD_TAIL_TRUNCATION
