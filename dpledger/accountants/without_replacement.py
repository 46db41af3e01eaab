"""Upper bounds on the RDP of a Gaussian sum query on a sample drawn without replacement.

The mechanism
-------------
A step draws a uniformly random subset of exactly b of the n records (sampling without
replacement, γ = b/n), clips each sampled record to L2 norm S, sums them and adds N(0, σ̃²) noise
per coordinate (z = σ̃/S). The population size n is public and neighbouring datasets differ by
**replacing** one record (the replace-one relation), so the sum changes by up to 2S and the
unsampled base mechanism is a Gaussian mechanism with noise multiplier z/2:

    ε(j) = j·(2S)² / (2σ̃²) = 2j / z²       (its RDP at order j; ε(∞) = ∞).

The bound
---------
Wang, Balle & Kasiviswanathan (2019, "Subsampled Rényi Differential Privacy and Analytical Moments
Accountant", AISTATS), Theorem 9 (the general upper bound): for every integer α ≥ 2 the
subsampled mechanism is (α, ε'(α))-RDP with

    ε'(α) = log A / (α − 1),
    A − 1 = γ² C(α, 2)·min{4(e^{ε(2)} − 1), e^{ε(2)}·min{2, (e^{ε(∞)} − 1)²}}
            + Σ_{j=3}^{α} γ^j C(α, j)·e^{(j−1)ε(j)}·min{2, (e^{ε(∞)} − 1)^j}.

For the Gaussian ε(∞) = ∞, so both inner minima are 2:

    A − 1 = γ² C(α, 2)·min{4·expm1(4/z²), 2e^{4/z²}} + 2·Σ_{j=3}^{α} γ^j C(α, j)·e^{2j(j−1)/z²}.

For large z Theorem 9 is loose: its j ≥ 3 terms carry the factor 2 whatever the noise, so A − 1
does not vanish as z → ∞. For the Gaussian the paper's Theorem 27 gives a second bound on each
term j ≥ 3, through the central moments of the base mechanism's likelihood ratio: with p = N(2S,
σ̃²), q = N(0, σ̃²) (one coordinate, the replaced record's largest change) and

    M(m) = E_q[(p/q − 1)^m] = Σ_{k=0}^{m} C(m, k)(−1)^{m−k} e^{(k−1)ε(k)}
         = Σ_k C(m, k)(−1)^{m−k} e^{2k(k−1)/z²}       (the m-th forward difference),

the term j is at most γ^j C(α, j)·4·√(M(2⌊j/2⌋)·M(2⌈j/2⌉)) (for even j, 4γ^j C(α, j)·M(j); for
odd j the Cauchy–Schwarz bound on E_q|p/q − 1|^j by its even neighbours). For α ≤
``GAUSSIAN_TERMS_MAX_ORDER`` (256) every term j ≥ 3 is the smaller of the two, as in TensorFlow
Privacy's and dp-accounting's ``_compute_rdp_sample_wor_gaussian``; above it Theorem 9's sum alone
(theirs too). The j = 2 term is the same in both (4·M(2) = 4(e^{ε(2)} − 1)). The result is never
above Theorem 9's.

Three further facts make the returned number smaller without making it invalid:

* **No amplification is ever lost.** Sampling a subset and then running the query is a mixture
  over subsets; pairing each subset of the dataset with the subset of its neighbour that differs
  in at most the replaced record, joint quasi-convexity of the Rényi divergence gives ε'(α) ≤
  ε(α) = 2α/z². So the minimum of the bound and 2α/z² is returned, at fractional orders too.
  (At γ = 1 Theorem 9's last term alone, 2e^{(α−1)ε(α)}, already exceeds e^{(α−1)ε(α)}, so
  there the result is exactly the unamplified Gaussian 2α/z².)
* **Fractional orders.** The theorems cover integer orders only. For one pair of neighbouring
  datasets, K(α) = (α − 1)·D_α(P‖Q) = log E_Q[(P/Q)^α] is convex in α (Hölder's inequality) and
  K(1) = 0, so with t = α − ⌊α⌋, K(α) ≤ (1 − t)·K(⌊α⌋) + t·K(⌈α⌉) ≤ (1 − t)·log A(⌊α⌋) +
  t·log A(⌈α⌉), for every pair and so for the supremum (the paper's Corollary 10; TensorFlow
  Privacy and dp-accounting interpolate the same way). The bound at a fractional α is that
  interpolation over α − 1, or the bound at ⌈α⌉ (RDP is non-decreasing in the order) where that
  is smaller; for 1 < α < 2 it is the bound at 2.
* **Orders are compared with each other.** For the same reason, a bound at any order β ≥ α is a
  bound at α. The bound is *not* monotone in α (Theorem 9's alone, at γ = 0.05, z = 100, is
  0.0514 at α = 300 and 0.0503 at α = 600), so the value returned at α is the smallest of the
  bounds computed at the requested orders ≥ α. The result is therefore non-decreasing in α over
  the requested orders; asking for more orders can only lower it.

Rounding
--------
The sum is evaluated in log space (log-binomials by ``gammaln``, ``logsumexp``), so nothing
overflows for large α or small z; z so small that 2j(j−1)/z² overflows gives +∞. Every term is
exp(Σᵢ aᵢ) of a few float64 quantities aᵢ (log-binomials, j·log γ, 2j(j−1)/z², log 2), each
accurate to a few ulp of its magnitude, so a term's logarithm is off by at most C·u·Σ|aᵢ| with
u = 2⁻⁵² and C = 8 (generous: a handful of operations, each within a few ulp). The largest such
relative error over the terms, the summation's own (number of terms + 4)·u, and a few ulp of the
logarithms taken are added to log(A − 1) before log A = log1p(A − 1) is formed; that and the
division by α − 1 are each rounded up by a few ulp. The unamplified 2α/z² is rounded up too.

The central moments M(m) are alternating sums that cancel (by up to about 10¹⁰⁰ for z = 20 at
m = 256): each is evaluated in float64 with every term's rounding (C·u times the magnitudes its
logarithm is computed from, plus the summation's) bounded relative to the sum of the terms'
absolute values and added, so the value used is an upper bound whatever the cancellation (loose,
and then Theorem 9's term is kept, where the cancellation swamps the moment); M(2) is taken in
closed form. A Gaussian-specific term's logarithm carries the moments' magnitudes in its weight.
The interpolation at fractional orders and its division by α − 1 are rounded up. So the float64
result is at least the exact value of the bound it reports.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy.special import gammaln

from dpledger.errors import InvalidParameterError
from dpledger.validation import check_positive_finite, check_probability

__all__ = ["GAUSSIAN_TERMS_MAX_ORDER", "MAX_ORDER", "rdp_without_replacement"]

MAX_ORDER = 1 << 20
"""The largest order accepted: the theorem's sum has ⌈α⌉ − 1 terms, summed in one array."""

