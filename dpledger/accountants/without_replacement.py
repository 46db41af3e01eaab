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

Three further facts make the returned number smaller without making it invalid:

* **No amplification is ever lost.** Sampling a subset and then running the query is a mixture
  over subsets; pairing each subset of the dataset with the subset of its neighbour that differs
  in at most the replaced record, joint quasi-convexity of the Rényi divergence gives ε'(α) ≤
  ε(α) = 2α/z². So the minimum of the theorem and 2α/z² is returned. (At γ = 1 the theorem's
  last term alone, 2e^{(α−1)ε(α)}, already exceeds e^{(α−1)ε(α)}, so there the result is exactly
  the unamplified Gaussian 2α/z².)
* **Fractional orders.** The theorem covers integer orders only. The Rényi divergence is
  non-decreasing in its order, so the bound at ⌈α⌉ is also a bound at α; that is what is used
  for a fractional α > 1 (for 1 < α < 2, the bound at 2).
* **Orders are compared with each other.** For the same reason, a bound at any order β ≥ α is a
  bound at α. Theorem 9's bound is *not* monotone in α (at γ = 0.5, z = 20 it is 0.486 at α = 8
  and 0.460 at α = 32), so the value returned at α is the smallest of the bounds computed at the
  requested orders ≥ α. The result is therefore non-decreasing in α over the requested orders;
  asking for more orders can only lower it.

