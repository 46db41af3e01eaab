"""Certified upper bounds on the log-moments of the Poisson-subsampled Gaussian mechanism.

This module is pure math (NumPy and SciPy): it returns, for each (q, z, α), a float64 number that
is at least the exact

    log A_α,   A_α = E_{x∼μ0}[(μ(x) / μ0(x))^α],   μ0 = N(0, z²), μ = (1 − q)·N(0, z²) + q·N(1, z²),

the log-moment whose (α − 1)-th fraction is the step's Rényi DP at order α (Mironov, Talwar &
Zhang 2019, "Rényi Differential Privacy of the Sampled Gaussian Mechanism"). Three sources of
error are bounded and added, so that the number stays an upper bound in floating point too:

1. **Cancellation against 1.** For small q or large z, A_α = 1 + (something as small as 1e-21).
   Summing the series for A_α and then taking the logarithm loses every digit of that something
   (measured against a 50-digit integration: 2% too *low* at q = 3.6e-7, z = 1.1, α = 1.1).
   So the series is rearranged to give A_α − 1 directly, as a sum of terms that are each computed
   to a few ulp without subtracting nearly equal numbers, and log A_α = log1p(A_α − 1).
2. **Truncation.** Fractional orders need an infinite series. Past its first ⌊α⌋ + 2 terms the
   series alternates with non-increasing magnitudes (below), so by the alternating-series
   (Leibniz) bound a partial sum that stops just before a negative term is an upper bound on the
   whole sum. Every series is stopped at such an index, so no order is ever left out for not
   converging (a slowly converging order is merely less tight).
3. **Rounding.** Every term is exp(Σᵢ aᵢ) of a few float64 quantities aᵢ (log-binomials, k·log q,
   log Φ, …), each accurate to a few ulp of its magnitude; the error of the sum of aᵢ is at most
   c·u·Σ|aᵢ| with u = 2⁻⁵² and c = 8 (a deliberately generous constant: a handful of operations,
   each within a few ulp). Sensitivities to the rounding of z² and of the split point z₀ (through
   log Φ) are bounded with the exact derivative of log Φ. Summation error is bounded by the
   standard recursive-summation bound u·Σ|partial sums|. The bounds of all terms are added to the
   result before the logarithm, and the logarithm is rounded up.

The series (integer α)
----------------------
With p_k = C(α, k)·q^k·(1 − q)^{α−k} the binomial weights (Σ_k p_k = 1) and s = 1/(2z²):

    A_α − 1 = Σ_{k=2}^{α} p_k·expm1((k² − k)·s),

a sum of non-negative terms (Mironov et al., Sec. 3.2, minus the binomial identity). Exact up to
rounding.

The series (fractional α)
-------------------------
Split the integral at z₀ = z²·log((1 − q)/q) + 1/2, where (1 − q)·μ0 = q·μ1 (Mironov et al.,
Sec. 3.3), and expand μ^α binomially on each side in the ratio that is ≤ 1 there:

    A_α = Σ_{k≥0} C(α, k)·(I_k + J_k),
    I_k = q^k (1 − q)^{α−k} e^{(k²−k)s} Φ((z₀ − k)/z)             (x ≤ z₀),
    J_k = q^{α−k} (1 − q)^k e^{(j²−j)s} Φ((j − z₀)/z),  j = α − k   (x > z₀).

I_k and J_k are non-increasing in k (each is an integral of a ratio ≤ 1 raised to the k-th
power), |C(α, k)| is non-increasing for k ≥ α, and C(α, k) alternates in sign from k = ⌊α⌋ + 2
on. So the tail after index K lies between 0 and the first omitted term: if C(α, K + 1) < 0 the
partial sum S_K ≥ A_α.

For q ≤ 1/2 the same holds for the binomial identity 1 = Σ_k C(α, k)·P_k, P_k = q^k(1 − q)^{α−k}
(P_k is non-increasing when q ≤ 1/2), and subtracting it term by term gives

    A_α − 1 ≤ Σ_{k≤K} C(α, k)·[P_k·expm1((k² − k)s) − P_k e^{(k²−k)s} Φ((k − z₀)/z) + J_k]
              + |C(α, K + 1)|·P_{K+1}

for every K with C(α, K + 1) < 0. This is used for q ≤ 0.45, where P_k decays geometrically.
Each bracket is summed as three terms, none computed by subtracting nearly equal numbers: for
k < z₀ as written (I_k − P_k = P_k·expm1((k²−k)s) − P_k e^{(k²−k)s} Φ((k − z₀)/z)); for k ≥ z₀,
where P_k e^{(k²−k)s} grows without bound, as I_k − P_k. For q > 0.45, A_α itself is summed
(A_α − 1 is then not small unless z is very large, where float64 still keeps ~7 digits of it).

Tightness. Against a 50-digit integration the bound is within 10⁻¹⁰ relative on most of
q ∈ [1e-10, 1), z ∈ [0.1, 1e3], α ∈ (1, 256]. Its weak spot is q near 1/2 or above with very
large z (A_α − 1 ≈ 1e-8): there the terms decay only like k^{−α−1}, and after the 1024 terms
summed the bound still carries up to one omitted term, |C(α, 1024)|·(I₀ + J₀) ≈ 1e-8 at α = 1.1.

Cost. Compared with a plain series summed until its terms fall 30 nats below the total, each term
here carries one more exponential and an error weight, and the stopping index must be followed
by a negative term; ``benchmarks/accountants_bench.py`` measures the whole accountant.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import gammaln, log_ndtr

__all__ = ["fractional_log_moments", "integer_log_moments"]

_U = float(np.finfo(np.float64).eps)  # 2⁻⁵²: a generous unit roundoff
_C = 8.0  # ulps per operation allowed in a term's logarithm (generous, see the module docstring)
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
_BLOCK = 16
_MAX_TERMS = 1024
_STOP_RELATIVE = 1e-10  # stop once the next term is this small relative to the partial sum: the
# bound is valid wherever it stops, and stopping here leaves it at most 1e-10 relative looser
_FIRST_BLOCK = 8  # most series stop within a few terms
_CHUNK_ELEMENTS = 1 << 16
_M_CAP = 1e300  # caps error weights so that 0·weight stays 0 in log space
_STAR_MAX_Q = 0.45
_TINY = float(np.nextafter(0.0, 1.0))


def _round_up(x: np.ndarray, magnitude: np.ndarray | float = 0.0) -> np.ndarray:
    """x plus a few ulp of x and of ``magnitude`` (the size of the terms it was computed from)."""
    with np.errstate(invalid="ignore", over="ignore"):
        out = x + 4.0 * _U * (np.abs(x) + np.abs(magnitude))
    return np.where(np.isnan(out), x, out)


def _log_expm1(x: np.ndarray) -> np.ndarray:
    """log(e^x − 1) for x ≥ 0 (−∞ at 0), accurate to a few ulp."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        small = np.log(np.expm1(np.minimum(x, 1.0)))
        large = x + np.log1p(-np.exp(-np.maximum(x, 1.0)))
    return np.where(x > 1.0, large, small)