GAUSSIAN_TERMS_MAX_ORDER = 256
"""The largest integer order whose sum takes Theorem 27's Gaussian-specific terms (as
dp-accounting does): they need the central moments up to order α + 1, each an alternating sum
of α + 2 terms, so their cost grows as α²; above it Theorem 9's sum alone is used."""

_U = float(np.finfo(np.float64).eps)  # 2⁻⁵²: a generous unit roundoff
_C = 8.0  # ulps per operation allowed in a term's logarithm
_LOG2 = math.log(2.0)
_LOG4 = math.log(4.0)


def _round_up(x: float, magnitude: float = 0.0) -> float:
    """x plus a few ulp of x and of ``magnitude`` (the size of what it was computed from)."""
    if not math.isfinite(x):
        return x
    return x + 4.0 * _U * (abs(x) + abs(magnitude))


def _inverse_square(z: float) -> float:
    """1/z², +∞ where z² underflows to 0 or 1/z² overflows."""
    z2 = z * z
    return math.inf if z2 == 0.0 else 1.0 / z2


def _log_expm1(x: float) -> float:
    """log(e^x − 1) for x > 0, accurate to a few ulp (x itself for large x)."""
    if x > 1.0:
        return x + math.log1p(-math.exp(-x))
    return math.log(math.expm1(x))