For large z the theorem is loose: its j ≥ 3 terms carry the factor 2 whatever the noise, so A − 1
does not vanish as z → ∞ (it tends to 2·Σ_{j≥3} γ^j C(α, j), not to 0), and the result is then the
unamplified 2α/z². dp-accounting's ``_compute_rdp_sample_wor_gaussian`` is tighter there: for
α ≤ 256 it takes, term by term, the smaller of Theorem 9's term and a Gaussian-specific one built
from forward differences of e^{cgf} (its docstring cites the paper's Theorem 27); for α > 256 it
evaluates exactly the sum above. This module implements only Theorem 9.

Rounding
--------
The sum is evaluated in log space (log-binomials by ``gammaln``, ``logsumexp``), so nothing
overflows for large α or small z; z so small that 2j(j−1)/z² overflows gives +∞. Every term is
exp(Σᵢ aᵢ) of a few float64 quantities aᵢ (log-binomials, j·log γ, 2j(j−1)/z², log 2), each
accurate to a few ulp of its magnitude, so a term's logarithm is off by at most C·u·Σ|aᵢ| with
u = 2⁻⁵² and C = 8 (generous: a handful of operations, each within a few ulp). The largest such
relative error over the terms, the summation's own (number of terms + 4)·u, and a few ulp of the
logarithms taken are added to log(A − 1) before log A = log1p(A − 1) is formed; that and the
division by α − 1 are each rounded up by a few ulp. The unamplified 2α/z² is rounded up too. So the
float64 result is at least the exact value of the bound it reports.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy.special import gammaln

from dpledger.errors import InvalidParameterError
from dpledger.validation import check_positive_finite, check_probability

__all__ = ["MAX_ORDER", "rdp_without_replacement"]

MAX_ORDER = 1 << 20
"""The largest order accepted: the theorem's sum has ⌈α⌉ − 1 terms, summed in one array."""

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


def _theorem_log_excess(gamma: float, z: float, alpha: int) -> float:
    """An upper bound on log(A − 1) of Theorem 9 for integer α ≥ 2, 0 < γ ≤ 1 and 0 < z < ∞,
    its rounding bounded and added (see the module docstring). +∞ where A overflows."""
    inv_z2 = _inverse_square(z)  # relative error ≤ 2u
    if not math.isfinite(inv_z2):
        return math.inf
    log_gamma = math.log(gamma)
    gl_a = float(gammaln(alpha + 1.0))
    # j = 2: γ² C(α, 2)·min{4(e^{ε(2)} − 1), 2e^{ε(2)}}, ε(2) = 4/z²
    eps2 = 4.0 * inv_z2
    second = min(_LOG4 + _log_expm1(eps2), _LOG2 + eps2)
    logc2 = gl_a - float(gammaln(alpha - 1.0)) - math.log(2.0)
    t2 = logc2 + 2.0 * log_gamma + second
    w2 = abs(gl_a) + abs(float(gammaln(alpha - 1.0))) + 1.0 + abs(2.0 * log_gamma)
    w2 += 3.0 * (eps2 + 1.0) + abs(second) + 2.0
    if alpha == 2:
        terms = np.array([t2])
        weights = np.array([w2])
    else:
        j = np.arange(3.0, alpha + 1.0)
        gl_j, gl_r = gammaln(j + 1.0), gammaln(alpha - j + 1.0)
        a_c = gl_a - gl_j - gl_r
        a_g = j * log_gamma
        with np.errstate(over="ignore"):
            a_e = (j - 1.0) * (2.0 * j) * inv_z2
        t = _LOG2 + a_c + a_g + a_e
        w = abs(gl_a) + gl_j + np.abs(gl_r) + np.abs(a_g) + 3.0 * a_e + _LOG2 + 4.0
        terms = np.concatenate(([t2], t))
        weights = np.concatenate(([w2], w))
    top = float(np.max(terms))
    if not math.isfinite(top):
        return top
    scaled = np.exp(terms - top)
    total = float(np.sum(scaled))
    relative = _C * _U * float(np.max(np.where(scaled > 0.0, weights, 0.0)))
    relative += (terms.shape[0] + 4.0) * _U + _C * _U * (abs(top) + 1.0)
    return top + math.log(total) + math.log1p(min(relative, 1.0)) + relative


def _integer_bound(gamma: float, z: float, alpha: int) -> float:
    """min(Theorem 9, unamplified Gaussian) at integer α ≥ 2, rounded up."""
    gaussian = _round_up(2.0 * alpha * _inverse_square(z) * (1.0 + 4.0 * _U))
    if gamma == 0.0:
        return 0.0
    log_excess = _theorem_log_excess(gamma, z, alpha)
    if log_excess == math.inf:
        return gaussian
    # log_excess already carries the rounding of its own logarithm (relative to A − 1)
    log_a = _round_up(float(np.logaddexp(0.0, log_excess)))
    theorem = _round_up(log_a / (alpha - 1.0))
    # the exact moment is > 1 for γ > 0 and finite z: never report 0 for an underflow
    theorem = max(theorem, float(np.nextafter(0.0, 1.0)))
    return min(theorem, gaussian)


def rdp_without_replacement(
    sampling_ratio: float,
    noise_multiplier: float,
    orders: Sequence[float] | np.ndarray,
) -> np.ndarray:
    """Upper bounds on the RDP of one Gaussian sum query on a sample drawn without replacement,
    under the replace-one relation (Wang, Balle & Kasiviswanathan 2019, Theorem 9).

    Args:
        sampling_ratio: γ = b/n, the fixed sample size over the (public) population size,
            0 ≤ γ ≤ 1. γ = 0 (nothing sampled) gives 0; γ = 1 gives the unamplified Gaussian
            2α/z².
        noise_multiplier: z = σ̃/S, the noise standard deviation over the clipping norm,
            0 < z < ∞. The query's replace-one sensitivity is 2S, so the base mechanism's RDP is
            ε(j) = 2j/z². A z small enough that the bound overflows gives +∞.
        orders: the RDP orders α, each finite with 1 < α ≤ ``MAX_ORDER``. A fractional order
            gets the bound at ⌈α⌉.

    Returns:
        A float64 array with one value per order: an upper bound (rounding included) on the
        step's Rényi DP at that order, the minimum of the theorem's bound and 2α/z², and of the
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
    ceilings = np.ceil(alphas).astype(np.int64)
    distinct = np.unique(ceilings)
    values = {int(a): _integer_bound(gamma, z, int(a)) for a in distinct}
    at_ceiling = np.array([values[int(a)] for a in ceilings], dtype=np.float64)
    # the bound at α is also the smallest bound at any requested order ≥ α
    order = np.argsort(alphas, kind="stable")
    suffix_min = np.minimum.accumulate(at_ceiling[order][::-1])[::-1]
    out = np.empty_like(at_ceiling)
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