def _log_ndtr_and_weight(w: np.ndarray, w_error: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """log Φ(w), and a bound (in ulps) on its absolute error when w is off by ``w_error`` ulps.

    The error weight is |d log Φ / dw|·w_error + the function's own few ulp. d log Φ / dw =
    φ(w)/Φ(w), which is ≤ |w| + 1 for w < −1 and tends to 0 as w → ∞.
    """
    log_phi = log_ndtr(w)
    with np.errstate(over="ignore", invalid="ignore"):
        mills = np.exp(-0.5 * w * w - _LOG_SQRT_2PI - log_phi)
    mills = np.where((w < -30.0) | ~np.isfinite(mills), np.abs(w) + 1.0, mills * 1.01)
    mills = np.where(np.isinf(w), 0.0, mills)
    weight = mills * w_error + np.abs(log_phi) + 1.0
    return log_phi, np.minimum(weight, _M_CAP)


def _s_and_error(z: np.ndarray) -> np.ndarray:
    """s = 1/(2z²), rounded up (never 0 for finite z: the true value is positive)."""
    with np.errstate(over="ignore", divide="ignore"):
        s = 0.5 / (z * z)
    return np.maximum(s * (1.0 + 4.0 * _U), np.nextafter(0.0, 1.0))


# ----------------------------------------------------------------------------- integer orders
def integer_log_moments(q: np.ndarray, z: np.ndarray, alpha: int) -> np.ndarray:
    """Upper bounds on log A_α for an integer order α ≥ 2 and each (q, z), 0 < q < 1, 0 < z < ∞.

    A_α − 1 = Σ_{k=2}^{α} C(α, k) q^k (1 − q)^{α−k} expm1((k² − k)/(2z²)), summed in log space
    with its rounding bounded and added (see the module docstring).
    """
    q = np.asarray(q, dtype=np.float64)
    z = np.asarray(z, dtype=np.float64)
    logq, log1mq = np.log(q), np.log1p(-q)
    s = _s_and_error(z)
    out = np.empty(q.shape[0])
    if alpha < 2:
        raise ValueError(f"alpha must be an integer >= 2, got {alpha}")
    k = np.arange(2, alpha + 1, dtype=np.float64)
    gl_a, gl_k, gl_j = gammaln(alpha + 1.0), gammaln(k + 1.0), gammaln(alpha - k + 1.0)
    logc = gl_a - gl_k - gl_j
    mag_c = abs(gl_a) + np.abs(gl_k) + np.abs(gl_j)
    kk = k * k - k
    rows = max(1, _CHUNK_ELEMENTS // k.shape[0])
    for start in range(0, q.shape[0], rows):
        sl = slice(start, start + rows)
        x = kk * s[sl, None]
        lx = _log_expm1(x)
        a1, a2 = k * logq[sl, None], (alpha - k) * log1mq[sl, None]
        terms = logc + a1 + a2 + lx
        weight = mag_c + np.abs(a1) + np.abs(a2) + np.abs(lx) + 3.0 * (x + 1.0) + 4.0
        out[sl] = _log_sum_bounded(terms, np.minimum(weight, _M_CAP))
    return _log1p_of_log(out)


def _log_sum_bounded(terms: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """log of an upper bound on Σ_k exp(terms[:, k]) (all terms non-negative), given each term's
    logarithm to within ``_C·u·weight`` and counting the summation's rounding."""
    with np.errstate(invalid="ignore", over="ignore"):
        top = np.max(terms, axis=1)
        finite_top = np.where(np.isfinite(top), top, 0.0)
        scaled = np.exp(terms - finite_top[:, None])
        total = np.sum(scaled, axis=1)
        relative = _C * _U * np.max(np.where(scaled > 0.0, weight, 0.0), axis=1)
        relative += (terms.shape[1] + 4.0) * _U + _C * _U * (np.abs(finite_top) + 1.0)
        out = finite_top + np.log(total) + np.log1p(np.minimum(relative, 1.0)) + relative
    out = np.where(np.isposinf(top), np.inf, out)
    return np.where(np.isneginf(top), -np.inf, out)


def _log1p_of_log(log_x: np.ndarray) -> np.ndarray:
    """log(1 + x) from log x, rounded up, and never 0: for 0 < q < 1 and finite z the exact
    log-moment is positive, so the smallest positive float64 bounds it where it underflows."""
    with np.errstate(over="ignore"):
        out = np.logaddexp(0.0, log_x)
    return np.maximum(_round_up(out), _TINY)


# ----------------------------------------------------------------------------- fractional orders
class _Rows:
    """Per-(run, order) constants of the fractional series, for rows still summing."""

    def __init__(self, q: np.ndarray, z: np.ndarray, alpha: np.ndarray) -> None:
        self.logq, self.log1mq = np.log(q), np.log1p(-q)
        self.sigma = z
        self.s = _s_and_error(z)
        with np.errstate(over="ignore", invalid="ignore"):
            gap = self.log1mq - self.logq
            self.z0 = z * z * gap + 0.5
            # absolute error of z₀, in units of u
            self.z0_err = 4.0 * np.abs(z * z * gap) + 1.0
        self.alpha = alpha
        self.floor = np.floor(alpha)
        # log-binomials depend on the order only: computed per distinct order, looked up per row
        self.distinct, self.order = np.unique(alpha, return_inverse=True)
        self.order = self.order.reshape(-1)
        self.gl_a = gammaln(alpha + 1.0)
        # Sum A − 1 where the binomial identity's terms decay geometrically (ratio q/(1 − q) ≤ 0.82,
        # so its tail bound is negligible within the terms summed); else sum A.
        self.star = q <= _STAR_MAX_Q

    def take(self, keep: np.ndarray) -> None:
        for name in (
            "logq",
            "log1mq",
            "sigma",
            "s",
            "z0",
            "z0_err",
            "alpha",
            "floor",
            "gl_a",
            "order",
        ):
            setattr(self, name, getattr(self, name)[keep])
        self.star = self.star[keep]


def _fractional_block(
    rows: _Rows, k: np.ndarray
) -> tuple[
    tuple[np.ndarray, np.ndarray, np.ndarray],
    tuple[np.ndarray, np.ndarray, np.ndarray],
    tuple[np.ndarray, ...],
    np.ndarray,
    np.ndarray,
    np.ndarray,
]:
    """For terms k of every row: the signed pieces' logs, signs and error weights, and the
    log of the binomial-identity tail term |C(α, k)|·P_k (for the q ≤ 1/2 rearrangement)."""
    a = rows.alpha[:, None]
    logq, log1mq = rows.logq[:, None], rows.log1mq[:, None]
    sig, s, z0, z0e = rows.sigma[:, None], rows.s[:, None], rows.z0[:, None], rows.z0_err[:, None]
    j = a - k
    gl_k = gammaln(k + 1.0)
    gl_j = gammaln(rows.distinct[:, None] - k + 1.0)[rows.order]
    logc = rows.gl_a[:, None] - gl_k - gl_j
    mag_c = np.abs(rows.gl_a[:, None]) + np.abs(gl_k) + np.abs(gl_j) + 3.0
    # sign of C(α, k): + up to ⌊α⌋ + 1, then alternating
    beyond = k - rows.floor[:, None] - 1.0
    sign_c = np.where((beyond > 0) & (np.mod(beyond, 2.0) == 1.0), -1.0, 1.0)
    kk = k * k - k
    with np.errstate(invalid="ignore", over="ignore"):
        x_first = np.where(kk == 0.0, 0.0, kk * s)
        x_second = np.where(j * j - j == 0.0, 0.0, (j * j - j) * s)
        a1, a2 = k * logq, j * log1mq
        lp = logc + a1 + a2  # log |C(α, k)|·P_k
        mp = mag_c + np.abs(a1) + np.abs(a2)
        b1, b2 = j * logq, k * log1mq
        # Φ arguments and their error (in ulps): from z₀'s rounding and the division
        w_first = (z0 - k) / sig
        w_second = (j - z0) / sig
        # absolute error of either argument, in units of u: z₀'s, the subtraction's, the division's
        w_err = (z0e + np.abs(z0) + np.abs(k) + np.abs(j)) / sig + np.abs(w_first) + 2.0
        w_err = np.where(np.isfinite(w_err), w_err, _M_CAP)
    phi_second, m_second = _log_ndtr_and_weight(w_second, w_err)
    piece_c = logc + b1 + b2 + x_second + phi_second
    m_c = mag_c + np.abs(b1) + np.abs(b2) + 3.0 * x_second + m_second + 2.0
    # Rows summing A − 1 (q ≤ 1/2): P_k expm1(x) − P_k e^x Φ(−w) ; rows summing A: P_k e^x Φ(w).
    star = rows.star[:, None]
    lx = _log_expm1(x_first)
    # I_k − P_k: before z₀ (w > 0) as P_k·expm1(x) − P_k e^x Φ(−w), whose pieces are small;
    # past z₀ as I_k − P_k, since there P_k e^x grows without bound and the first form cancels.
    # Either way one Φ is needed: Φ(−w) before z₀ (rows summing A − 1), Φ(w) otherwise.
    before = star & (w_first > 0.0)
    phi, m_phi = _log_ndtr_and_weight(np.where(before, -w_first, w_first), w_err)
    piece_a = np.where(before, lp + lx, lp + x_first + phi)
    m_a = mp + np.where(before, np.abs(lx) + 3.0 * (x_first + 1.0), 3.0 * x_first + m_phi) + 2.0
    piece_b = np.where(before, lp + x_first + phi, np.where(star, lp, -np.inf))
    m_b = mp + np.where(before, 3.0 * x_first + m_phi, 0.0) + 2.0
    signs = (sign_c, -sign_c, sign_c)
    pieces = (piece_a, piece_b, piece_c)
    weights = tuple(np.minimum(np.nan_to_num(m, nan=_M_CAP), _M_CAP) for m in (m_a, m_b, m_c))
    tail = np.where(star, lp, -np.inf)
    return pieces, signs, weights, sign_c, tail, mp


def fractional_log_moments(q: np.ndarray, z: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """Upper bounds on log A_α, one per row (q[i], z[i], alpha[i]), for fractional α > 1,
    0 < q < 1 and 0 < z < ∞ (see the module docstring for the series and its bounds)."""
    q = np.asarray(q, dtype=np.float64)
    z = np.asarray(z, dtype=np.float64)
    alpha = np.asarray(alpha, dtype=np.float64)
    n = q.shape[0]
    out = np.full(n, np.inf)
    rows = _Rows(q, z, alpha)
    # Noise so small that (k² − k)/(2z²) overflows over the terms summed: A_α is +∞ in float64.
    with np.errstate(over="ignore"):
        finite = np.isfinite(rows.s * (alpha + _MAX_TERMS) ** 2)
    ids = np.flatnonzero(finite)
    rows.take(finite)
    # Running state per row, scaled by e^{−shift}: the signed sum, the error bound's weight
    # (Σ weight·|term|), and Σ|partial sums| for the summation error.
    shift = np.full(ids.size, -np.inf)
    total = np.zeros(ids.size)
    err = np.zeros(ids.size)
    partial_abs = np.zeros(ids.size)
    starts = [0, *range(_FIRST_BLOCK, _MAX_TERMS, _BLOCK)]
    for b, k0 in enumerate(starts):
        if ids.size == 0:
            break
        last_block = b == len(starts) - 1
        width = (starts[b + 1] if not last_block else _MAX_TERMS) - k0
        k = np.arange(k0, k0 + width, dtype=np.float64)[None, :]
        pieces, signs, weights, sign_c, tail, m_tail = _fractional_block(rows, k)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            block_top = np.max(np.maximum(np.maximum(pieces[0], pieces[1]), pieces[2]), axis=1)
            new_shift = np.maximum(shift, block_top)
            finite_shift = np.where(np.isfinite(new_shift), new_shift, 0.0)
            rescale = np.where(np.isfinite(shift), np.exp(shift - finite_shift), 0.0)
            # carried sums are rescaled with a relative error of u·(|old shift| + |new shift|)
            carry = np.abs(np.where(np.isfinite(shift), shift, 0.0)) + np.abs(finite_shift) + 2.0
            carried_err = (err + carry * np.abs(total)) * rescale
            lift = np.abs(finite_shift)[:, None] + 2.0
            term = np.zeros_like(pieces[0])
            mag = np.zeros_like(pieces[0])
            werr = np.zeros_like(pieces[0])
            for piece, sign, weight in zip(pieces, signs, weights, strict=True):
                v = np.exp(piece - finite_shift[:, None])
                term += sign * v
                mag += v
                werr += (weight + lift) * v
            running = total[:, None] * rescale[:, None] + np.cumsum(term, axis=1)
            err_run = carried_err[:, None] + np.cumsum(werr, axis=1)
            abs_run = partial_abs[:, None] * rescale[:, None] + np.cumsum(
                np.abs(running) + 3.0 * mag, axis=1
            )
            tail_v = np.exp(tail - finite_shift[:, None])
        # Candidate stops: K with C(α, K + 1) < 0 (so K ≥ ⌊α⌋ + 1), K + 1 inside this block.
        nxt_neg = sign_c[:, 1:] < 0.0
        # relative to A − 1: the partial sum itself where A − 1 is summed, else its excess over 1
        with np.errstate(over="ignore"):
            one = np.where(rows.star, 0.0, np.exp(-finite_shift))[:, None]
        reference = np.abs(running[:, :-1] - one)
        small = (mag[:, 1:] + tail_v[:, 1:]) <= _STOP_RELATIVE * reference
        candidate = nxt_neg & (small | last_block)
        if last_block:
            # the last admissible K in the block
            idx = width - 2 - np.argmax(candidate[:, ::-1], axis=1)
            stopped = candidate.any(axis=1)
        else:
            idx = np.argmax(candidate, axis=1)
            stopped = candidate.any(axis=1)
        r = np.flatnonzero(stopped)
        if r.size:
            kk = idx[r]
            bound = (
                running[r, kk]
                + tail_v[r, kk + 1] * (1.0 + _C * _U * m_tail[r, kk + 1])
                + _C * _U * err_run[r, kk]
                + 1.01 * _U * abs_run[r, kk]
            )
            out[ids[r]] = _finish(bound, finite_shift[r], rows.star[r])
        keep = ~stopped
        total, err, partial_abs = running[:, -1], err_run[:, -1], abs_run[:, -1]
        shift = new_shift
        ids, total, err, partial_abs, shift = (
            ids[keep],
            total[keep],
            err[keep],
            partial_abs[keep],
            shift[keep],
        )
        rows.take(keep)
    return out


def _finish(bound: np.ndarray, shift: np.ndarray, star: np.ndarray) -> np.ndarray:
    """log A_α from the scaled bound (on A − 1 where ``star``, on A elsewhere), rounded up."""
    with np.errstate(divide="ignore", invalid="ignore"):
        log_bound = np.where(bound > 0.0, np.log(np.where(bound > 0.0, bound, 1.0)), -np.inf)
        log_value = shift + log_bound
    log_value = _round_up(log_value, shift)
    return np.where(star, _log1p_of_log(log_value), np.maximum(log_value, _TINY))
