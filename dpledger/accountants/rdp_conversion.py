"""From Rényi DP to (ε, δ): the conversion at each order and the search for the best order.

The RDP accountant (:mod:`dpledger.accountants.rdp`) composes log A_α = (α − 1)·ε_T(α) over a
ledger; this module turns it into ε at δ (or δ at ε), rounded up.

Conversion to (ε, δ): Canonne, Kamath & Steinke (2020, "The Discrete Gaussian for Differential
Privacy", Prop. 12), as dp-accounting applies it: for α > 1.01,

    ε = ε_T(α) + log(1 − 1/α) − (log δ + log α) / (α − 1),

minimised over the order grid; and ε = 0 when δ² > 1 − exp(−ε_T(α)) (the KL/total-variation
bound). δ for a given ε uses the same proposition solved for δ, and the bound δ ≤ √(1 − e^{−ε_T}).

Order search. (α − 1)·ε_T(α) = log A_α is a cumulant-generating function, hence convex in α, and
equals 0 at α = 1. So a few exactly computed orders bound every other order from below (secant
lines extrapolated outward), and an order whose lower bound on ε already exceeds the best ε found
is skipped without being computed. The minimum is the same as evaluating the whole grid (to a
relative 10⁻⁹); on ledgers with many distinct (q, z) this computes 10–25 of the 156 default orders.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from dpledger.errors import InvalidParameterError
from dpledger.validation import check_delta

__all__ = ["delta_from_rdp", "epsilon_from_rdp"]

_MIN_CONVERSION_ORDER = 1.01  # Prop. 12 is numerically unstable as α → 1 (as in dp-accounting)
_SEARCH_TOLERANCE = 1e-9
_U = float(np.finfo(np.float64).eps)
_INITIAL_ORDERS = (2.0, 4.0, 8.0, 16.0)
_BATCH = 4


# ----------------------------------------------------------------------------- conversions
def _epsilon_values(alphas: np.ndarray, log_moment: np.ndarray, delta: float) -> np.ndarray:
    """ε at each order from the composed log A_α (CKS20 Prop. 12 and the KL bound), rounded up:
    the conversion's own rounding (a few ulp of each of its terms) is added, and the KL bound
    (ε = 0) is taken only when it holds with that rounding to spare."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        rdp = log_moment / (alphas - 1.0)
        t1 = np.log1p(-1.0 / alphas)
        t2 = np.log(delta * alphas) / (alphas - 1.0)
        eps = rdp + t1 - t2
        eps = eps + 8.0 * _U * (np.abs(rdp) + np.abs(t1) + np.abs(t2))
        eps = np.where(alphas > _MIN_CONVERSION_ORDER, eps, np.inf)
        kl_zero = delta * delta * (1.0 - 8.0 * _U) + np.expm1(-rdp) * (1.0 + 8.0 * _U) > 0.0
        eps = np.where(kl_zero, 0.0, eps)
    return eps


