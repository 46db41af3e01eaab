"""Certified privacy of random allocation (balls-in-bins batches) with amplification.

Random allocation (Feldman & Shenfeld, "Privacy amplification by random allocation", 2025): each
record takes part in k of T steps chosen uniformly at random, independently of the other
records; every step is a Gaussian sum query with noise multiplier σ (in units of the clipping
norm). Balls-in-bins batch sampling is random allocation with k = 1 per epoch: each record falls
into one of the epoch's T batches uniformly at random, independently of the others. E epochs are
E independent allocations, hence a composition.

The pair
--------
Under add/remove, one allocation of one record into one of T Gaussian steps is dominated by the
pair of output distributions on ℝ^T

    P = (1/T) Σ_t N(e_t, σ² I_T)        Q = N(0, σ² I_T)

(the record is in one uniformly chosen step; Feldman & Shenfeld show that this pair dominates
the adaptive composition of T steps with random allocation; the same pair is the balls-and-bins
pair of Chua et al. 2025 that :mod:`dpledger.accountants.balls_in_bins` samples). Its likelihood
ratio is

    S(w) = dP/dQ(w) = (1/T) Σ_t Y_t,    Y_t = exp(w_t/σ² − 1/(2σ²)),

and under Q the Y_t are independent log-normal variables with E_Q[Y_t] = 1. Both directions of
add/remove are functions of the law of S under Q alone:

    H_ε(P‖Q) = E_Q[(S − e^ε)₊]          (remove: privacy loss log S under P = S·Q)
    H_ε(Q‖P) = E_Q[(1 − e^ε S)₊]        (add: privacy loss −log S under Q)

and for a composition of independent allocations the same holds with S replaced by the product
of the epochs' S (independent under Q). Both integrands are convex in each factor.

Why the computed bound is certified: convex order
-------------------------------------------------
A *mean-preserving spread* of a random variable (moving mass away from its conditional mean,
keeping the mean) can only increase E[f(·)] for convex f (Jensen). Every approximation below is
a mean-preserving spread of the exact law of S under Q, so the discrete pair it defines has, for
every ε and in both directions, a hockey-stick divergence at least the exact one, also after
composition (one factor at a time, the others held fixed: the integrand stays convex):

1. Each Y_t is put on the geometric grid y_k = e^{kh}: the mass of each cell [y_k, y_{k+1}] is
   split between its two ends so that the cell's mean (the log-normal's partial first moment, in
   closed form from Φ) is kept. Mass below the lowest grid point is split between 0 and it in
   the same way; mass above the highest is moved there with its excess first moment sent to an
   infinitely large value (the limit of a spread towards +∞: Q-mass 0, P-mass equal to that
   excess), which is an infinite privacy loss in the remove direction.
2. The law of Y_1 + … + Y_T is built by repeated squaring (about 2·log₂ T sums of two
   independent variables). A sum of two grid values y_i + y_j lies between two grid points and
   is split between them keeping its value as the mean, again a spread; the sum of independent
   spreads is a spread of the sum. For |i − j| large the split is linear in the smaller term,
   so those pairs are summed in O(1) each from partial first moments (no cancellation: every
   term is non-negative and the split fraction is at most 1/2).
3. Dividing by T moves the grid by log T, which is not a grid multiple: every atom is split
   once more between its two new neighbours.

Each spread adds a variance of order (h·S)²/4, a second-order error: at the reference below
the bound is 2.4333, 2.4266 and 2.4246 for h = 0.02, 0.01 and 0.005 (differences shrinking
about 3.4×), where a first-order construction (every loss rounded up to the grid) needs
h = 1e-4 and a quadratic-time convolution on 10⁵ points. When the log-normal's spread τ = 1/σ
is below 20h (σ > 5 at h = 0.01) the grid is refined to τ/20 (down to 1e-3), so that the law
spans about 20 cells; a grid that would exceed 2·10⁶ points (σ below about 0.01) is refused
(:class:`~dpledger.errors.ComputationBudgetError`).

The ε and δ returned by :func:`random_allocation_epsilon` and :func:`random_allocation_delta`
are the smaller of this bound and the no-amplification one (every record in k·E Gaussian steps
of sensitivity 1: μ-GDP with μ = √(kE)/σ, in closed form), both valid upper bounds.

The discrete law of S on the grid e^{kh} is then a pair of PMFs on dp-accounting's loss grid
with interval h: remove, loss kh with P-mass q_k·e^{kh}; add, loss −kh with Q-mass q_k (the
atom at S = 0 is an infinite loss in the add direction). These are composed by dp-accounting
(FFT self-composition, which moves truncated tail mass to an infinite loss: pessimistic) over
the k·E allocations of the ledger. k of T steps per epoch: Feldman & Shenfeld show that random
allocation of k of T steps is dominated by the composition of k allocations of one of ⌊T/k⌋
steps (here all k get ⌊T/k⌋, the smallest part, which is conservative: the bound is
non-increasing in T, see below).

Monotonicity. The mean of T + 1 i.i.d. terms is the average of its T + 1 leave-one-out means, so
it is a mean-preserving contraction of the mean of T terms: the exact bound is non-increasing in
T. A larger σ makes each log-normal Y_t a contraction of the one for a smaller σ (e^{τB−τ²/2} is a
martingale in τ²), so the exact bound is non-increasing in σ.

Floating point: every mass is a sum of non-negative products (relative error of a few hundred
ulp at most over the whole construction), so the δ read off the PMFs is within about 1e-13 of
their exact value; each PMF carries :data:`FLOAT_SLACK` (1e-12) more infinite-loss mass, which
covers it. Tail truncations (the grid's ends, ≤ 1e-20 each) are spreads or infinite-loss mass.

References: V. Feldman and M. Shenfeld, "Privacy amplification by random allocation"
(arXiv:2502.08202, 2025) and the PLD construction of random allocation (arXiv:2602.17284), used
by google/differential-privacy pull request 414 (``RandomAllocationDpEvent``), whose test
``test_random_allocation_basic`` states ε = 2.4265 at δ = 1e-6 for σ = 2, 10 of 100 steps.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from scipy.special import ndtr

from dpledger.accountants.gdp import gdp_delta, gdp_epsilon
from dpledger.errors import ComputationBudgetError, InvalidParameterError
from dpledger.validation import (
    check_delta,
    check_non_negative_finite,
    check_positive_finite,
    check_positive_int,
)

__all__ = [
    "DEFAULT_GRID_STEP",
    "FLOAT_SLACK",
    "random_allocation_delta",
    "random_allocation_epsilon",
    "random_allocation_pld",
]

DEFAULT_GRID_STEP = 0.01
"""The default log-spacing h of the grid (and dp-accounting's loss interval)."""

FLOAT_SLACK = 1e-12
"""Infinite-loss mass added to each direction's PMF to cover floating-point error."""

_TAIL = 1e-20  # Q-mass below / P-mass above the grid's ends, per variable
_MAX_GRID_POINTS = 2_000_000  # of one variable's law (the noise that needs more: z < ~0.01)
_FINEST_AUTOMATIC_STEP = 1e-3
_Z_TAIL = 9.5  # standard deviations that leave less than _TAIL in a normal tail


class _Law:
    """A law on {0} ∪ {e^{kh}: k0 ≤ k < k0 + len(q)} ∪ {+∞ with Q-mass 0}.

    q: Q-masses on the grid; zero: Q-mass at 0; escaped: the first moment carried to +∞ (the
    P-mass of an infinite loss in the remove direction).
    """

    __slots__ = ("escaped", "k0", "q", "zero")

    def __init__(self, k0: int, q: np.ndarray, zero: float, escaped: float) -> None:
        self.k0, self.q, self.zero, self.escaped = k0, q, zero, escaped


def _split(values_log: np.ndarray, masses: np.ndarray, h: float) -> tuple[int, np.ndarray]:
    """Atoms at e^{values_log} spread onto the grid e^{kh} (mean kept): (k0, Q-masses)."""
    k = np.floor(values_log / h).astype(np.int64)
    frac = np.expm1(values_log - k * h) / math.expm1(h)
    frac = np.clip(frac, 0.0, 1.0)
    k0 = int(k.min())
    out = np.zeros(int(k.max()) - k0 + 2)
    np.add.at(out, k - k0, masses * (1.0 - frac))
    np.add.at(out, k - k0 + 1, masses * frac)
    return k0, out


def _lognormal_law(sigma: float, h: float) -> _Law:
    """The law of Y = exp(w/σ² − 1/(2σ²)), w ~ N(0, σ²), spread onto the grid (step 1)."""
    tau = 1.0 / sigma
    half = 0.5 * tau * tau
    lo = math.floor((-half - _Z_TAIL * tau) / h)
    hi = math.ceil((half + _Z_TAIL * tau) / h)
    edges = np.arange(lo, hi + 1) * h  # log y at the grid points
    # Q: log Y ~ N(−τ²/2, τ²); the first moment E[Y; log Y ≤ v] = Φ((v − τ²/2)/τ).
    mass_cdf = ndtr((edges + half) / tau)
    mass_sf = ndtr(-(edges + half) / tau)
    moment_cdf = ndtr((edges - half) / tau)
    moment_sf = ndtr(-(edges - half) / tau)
    # Cell masses and first moments, each from the tail on its side of the median (no
    # cancellation in the tails).
    cell_mass = np.where(edges[1:] + half <= 0, np.diff(mass_cdf), -np.diff(mass_sf))
    cell_moment = np.where(edges[1:] - half <= 0, np.diff(moment_cdf), -np.diff(moment_sf))
    y_lo = np.exp(edges[:-1])
    width = y_lo * math.expm1(h)
    upper = np.clip((cell_moment - y_lo * cell_mass) / width, 0.0, cell_mass)
    q = np.zeros(len(edges))
    q[:-1] += cell_mass - upper
    q[1:] += upper
    # Below the grid: split between 0 and y_lo (mean kept). Above: Q-mass at the top point,
    # the excess first moment to +∞.
    y_min, y_max = math.exp(edges[0]), math.exp(edges[-1])
    below_moment = float(moment_cdf[0])
    q[0] += below_moment / y_min
    zero = max(float(mass_cdf[0]) - below_moment / y_min, 0.0)
    q[-1] += float(mass_sf[-1])
    escaped = max(float(moment_sf[-1]) - y_max * float(mass_sf[-1]), 0.0)
    return _Law(lo, q, zero, escaped)


def _band(h: float) -> int:
    """Smallest d with e^{−dh} ≤ (e^h − 1)/2: beyond it y_i + y_j stays below y_{i+1} and the
    split fraction is at most 1/2."""
    return math.ceil(-math.log(0.5 * math.expm1(h)) / h)


def _dominated_pairs(a: _Law, b: _Law, out: np.ndarray, o0: int, band: int, h: float) -> None:
    """Add the pairs with a's index i > b's index j + band (a dominates) into ``out``."""
    # For j ≤ i − band − 1 the sum lies in [y_i, y_{i+1}), with fraction y_j/(y_i(e^h − 1)).
    cum_mass = np.cumsum(b.q)
    cum_moment = np.cumsum(b.q * np.exp((b.k0 + np.arange(len(b.q))) * h))
    i = a.k0 + np.arange(len(a.q))
    j_top = i - band - 1 - b.k0  # last b position paired with i
    ok = j_top >= 0
    if not np.any(ok):
        return
    pos = np.minimum(j_top[ok], len(b.q) - 1)
    mass = cum_mass[pos]
    moment = cum_moment[pos]
    up = np.minimum(moment / (np.exp(i[ok] * h) * math.expm1(h)), mass)
    ai = a.q[ok]
    out[i[ok] - o0] += ai * (mass - up)
    out[i[ok] - o0 + 1] += ai * up


def _near_pairs(
    first: _Law, second: _Law, d_lo: int, weights: tuple[np.ndarray, np.ndarray], at: int
) -> tuple[int, np.ndarray, np.ndarray]:
    """For the pairs i = j + d, d_lo ≤ d < d_lo + len(weights[0]), (i in ``first``, j in
    ``second``): (the first i, and per i the masses Σ_d q_i·q_j·w(d) for the two weights).

    Each is a direct convolution (sums of non-negative products, never an FFT).
    """
    low = np.convolve(second.q, weights[0])
    high = np.convolve(second.q, weights[1])
    i0 = max(second.k0 + d_lo, first.k0)  # convolution index m is i = second.k0 + d_lo + m
    i1 = min(second.k0 + d_lo + len(low), first.k0 + len(first.q))
    if i1 <= i0:
        return at, np.zeros(0), np.zeros(0)
    a = first.q[i0 - first.k0 : i1 - first.k0]
    m0 = i0 - second.k0 - d_lo
    return i0, a * low[m0 : m0 + i1 - i0], a * high[m0 : m0 + i1 - i0]


def _sum(a: _Law, b: _Law, h: float) -> _Law:
    """The law of A + B (independent) spread onto the grid (step 2)."""
    band = _band(h)
    top = max(a.k0 + len(a.q), b.k0 + len(b.q)) + math.ceil(math.log(2.0) / h) + 2
    o0 = min(a.k0, b.k0)
    out = np.zeros(top - o0)
    ds = np.arange(band + 1)
    g = np.log1p(np.exp(-ds * h))  # log(y_i + y_j) − log y_max for |i − j| = d
    shift = np.floor(g / h).astype(np.int64)
    frac = np.clip(np.expm1(g - shift * h) / math.expm1(h), 0.0, 1.0)
    # the d with one shift form a contiguous range (the shift does not increase with d)
    cuts = np.flatnonzero(np.diff(shift)) + 1
    groups = np.split(ds, cuts)
    for start, (first, second) in enumerate(((a, b), (b, a))):
        for group in groups:
            group = group[group >= start]
            if len(group) == 0:
                continue
            d_lo, s = int(group[0]), int(shift[group[0]])
            weights = (1.0 - frac[group], frac[group])
            i0, low, high = _near_pairs(first, second, d_lo, weights, 0)
            if len(low):
                at = i0 + s - o0
                out[at : at + len(low)] += low
                out[at + 1 : at + 1 + len(high)] += high
        _dominated_pairs(first, second, out, o0, band, h)
    # The atom at 0 is neutral for sums; +∞ absorbs.
    out[a.k0 - o0 : a.k0 - o0 + len(a.q)] += a.q * b.zero
    out[b.k0 - o0 : b.k0 - o0 + len(b.q)] += b.q * a.zero
    return _trimmed(_Law(o0, out, a.zero * b.zero, a.escaped + b.escaped), h)


def _trimmed(law: _Law, h: float) -> _Law:
    """Drop negligible ends: low grid mass to 0 (split keeping the mean is not needed: moving
    an atom at y to {0, +∞} with its first moment to +∞ is a spread), high grid mass to +∞."""
    q = law.q
    y = np.exp((law.k0 + np.arange(len(q))) * h)
    low = np.cumsum(q)
    high = np.cumsum((q * y)[::-1])[::-1]
    first = int(np.searchsorted(low, _TAIL, side="right"))
    last = len(q) - int(np.searchsorted(high[::-1], _TAIL, side="right"))
    first = min(first, max(last - 1, 0))
    zero = law.zero + float(np.sum(q[:first])) + float(np.sum(q[last:]))
    escaped = law.escaped + float(np.sum((q * y)[:first])) + float(np.sum((q * y)[last:]))
    return _Law(law.k0 + first, q[first:last].copy(), zero, escaped)


def _mean_law(sigma: float, steps: int, h: float) -> _Law:
    """The law of S = (Y_1 + … + Y_T)/T under Q, spread onto the grid (steps 1–3)."""
    base = _lognormal_law(sigma, h)
    result: _Law | None = None
    power, n = base, steps
    while True:
        if n & 1:
            result = power if result is None else _sum(result, power, h)
        n >>= 1
        if not n:
            break
        power = _sum(power, power, h)
    assert result is not None
    if steps == 1:
        return result
    values = (result.k0 + np.arange(len(result.q))) * h - math.log(steps)
    k0, q = _split(values, result.q, h)
    return _Law(k0, q, result.zero, result.escaped / steps)


def _check(
    noise_multiplier: Any, num_steps: Any, num_selected: Any, epochs: Any, h: Any
) -> tuple[float, int, int, int, float]:
    sigma = check_positive_finite("noise_multiplier", noise_multiplier)
    steps = check_positive_int("num_steps", num_steps)
    selected = check_positive_int("num_selected", num_selected)
    n_epochs = check_positive_int("epochs", epochs)
    step = check_positive_finite("grid_step", h)
    if selected > steps:
        raise InvalidParameterError(
            "num_selected", num_selected, f"an integer in [1, num_steps = {steps}]"
        )
    if not 1e-4 <= step <= 0.1:
        raise InvalidParameterError("grid_step", h, "a log-spacing in [1e-4, 0.1]")
    return sigma, steps, selected, n_epochs, step


def _effective_step(sigma: float, h: float) -> float:
    """The grid step used: ``h``, or finer (down to 1e-3) when the log-normal's spread τ = 1/σ
    is below 20h, so that its law spans at least about 20 grid cells; refuses a grid of more
    than :data:`_MAX_GRID_POINTS` points."""
    tau = 1.0 / sigma
    step = min(h, max(tau / 20.0, _FINEST_AUTOMATIC_STEP))
    points = (tau * tau + 2.0 * _Z_TAIL * tau) / step
    if not points <= _MAX_GRID_POINTS:
        raise ComputationBudgetError(
            parameter="noise_multiplier",
            value=sigma,
            estimated_bytes=8.0 * points,
            budget_bytes=8.0 * _MAX_GRID_POINTS,
            suggestion="at this little noise amplification hardly helps: use the "
            "no-amplification bound (the rdp or pld accountant), or a larger grid_step",
        )
    return step


def _no_amplification_mu(noise_multiplier: float, num_selected: int, epochs: int) -> float:
    """μ of the no-amplification bound: every record in k·E Gaussian steps of sensitivity 1."""
    return math.sqrt(num_selected * epochs) / noise_multiplier


def random_allocation_pld(
    *,
    noise_multiplier: float,
    num_steps: int,
    num_selected: int = 1,
    epochs: int = 1,
    grid_step: float = DEFAULT_GRID_STEP,
) -> Any:
    """A dp-accounting PLD that dominates random allocation of Gaussian steps (add/remove).

    Each epoch every record is used in ``num_selected`` of ``num_steps`` Gaussian steps chosen
    uniformly at random (balls-in-bins batches: ``num_selected=1``, ``num_steps`` = batches per
    epoch); epochs are independent. The returned PLD's δ(ε) and ε(δ) are upper bounds for both
    directions of add/remove (see the module docstring for the argument).

    Args:
        noise_multiplier: σ > 0, the noise standard deviation over the clipping norm.
        num_steps: T ≥ 1, the steps of one epoch.
        num_selected: k in [1, T], the steps each record is used in per epoch.
        epochs: E ≥ 1, independent epochs.
        grid_step: h in [1e-4, 0.1], the log-spacing of the grid (the error is of order h²);
            for σ above 1/(20h) a finer one is used (down to 1e-3).

    Returns:
        A ``dp_accounting.pld.privacy_loss_distribution.PrivacyLossDistribution``.

    Raises:
        InvalidParameterError: for an argument outside the ranges above.
        ComputationBudgetError: the grid would exceed 2·10⁶ points (σ below about 0.01).
    """
    from dp_accounting.pld import pld_pmf, privacy_loss_distribution

    from dpledger.accountants.pld_composition import self_compose

    sigma, steps, selected, n_epochs, h = _check(
        noise_multiplier, num_steps, num_selected, epochs, grid_step
    )
    h = _effective_step(sigma, h)
    law = _mean_law(sigma, steps // selected, h)
    y = np.exp((law.k0 + np.arange(len(law.q))) * h)
    remove = pld_pmf.DensePLDPmf(
        discretization=h,
        lower_loss=law.k0,
        probs=law.q * y,
        infinity_mass=law.escaped + FLOAT_SLACK,
        pessimistic_estimate=True,
    )
    add = pld_pmf.DensePLDPmf(
        discretization=h,
        lower_loss=-(law.k0 + len(law.q) - 1),
        probs=law.q[::-1].copy(),
        infinity_mass=law.zero + FLOAT_SLACK,
        pessimistic_estimate=True,
    )
    pld = privacy_loss_distribution.PrivacyLossDistribution(remove, add)
    count = selected * n_epochs
    return pld if count == 1 else self_compose(pld, count)[0]


def random_allocation_epsilon(
    *,
    noise_multiplier: float,
    num_steps: int,
    delta: float,
    num_selected: int = 1,
    epochs: int = 1,
    grid_step: float = DEFAULT_GRID_STEP,
) -> float:
    """A certified upper bound on ε(δ) of random allocation with Gaussian steps (add/remove).

    See :func:`random_allocation_pld` for the arguments; ``delta`` is δ in (0, 1).

    Returns:
        ε ≥ 0 such that every allocation of the described kind is (ε, δ)-DP under add/remove:
        the smaller of the amplified bound and the no-amplification one (every record in k·E
        Gaussian steps, μ-GDP with μ = √(kE)/σ), which is also what is returned when the
        amplified bound's grid would exceed 2·10⁶ points (σ below about 0.01).
    """
    target = check_delta("delta", delta)
    sigma, _, selected, n_epochs, _ = _check(
        noise_multiplier, num_steps, num_selected, epochs, grid_step
    )
    plain = gdp_epsilon(_no_amplification_mu(sigma, selected, n_epochs), target)
    pld = _amplified_pld(noise_multiplier, num_steps, num_selected, epochs, grid_step)
    if pld is None:
        return plain
    return min(max(float(pld.get_epsilon_for_delta(target)), 0.0), plain)


def _amplified_pld(
    noise_multiplier: float, num_steps: int, num_selected: int, epochs: int, grid_step: float
) -> Any:
    """:func:`random_allocation_pld`, or None when its grid would exceed the work budget (the
    no-amplification bound then stands alone)."""
    try:
        return random_allocation_pld(
            noise_multiplier=noise_multiplier,
            num_steps=num_steps,
            num_selected=num_selected,
            epochs=epochs,
            grid_step=grid_step,
        )
    except ComputationBudgetError:
        return None


def random_allocation_delta(
    *,
    noise_multiplier: float,
    num_steps: int,
    epsilon: float,
    num_selected: int = 1,
    epochs: int = 1,
    grid_step: float = DEFAULT_GRID_STEP,
) -> float:
    """A certified upper bound on δ(ε) of random allocation with Gaussian steps (add/remove).

    See :func:`random_allocation_pld` for the arguments; ``epsilon`` is ε ≥ 0.

    Returns:
        δ in [0, 1] such that every allocation of the described kind is (ε, δ)-DP (the smaller
        of the amplified and the no-amplification bound, as for
        :func:`random_allocation_epsilon`).
    """
    eps = check_non_negative_finite("epsilon", epsilon)
    sigma, _, selected, n_epochs, _ = _check(
        noise_multiplier, num_steps, num_selected, epochs, grid_step
    )
    plain = gdp_delta(_no_amplification_mu(sigma, selected, n_epochs), eps)
    pld = _amplified_pld(noise_multiplier, num_steps, num_selected, epochs, grid_step)
    if pld is None:
        return plain
    return min(max(float(pld.get_delta_for_epsilon(eps)), 0.0), plain, 1.0)
