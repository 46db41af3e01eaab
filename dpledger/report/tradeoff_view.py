"""The hypothesis-testing view of a ledger: the best attacker's TPR against FPR, computed from an
upper bound on the ledger's privacy profile δ(ε).

:func:`tradeoff_view` takes δ(ε) from the PLD accountant's pessimistic privacy-loss
distribution, or, where that accountant refuses the ledger, from the PRV accountant's certified
upper bound on δ (in the order of :data:`TRADEOFF_ACCOUNTANTS`), and turns it into the
:class:`~dpledger.report.contents.TradeoffView` of the report with the math of
:mod:`dpledger.report.tradeoff`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dpledger.accountants.base import ResultKind, as_compressed, make_accountant
from dpledger.accountants.budget import DEFAULT_TIME_BUDGET_S, composed_points
from dpledger.accountants.pld import PldAccountant
from dpledger.errors import DPLedgerError, UnsupportedLedgerError
from dpledger.ledger.events import SamplingScheme
from dpledger.ledger.steps import CompressedLedger
from dpledger.report import tradeoff
from dpledger.report.contents import AccountantRow, TradeoffView

__all__ = [
    "MAX_GRID_EPSILON",
    "SECONDS_PER_PROFILE_POINT",
    "TRADEOFF_ACCOUNTANTS",
    "pld_profile_seconds",
    "tradeoff_view",
]

TRADEOFF_ACCOUNTANTS = ("pld", "prv")
"""Accountants whose δ(ε) the trade-off curve is computed from, in order of preference: the PLD
accountant's pessimistic privacy-loss distribution, else the PRV accountant's certified upper
bound on δ; each is an upper bound on the privacy profile at every ε (so the TPR derived from
it is an upper bound on any attacker's)."""

MAX_GRID_EPSILON = 700.0
"""The largest ε on the trade-off grid: below ln(largest float) ≈ 709.8, so e^ε never overflows
(an overflow made δ(ε) and the TPR NaN). Leaving out the lines of larger ε is safe: each ε only
adds a lower bound on β, so fewer lines can only overstate the TPR, here by at most e^−700."""

SECONDS_PER_PROFILE_POINT = 1e-5
"""Seconds dp-accounting's ``get_delta_for_epsilon`` spends per point of a privacy-loss
distribution when given an array of ε (measured: 9 µs on a 2-core Xeon, 1.4 million points in
12.6 s)."""

_TRADEOFF_FPRS = tuple(np.concatenate([np.geomspace(1e-5, 1e-2, 25), np.linspace(0.011, 1, 60)]))


def tradeoff_view(
    comp: CompressedLedger, delta: float, rows: Sequence[AccountantRow]
) -> TradeoffView:
    """The trade-off curve from an upper bound on δ(ε) of everything the ledger holds: the PLD
    accountant's pessimistic privacy-loss distribution, or, where the PLD accountant refuses
    the ledger or its profile would be over the work budget (:func:`pld_profile_seconds`), the
    PRV accountant's certified upper bound on δ at each ε.

    The ledger's correlated-noise releases count, as the Gaussian mechanisms they are
    equivalent to (:func:`~dpledger.accountants.base.as_compressed`), exactly as the
    accountants count them; where that is impossible the view is unavailable, never computed
    from part of the ledger.

    Args:
        comp: the ledger's runs and correlated-noise releases.
        delta: δ of the report (unused by the curve, which spans every ε).
        rows: the accountants' answers; the chosen accountant's ε sets the grid's range.
    """
    releases = len(comp.correlated)
    try:
        comp = as_compressed(comp)
    except DPLedgerError as exc:
        return TradeoffView(
            None, "", unavailable=f"the correlated-noise releases cannot be accounted: {exc}"
        )
    if any(not run.is_private for run in comp.runs):
        return TradeoffView(
            None,
            "",
            unavailable="a step has a sum query with σ̃ = 0: the run is not differentially "
            "private (ε = ∞), and an attacker may reach TPR = 1 at any FPR",
        )
    if not any(not run.releases_nothing for run in comp.runs):
        return TradeoffView(
            "pld",
            "no step releases anything: every test has TPR = FPR",
            tpr_at_fpr=tuple((a, a) for a in tradeoff.REPORTED_FPRS),
            curve=tuple((a, a) for a in _TRADEOFF_FPRS),
        )
    seconds = pld_profile_seconds(comp)
    if seconds > DEFAULT_TIME_BUDGET_S:
        found: _Profile | str = (
            f"the pld accountant's δ(ε) on the grid would need about {seconds:.3g} s (time "
            f"budget {DEFAULT_TIME_BUDGET_S:g} s)"
        )
    else:
        found = _pld_profile(comp)
    instead = ""
    if isinstance(found, str):
        fallback = _prv_profile(comp)
        if isinstance(fallback, str):
            return TradeoffView(None, "", unavailable=f"{found}; {fallback}")
        found, instead = fallback, f" (not from the pld accountant: {found})"
    name, delta_of, points, how = found
    known = {r.accountant: r.epsilon for r in rows if r.epsilon is not None}
    top = known.get(name)
    if top is None or not math.isfinite(top):
        top = _epsilon_where(delta_of, 1e-12)
    grid = tradeoff.epsilon_grid(min(max(4.0 * top, 1.0), MAX_GRID_EPSILON), points=points)
    try:
        deltas = delta_of(grid)  # once, for the reported rates and the curve
        if not np.all(np.isfinite(deltas)):
            raise DPLedgerError(f"its δ(ε) is not a number at some ε in [0, {grid[-1]:.4g}]")
        reported = tradeoff.true_positive_rate(
            delta_of, tradeoff.REPORTED_FPRS, grid, deltas=deltas
        )
        curve = tradeoff.true_positive_rate(
            delta_of, _TRADEOFF_FPRS, grid, refine=False, deltas=deltas
        )
        if not (np.all(np.isfinite(reported)) and np.all(np.isfinite(curve))):
            raise DPLedgerError("a true-positive rate is not a number")
    except DPLedgerError as exc:
        return TradeoffView(
            None, "", unavailable=f"the {name} accountant could not compute it: {exc}"
        )
    counted = (
        ""
        if not releases
        else f", counting the ledger's {releases} correlated-noise release(s) as the Gaussian "
        "mechanisms they are equivalent to"
    )
    return TradeoffView(
        accountant=name,
        basis=(
            f"from {how}{instead}{counted}, an upper bound on the privacy profile at every ε, "
            f"maximised over {len(grid)} values of ε in [0, {grid[-1]:.4g}]: the TPR shown is "
            "an upper bound on any membership attacker's"
        ),
        tpr_at_fpr=tuple(zip(tradeoff.REPORTED_FPRS, (float(x) for x in reported), strict=True)),
        curve=tuple(zip(_TRADEOFF_FPRS, (float(x) for x in curve), strict=True)),
    )


def pld_profile_seconds(comp: CompressedLedger) -> float:
    """An estimate, made before anything is allocated, of the seconds the PLD accountant's δ(ε)
    on the trade-off grid takes: dp-accounting evaluates it in one Python loop over the points
    of each of its two privacy-loss distributions (:data:`SECONDS_PER_PROFILE_POINT` each), and
    the points are estimated as the PLD accountant's budget does
    (:func:`~dpledger.accountants.budget.composed_points`, generous). A ledger with truncated
    Poisson steps has two such pairs (one per neighbour), which doubles it."""
    h = PldAccountant().value_discretization_interval
    points = 0.0
    pairs = 1.0
    for run in comp.runs:
        if run.releases_nothing:
            continue
        if run.scheme is SamplingScheme.TRUNCATED_POISSON:
            pairs = 2.0
        points += composed_points(run.sampling_probability, run.noise_multiplier, run.count, h)[1]
    return 2.0 * pairs * points * SECONDS_PER_PROFILE_POINT


_Profile = tuple[str, Callable[[np.ndarray], np.ndarray], int, str]


def _pld_profile(comp: CompressedLedger) -> _Profile | str:
    """The PLD accountant's pessimistic δ(ε), or why there is none.

    A ledger may have more than one privacy-loss distribution (truncated Poisson steps have one
    for the neighbour with a record removed and one for the neighbour with a record added,
    :meth:`~dpledger.accountants.pld.PldAccountant.distributions`): δ(ε) is then the largest
    of theirs at every ε, the pessimistic envelope, an upper bound for both neighbours."""
    acc = PldAccountant()
    try:
        acc.check_supported(comp)
        distributions = acc.distributions(comp)
    except UnsupportedLedgerError as exc:
        return f"the pld accountant refused the ledger: {exc}"
    except DPLedgerError as exc:
        return f"the pld accountant could not compute it: {exc}"

    def one(distribution: Any, eps: np.ndarray) -> np.ndarray:
        if eps.size == 1:  # dp-accounting answers one ε much faster than a one-element array
            return np.array([float(distribution.get_delta_for_epsilon(float(eps.ravel()[0])))])
        return np.asarray(distribution.get_delta_for_epsilon(eps), dtype=float).reshape(-1)

    def delta_of(eps: np.ndarray) -> np.ndarray:
        eps = np.asarray(eps, dtype=float)
        if not distributions:
            return np.zeros(eps.size)
        return np.maximum.reduce([one(d, eps) for d in distributions])

    how = "the pld accountant's pessimistic δ(ε)"
    if len(distributions) > 1:
        how += (
            f", the largest at every ε of its {len(distributions)} privacy-loss distributions "
            "(the neighbour with a record removed and the one with a record added)"
        )
    return "pld", delta_of, 2001, how


def _prv_profile(comp: CompressedLedger) -> _Profile | str:
    """The PRV accountant's certified upper bound on δ at each ε, or why there is none."""
    acc = make_accountant("prv")
    try:
        acc.check_supported(comp)
    except UnsupportedLedgerError as exc:
        return f"the prv accountant refused the ledger: {exc}"
    cache: dict[float, float] = {}

    def one(e: float) -> float:
        if e not in cache:
            result = acc.delta(comp, epsilon=e)
            if result.kind is not ResultKind.UPPER_BOUND or result.upper is None:
                raise DPLedgerError(f"the prv accountant gave no upper bound on δ at ε = {e!r}")
            cache[e] = result.upper
        return cache[e]

    def delta_of(eps: np.ndarray) -> np.ndarray:
        return np.array([one(float(e)) for e in np.asarray(eps, dtype=float).ravel()])

    try:
        one(0.0)
    except DPLedgerError as exc:
        return f"the prv accountant could not compute it: {exc}"
    return "prv", delta_of, 201, "the prv accountant's certified upper bound on δ(ε)"


def _epsilon_where(delta_of: Callable[[np.ndarray], np.ndarray], target: float) -> float:
    """An ε with δ(ε) ≤ target, found by doubling (the grid's upper end when no accountant
    reported ε)."""
    e = 1.0
    while e < MAX_GRID_EPSILON and float(delta_of(np.array([e]))[0]) > target:
        e *= 2.0
    return min(e, MAX_GRID_EPSILON)