def _log_delta_values(alphas: np.ndarray, log_moment: np.ndarray, epsilon: float) -> np.ndarray:
    """log δ at each order from the composed log A_α (CKS20 Prop. 12 and the KL bound), rounded
    up by a few ulp of the terms it is computed from."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        rdp = log_moment / (alphas - 1.0)
        kl = np.where(rdp > 0.0, 0.5 * np.log1p(-np.exp(-rdp)), -np.inf)
        kl = kl + 8.0 * _U * (np.abs(kl) + 1.0)
        t1 = (alphas - 1.0) * (epsilon - np.log1p(-1.0 / alphas))
        prop12 = log_moment - t1 - np.log(alphas)
        prop12 = prop12 + 8.0 * _U * (np.abs(log_moment) + np.abs(t1) + np.log(alphas))
        out = np.where(alphas > _MIN_CONVERSION_ORDER, np.minimum(kl, prop12), kl)
    return out


def epsilon_from_rdp(
    orders: Sequence[float], rdp: Sequence[float], *, delta: float
) -> tuple[float, float]:
    """(ε, optimal order) from RDP values ε(α) at the given orders (CKS20 Prop. 12)."""
    delta = check_delta("delta", delta)
    alphas = _check_orders(np.asarray(orders, dtype=np.float64), sort=False)
    values = np.asarray(rdp, dtype=np.float64)
    if values.shape != alphas.shape:
        raise InvalidParameterError("rdp", rdp, f"{alphas.shape[0]} values, one per order")
    eps = _epsilon_values(alphas, values * (alphas - 1.0), delta)
    i = int(np.argmin(eps))
    return max(0.0, float(eps[i])), float(alphas[i])


def delta_from_rdp(
    orders: Sequence[float], rdp: Sequence[float], *, epsilon: float
) -> tuple[float, float]:
    """(δ, optimal order) from RDP values ε(α) at the given orders (CKS20 Prop. 12)."""
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not epsilon >= 0:
        raise InvalidParameterError("epsilon", epsilon, "a number >= 0")
    alphas = _check_orders(np.asarray(orders, dtype=np.float64), sort=False)
    values = np.asarray(rdp, dtype=np.float64)
    if values.shape != alphas.shape:
        raise InvalidParameterError("rdp", rdp, f"{alphas.shape[0]} values, one per order")
    logd = _log_delta_values(alphas, values * (alphas - 1.0), float(epsilon))
    i = int(np.argmin(logd))
    return min(1.0, math.exp(float(logd[i]))), float(alphas[i])


def _check_orders(alphas: np.ndarray, *, sort: bool = True) -> np.ndarray:
    if alphas.ndim != 1 or alphas.shape[0] == 0:
        raise InvalidParameterError("orders", alphas.tolist(), "a non-empty sequence of orders > 1")
    if not np.all(np.isfinite(alphas) & (alphas > 1.0)):
        raise InvalidParameterError("orders", alphas.tolist(), "finite orders > 1")
    return np.unique(alphas) if sort else alphas


# ----------------------------------------------------------------------------- order search
def _convex_bounds(
    xk: np.ndarray, yk: np.ndarray, xu: np.ndarray, floor_slope: float
) -> tuple[np.ndarray, np.ndarray]:
    """Lower and upper bounds at ``xu`` on a convex H known at sorted points (xk, yk).

    H is log A_α: convex in α, H(1) = 0 (the first known point), and H(α) ≥ (α − 1)·KL where
    KL ≥ ``floor_slope`` (Rényi divergences grow with the order; KL is the order-1 limit).

    Lower bounds: a convex function lies above each secant line outside the secant's interval, so
    between known points i−1 and i the secants (i−2, i−1) and (i, i+1), extended, bound it from
    below. Upper bound: the chord between the neighbouring known points (+∞ beyond the last).
    """
    lower = (xu - 1.0) * floor_slope
    upper = np.full(xu.shape[0], np.inf)
    m = xk.shape[0]
    pos = np.searchsorted(xk, xu)  # number of known points below each xu (≥ 1: xk[0] = 1)
    if m < 2:
        return lower, upper
    slopes = np.diff(yk) / np.diff(xk)
    left = pos >= 2
    p = pos[left]
    lower[left] = np.maximum(lower[left], yk[p - 1] + slopes[p - 2] * (xu[left] - xk[p - 1]))
    right = pos <= m - 2
    p = pos[right]
    lower[right] = np.maximum(lower[right], yk[p] + slopes[p] * (xu[right] - xk[p]))
    inside = pos <= m - 1
    p = pos[inside]
    upper[inside] = yk[p - 1] + slopes[p - 1] * (xu[inside] - xk[p - 1])
    return lower, upper


def _minimise_over_orders(
    alphas: np.ndarray,
    log_moment_at: Callable[[np.ndarray], np.ndarray],
    objective: Callable[[np.ndarray, np.ndarray], np.ndarray],
    *,
    floor_slope: float,
) -> tuple[int, float, int]:
    """Minimise ``objective(α, log A_α)`` over the order grid by branch and bound.

    Returns (index of the optimal order, minimum, number of orders evaluated). The objective must
    be non-decreasing in log A_α at every order. Orders are evaluated in batches, best estimated
    value first (the chord of the convex log A_α), and an order is skipped once its lower bound
    exceeds the best value found (up to a relative ``_SEARCH_TOLERANCE``), so the result is the
    minimum over the whole grid.
    """
    n = alphas.shape[0]
    known = np.full(n, np.nan)
    if n <= len(_INITIAL_ORDERS):
        first = np.arange(n)
    else:
        first = np.unique([int(np.argmin(np.abs(alphas - a))) for a in _INITIAL_ORDERS])
    known[first] = log_moment_at(first)
    while True:
        have = ~np.isnan(known)
        idx_known = np.flatnonzero(have)
        best = float(np.min(objective(alphas[idx_known], known[idx_known])))
        todo = np.flatnonzero(~have)
        if todo.size == 0 or best == -math.inf:
            break
        finite = idx_known[np.isfinite(known[idx_known])]
        xk = np.concatenate([[1.0], alphas[finite]])
        yk = np.concatenate([[0.0], known[finite]])
        lower, upper = _convex_bounds(xk, yk, alphas[todo], floor_slope)
        low_value = objective(alphas[todo], lower)
        slack = _SEARCH_TOLERANCE * abs(best) + 1e-15 if math.isfinite(best) else math.inf
        open_ = low_value <= best + slack
        if not np.any(open_):
            break
        todo, low_value = todo[open_], low_value[open_]
        estimate = objective(alphas[todo], upper[open_])
        inside = np.isfinite(upper[open_])
        # Inside the known range: best estimated value first. Beyond the largest known order
        # (no estimate): the open order nearest to twice that order, to bracket the optimum fast.
        rank = np.argsort(estimate[inside], kind="stable")
        take_list = todo[inside][rank[: _BATCH - 1 if np.any(~inside) else _BATCH]].tolist()
        if np.any(~inside):
            beyond = alphas[todo[~inside]]
            target = 2.0 * float(xk[-1])
            take_list.append(int(todo[~inside][np.argmin(np.abs(np.log(beyond / target)))]))
        take = np.unique(np.asarray(take_list, dtype=np.int64))
        known[take] = log_moment_at(take)
    have = np.flatnonzero(~np.isnan(known))
    values = objective(alphas[have], known[have])
    i = int(np.argmin(values))
    return int(have[i]), float(values[i]), int(have.shape[0])