def _log_binomials(alpha: int, j: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """log C(α, j) for the integers j, and the weight (magnitudes it is computed from) of each."""
    gl_a = float(gammaln(alpha + 1.0))
    gl_j, gl_r = gammaln(j + 1.0), gammaln(alpha - j + 1.0)
    return gl_a - gl_j - gl_r, abs(gl_a) + gl_j + np.abs(gl_r), gl_a


def _certified_log_sum(terms: np.ndarray, weights: np.ndarray) -> float:
    """An upper bound on log Σ exp(tᵢ) of the exact terms, each tᵢ computed from quantities of
    total magnitude ``weights[i]`` (so off by at most C·u·weights[i]); +∞ where a term is."""
    top = float(np.max(terms))
    if not math.isfinite(top):
        return top
    scaled = np.exp(terms - top)
    total = float(np.sum(scaled))
    relative = _C * _U * float(np.max(np.where(scaled > 0.0, weights, 0.0)))
    relative += (terms.shape[0] + 4.0) * _U + _C * _U * (abs(top) + 1.0)
    return top + math.log(total) + math.log1p(min(relative, 1.0)) + relative


def _theorem_terms(gamma: float, z: float, alpha: int) -> tuple[np.ndarray, np.ndarray]:
    """Theorem 9's terms j = 2..α of A − 1 in log space and their weights (for rounding).
    Term j ≥ 3 is log 2 + log C(α, j) + j·log γ + (j − 1)·ε(j); entry 0 is the j = 2 term."""
    inv_z2 = _inverse_square(z)  # relative error ≤ 2u
    log_gamma = math.log(gamma)
    # j = 2: γ² C(α, 2)·min{4(e^{ε(2)} − 1), 2e^{ε(2)}}, ε(2) = 4/z²
    eps2 = 4.0 * inv_z2
    second = min(_LOG4 + _log_expm1(eps2), _LOG2 + eps2)
    (logc2,), (wc2,), _ = _log_binomials(alpha, np.array([2.0]))
    t2 = logc2 + 2.0 * log_gamma + second
    w2 = wc2 + 1.0 + abs(2.0 * log_gamma) + 3.0 * (eps2 + 1.0) + abs(second) + 2.0
    j = np.arange(3.0, alpha + 1.0)
    a_c, w_c, _ = _log_binomials(alpha, j)
    a_g = j * log_gamma
    with np.errstate(over="ignore"):
        a_e = (j - 1.0) * (2.0 * j) * inv_z2
    t = _LOG2 + a_c + a_g + a_e
    w = w_c + np.abs(a_g) + 3.0 * a_e + _LOG2 + 4.0
    return np.concatenate(([t2], t)), np.concatenate(([w2], w))


def _theorem_log_excess(gamma: float, z: float, alpha: int) -> float:
    """An upper bound on log(A − 1) of Theorem 9 for integer α ≥ 2, 0 < γ ≤ 1 and 0 < z < ∞,
    its rounding bounded and added (see the module docstring). +∞ where A overflows."""
    if not math.isfinite(_inverse_square(z)):
        return math.inf
    return _certified_log_sum(*_theorem_terms(gamma, z, alpha))


def _log_central_moments(z: float, top: int) -> np.ndarray:
    """Upper bounds on log E_q[(p/q − 1)^m] for the base pair p = N(2, z²), q = N(0, z²) and
    even m = 2, 4, …, ``top`` (entry m of the array; odd entries are +∞, never used).

    E_q[(p/q)^k] = e^{(k − 1)ε(k)} = e^{2k(k − 1)/z²}, so the moment is the m-th forward
    difference Σ_k C(m, k)(−1)^{m−k} e^{2k(k−1)/z²} (for m = 2, e^{4/z²} − 1, taken in that closed
    form). The alternating sum cancels; every term's
    rounding (at most C·u times the magnitudes its logarithm is computed from, plus the
    summation's (m + 4)·u) is bounded relative to the sum of the terms' absolute values, doubled
    and added, so the result is an upper bound whatever the cancellation (loose where the
    cancellation passes about 10¹⁰: large z and m). A bound that is not positive (the rounding
    swamps the moment) is +∞: the caller then keeps Theorem 9's term.
    """
    inv_z2 = _inverse_square(z)
    out = np.full(top + 1, math.inf)
    if not math.isfinite(inv_z2):
        return out
    if top >= 2:
        # m = 2 in closed form: e^{4/z²} − 1
        log_m2 = _log_expm1(4.0 * inv_z2)
        out[2] = log_m2 + _C * _U * (abs(log_m2) + 4.0 * inv_z2 + 1.0)
    for m in range(4, top + 1, 2):
        k = np.arange(0.0, m + 1.0)
        a_c, w_c, _ = _log_binomials(m, k)
        with np.errstate(over="ignore"):
            a_e = k * (k - 1.0) * (2.0 * inv_z2)
        terms = a_c + a_e
        peak = float(np.max(terms))
        if not math.isfinite(peak):
            break  # larger m overflow too: +∞ from here on
        scaled = np.exp(terms - peak)
        signs = np.where((m - k) % 2.0 == 0.0, 1.0, -1.0)
        weights = w_c + 3.0 * a_e + 2.0
        relative = _C * _U * (float(np.max(weights)) + abs(peak))
        if relative > 1.0:
            break  # the rounding swamps this moment and the larger ones
        error = 2.0 * (math.expm1(relative) + (m + 4.0) * _U)
        bound = float(np.sum(signs * scaled)) + error * float(np.sum(scaled))
        if bound > 0.0:
            log_bound = peak + math.log(bound)
            out[m] = log_bound + _C * _U * (abs(log_bound) + abs(peak) + 1.0)
    return out


def _gaussian_log_excess(gamma: float, z: float, alpha: int, moments: np.ndarray) -> float:
    """An upper bound on log(A − 1) with each term j ≥ 3 the smaller of Theorem 9's and the
    Gaussian-specific one of Theorem 27, γ^j C(α, j)·4·√(M(2⌊j/2⌋)·M(2⌈j/2⌉)) with M(m) the
    central moment E_q[(p/q − 1)^m] (``moments`` holds upper bounds on log M up to 2⌈α/2⌉)."""
    if not math.isfinite(_inverse_square(z)):
        return math.inf
    terms, weights = _theorem_terms(gamma, z, alpha)
    if alpha >= 3:
        j = np.arange(3, alpha + 1)
        a_c, _, _ = _log_binomials(alpha, j.astype(np.float64))
        log_m = 0.5 * (moments[2 * (j // 2)] + moments[2 * ((j + 1) // 2)])
        with np.errstate(invalid="ignore"):
            specific = _LOG4 + log_m + a_c + j * math.log(gamma)
        finite = np.isfinite(specific)
        weights[1:] += np.where(finite, np.abs(log_m) + _LOG4, 0.0)
        terms[1:] = np.where(finite, np.minimum(terms[1:], specific), terms[1:])
    return _certified_log_sum(terms, weights)


def _log_moment(gamma: float, z: float, alpha: int, moments: np.ndarray) -> float:
    """An upper bound on log A(α) = (α − 1)·ε'(α) at integer α ≥ 2 (γ > 0): the tighter sum for
    α ≤ ``GAUSSIAN_TERMS_MAX_ORDER``, Theorem 9's above; +∞ where it overflows."""
    if alpha <= GAUSSIAN_TERMS_MAX_ORDER:
        log_excess = _gaussian_log_excess(gamma, z, alpha, moments)
    else:
        log_excess = _theorem_log_excess(gamma, z, alpha)
    if log_excess == math.inf:
        return math.inf
    # log_excess already carries the rounding of its own logarithm (relative to A − 1)
    log_a = _round_up(float(np.logaddexp(0.0, log_excess)))
    # the exact moment is > 1 for γ > 0 and finite z: never report 0 for an underflow
    return max(log_a, float(np.nextafter(0.0, 1.0)))


def _gaussian(z: float, alpha: float) -> float:
    """The unamplified 2α/z², rounded up."""
    return _round_up(2.0 * alpha * _inverse_square(z) * (1.0 + 4.0 * _U))


def _order_bound(gamma: float, z: float, alpha: float, log_a: dict[int, float]) -> float:
    """The bound at one order α > 1 from upper bounds on log A at ⌊α⌋ (log A(1) = 0) and ⌈α⌉:
    at an integer, log A(α)/(α − 1); at a fractional α, the smaller of the interpolation
    ((1 − t)·log A(⌊α⌋) + t·log A(⌈α⌉))/(α − 1), t = α − ⌊α⌋, and the bound at ⌈α⌉. Both are
    then capped by the unamplified 2α/z²; every operation rounded up."""
    gaussian = _gaussian(z, alpha)
    if gamma == 0.0:
        return 0.0
    floor, ceil = math.floor(alpha), math.ceil(alpha)
    at_ceil = log_a[ceil]
    best = _round_up(at_ceil / (ceil - 1.0)) if math.isfinite(at_ceil) else math.inf
    if floor != ceil and math.isfinite(at_ceil):
        t = alpha - floor  # exact for α ≥ 1
        below = 0.0 if floor == 1 else log_a[floor]
        mixed = _round_up((1.0 - t) * below + t * at_ceil, (1.0 - t) * below + t * at_ceil)
        best = min(best, _round_up(mixed / (alpha - 1.0), mixed / (alpha - 1.0)))
    best = max(best, float(np.nextafter(0.0, 1.0)))
    return min(best, gaussian)


def rdp_without_replacement(
    sampling_ratio: float,
    noise_multiplier: float,
    orders: Sequence[float] | np.ndarray,
) -> np.ndarray:
    """Upper bounds on the RDP of one Gaussian sum query on a sample drawn without replacement,
    under the replace-one relation (Wang, Balle & Kasiviswanathan 2019, Theorems 9 and 27).

    Args:
        sampling_ratio: γ = b/n, the fixed sample size over the (public) population size,
            0 ≤ γ ≤ 1. γ = 0 (nothing sampled) gives 0; γ = 1 gives the unamplified Gaussian
            2α/z².
        noise_multiplier: z = σ̃/S, the noise standard deviation over the clipping norm,
            0 < z < ∞. The query's replace-one sensitivity is 2S, so the base mechanism's RDP is
            ε(j) = 2j/z². A z small enough that the bound overflows gives +∞.
        orders: the RDP orders α, each finite with 1 < α ≤ ``MAX_ORDER``. A fractional order
            gets the interpolation of log A between ⌊α⌋ and ⌈α⌉ (or the bound at ⌈α⌉ where
            smaller; see the module docstring).

    Returns:
        A float64 array with one value per order: an upper bound (rounding included) on the
        step's Rényi DP at that order, the minimum of the theorems' bound and 2α/z², and of the
        bounds at the requested orders ≥ α (valid since RDP is non-decreasing in α; see the
        module docstring). Non-decreasing in α over the requested orders, non-decreasing in γ,
        non-increasing in z.

    Raises:
        InvalidParameterError: for γ outside [0, 1], z not finite and > 0, or orders that are
            not a non-empty one-dimensional sequence of finite numbers in (1, ``MAX_ORDER``].
    """
    gamma = check_probability("sampling_ratio", sampling_ratio)
    z = check_positive_finite("noise_multiplier", noise_multiplier)
    alphas = _check_orders(orders)
    needed = {math.ceil(a) for a in alphas} | {math.floor(a) for a in alphas if a >= 2.0}
    top = min(max(needed), GAUSSIAN_TERMS_MAX_ORDER)
    moments = _log_central_moments(z, top + 1) if gamma > 0.0 and top >= 3 else np.array([])
    log_a = {a: _log_moment(gamma, z, a, moments) for a in needed} if gamma > 0.0 else {}
    at_order = np.array([_order_bound(gamma, z, float(a), log_a) for a in alphas])
    # the bound at α is also the smallest bound at any requested order ≥ α
    order = np.argsort(alphas, kind="stable")
    suffix_min = np.minimum.accumulate(at_order[order][::-1])[::-1]
    out = np.empty_like(at_order)
    out[order] = suffix_min
    return out


def _check_orders(orders: Sequence[float] | np.ndarray) -> np.ndarray:
    """The orders as a float64 array, or an error naming what is wrong."""
    expected = f"a non-empty sequence of finite orders in (1, {MAX_ORDER}]"
    if isinstance(orders, (str, bytes)):
        raise InvalidParameterError("orders", orders, expected)
    try:
        alphas = np.asarray(orders, dtype=np.float64)
    except (TypeError, ValueError):
        raise InvalidParameterError("orders", orders, expected) from None
    if alphas.ndim != 1 or alphas.shape[0] == 0 or np.asarray(orders).dtype == np.bool_:
        raise InvalidParameterError("orders", orders, expected)
    if not np.all(np.isfinite(alphas) & (alphas > 1.0) & (alphas <= MAX_ORDER)):
        raise InvalidParameterError("orders", orders, expected)
    return alphas
