"""Composition of discretised privacy losses in the Fourier domain, with certified error terms.

Let Ỹ_r be the discretised loss of distinct run r (one direction), on the mesh hℤ, composed k_r
times. The composed loss S̃ = Σ_r Σ_{i ≤ k_r} Ỹ_{r,i} has characteristic function

    G(ω) = Π_r F_r(ω)^{k_r},   F_r(ω) = Σ_j p_{r,j} e^{−iωjh}.

Sampled at ω_m = 2πm/(Nh), G is the DFT of the N-periodic wrap of the law of S̃; Gopi, Lee &
Wutschitz (2021) take the inverse FFT on a window [A, A + Nh) chosen so that little mass wraps.
Three errors separate the wrapped, computed law from the law of S̃, and each is bounded here:

* **wrap**: the mass of S̃ below A or above A + Nh, bounded by Chernoff's inequality with the MGF
  of the discrete steps (``window``);
* **band**: we compute G_m only for m ≤ M when the rest is provably negligible:
  Σ_{m>M} |G_m| ≤ Σ_m Π_r β_r(ω_m)^{k_r} for per-run bounds β_r ≥ |F_r| (the Taylor bound
  |1 − ω²σ²/2| + |ω|³ρ₃/6, the total-variation bound TV/(2|sin(ωh/2)|), and a small FFT of the
  run's dense atoms with a Lipschitz margin). A δ computed from the band-limited G differs from
  the wrapped one by at most 2·Σ_{m>M}|G_m|. When no small M exists the full spectrum is used.
  Band limiting is what makes ledgers with many distinct runs cheap: the per-run cost is the
  number of atoms, not the window size.
* **floating point**: an estimate from the relative error of each F_r(ω_m), amplified by k_r.

The coupling of the discretisation (``discretisation`` module) gives the lower-bound shift t: by
Chernoff's inequality with the per-bin-width MGF bound e^{λc(r) + λ²r²/8},
Pr[Σ(Ỹ − Y) > t] ≤ η for t = min_λ (Σ_r k_r log M_r(λ) + log(1/η))/λ.

A full-batch (q = 1) part is a Gaussian mechanism of parameter μ and is not discretised: its
privacy profile δ_μ is folded in exactly, δ(ε) = Σ_s f(s)·δ_μ(ε − s).

This module is over 500 lines because it is one computation with its error analysis: the
window, the band limit, the floating-point estimate and the coupling shift each bound one error
of the same composed law, and :class:`ComposedLoss` charges them together to δ; splitting them
would separate each bound from the composition whose error it certifies.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import attrs
import numpy as np
import scipy.fft
import scipy.signal

from dpledger.accountants.prv.deadline import _check_deadline
from dpledger.accountants.prv.discretisation import (
    FACTORIALS,
    TERMS,
    DiscretePrv,
    DiscreteSteps,
    conditional_bias,
    dot,
)
from dpledger.accountants.prv.gaussian import gaussian_delta

__all__ = [
    "MAX_MESH_INDEX",
    "ComposedLoss",
    "check_index_range",
    "compose",
    "compose_prefixes",
    "coupling_shift",
]

_U = np.finfo(float).eps
_MAX_CLOSED_FORM_BAND = 8192
_MAX_BAND_WORK = 4e9
_PI_LONG = np.longdouble("3.14159265358979323846264338327950288")
_TARGET_TRUNCATION = 1e-21
MAX_MESH_INDEX = 2**46
"""The largest |mesh index| a composed window may reach. Beyond it (a loss of 7·10¹³ mesh
widths: ledgers of ~10¹⁰ steps and more, whose mesh is fine and whose loss is large) float64
positions j·h and the int64 phase products j·m are no longer exact, and an overflow there once
placed the whole composed law in a two-point window (ε = 0)."""


# ---------------------------------------------------------------------------- MGF and window
def lambda_grid(sigma_small: float, sigma_large: float, eta: float, h: float) -> np.ndarray:
    """Chernoff λ from base/2^16 to 8·base (base = √(2 log 1/η)/σ) for σ in the given range.

    Small λ matter for heavy tails (few steps of a heavy-tailed loss); λ ≤ 3/h keeps the Taylor
    blocks of the MGF at least one mesh point wide.
    """
    root = math.sqrt(2 * math.log(1 / eta))
    low, high = root / sigma_large * 2.0**-16, root / sigma_small * 8.0
    count = max(math.ceil(4 * math.log2(high / low)) + 1, 2)
    lam = np.geomspace(low, high, count)
    lam = lam[lam <= 3.0 / h]
    return lam if lam.size else np.array([3.0 / h])


def mgf_block(lam: np.ndarray, h: float) -> int:
    """The widest power-of-two block with λ_max·block·h/2 ≤ 1.5."""
    block = 1
    while (2 * block) * h * lam[-1] / 2 <= 1.5 and block < (1 << 20):
        block *= 2
    return block


def _support(steps: DiscreteSteps, counts: np.ndarray) -> tuple[int, int]:
    """Mesh indices of the smallest and largest value S̃ can take, in exact integers (a
    count of 10¹⁵ steps times an index of 10⁷ overflows int64)."""
    k = [int(c) for c in counts]
    lo = sum(c * int(x) for c, x in zip(k, steps.lowest, strict=True))
    hi = sum(c * int(x) for c, x in zip(k, steps.highest, strict=True))
    return lo, hi


def check_index_range(start: int, size: int, band: int) -> None:
    """Raise MemoryError (the caller coarsens the mesh) unless the window's mesh arithmetic is
    exact: every index |j| ≤ :data:`MAX_MESH_INDEX` (so j and j·h are exact in float64 and ε/h
    converts to an index without overflow), and 2·size·(band + 1) < 2⁶² (the phase products
    j·m reduced modulo the window stay within int64)."""
    far = max(abs(start), abs(start + size))
    if far > MAX_MESH_INDEX or 2 * size * (band + 1) >= 2**62:
        raise MemoryError(
            f"the composed window reaches mesh index {far:.3g} with {size:.3g} points and "
            f"band {band}: beyond exact int64/float64 index arithmetic (|index| <= "
            f"{MAX_MESH_INDEX:.3g}); the mesh must be coarser"
        )


class _Chernoff:
    """Λ(λ) = Σ_r k_r·log E[e^{λỸ_r}] on a grid of λ around the composed law's scale."""

    def __init__(
        self,
        steps: DiscreteSteps,
        counts: np.ndarray,
        eta: float,
        lam: np.ndarray | None = None,
        log_mgf: np.ndarray | None = None,
    ) -> None:
        h = steps.h
        if lam is None:
            sigma = max(math.sqrt(dot(counts.astype(float), steps.var)), 4 * h)
            lam = lambda_grid(sigma, sigma, eta, h)
        self.lam = lam
        self.block = mgf_block(lam, h)
        used = counts > 0
        if log_mgf is None:
            log_mgf = steps.log_mgf(np.concatenate([lam, -lam]), self.block)
        total = np.einsum("r,rl->l", counts[used].astype(float), log_mgf[used])
        self.up, self.down = total[: lam.size], total[lam.size :]

    def above(self, s: float) -> float:
        """Bound on Pr[S̃ ≥ s]."""
        return math.exp(min(0.0, float(np.min(self.up - self.lam * s))))

    def below(self, s: float) -> float:
        """Bound on Pr[S̃ ≤ s]."""
        return math.exp(min(0.0, float(np.min(self.down + self.lam * s))))

    def quantiles(self, eta: float) -> tuple[float, float]:
        """(s_lo, s_hi) with Pr[S̃ ≤ s_lo] ≤ eta and Pr[S̃ ≥ s_hi] ≤ eta."""
        log_eta = math.log(eta)
        s_hi = float(np.min((self.up - log_eta) / self.lam))
        s_lo = float(np.max(-(self.down - log_eta) / self.lam))
        return s_lo, s_hi


# ---------------------------------------------------------------------------- coupling
def coupling_lambdas(steps_small: float, steps_large: float, h: float, eta: float) -> np.ndarray:
    """λ grid for :func:`coupling_shift` covering compositions of steps_small..steps_large."""
    root = math.sqrt(8.0 * -math.log(eta)) / h
    return np.geomspace(
        root / math.sqrt(steps_large) * 10**-2.5, root / math.sqrt(steps_small) * 10**1.5, 161
    )


def coupling_log_mgf(steps: DiscreteSteps, lam: np.ndarray) -> np.ndarray:
    """(steps × λ) log of the per-step MGF bound Σ_w m_w·e^{λc(w) + λ²w²/8} + m_out."""
    w = steps.widths * steps.h
    bias = np.array([conditional_bias(float(x)) for x in w])
    expo = lam[:, None] * bias[None, :] + (lam[:, None] * w[None, :]) ** 2 / 8.0  # (λ, widths)
    with np.errstate(divide="ignore"):
        log_m = np.log(np.c_[steps.width_masses, steps.out_mass])  # (steps, widths+1)
    expo = np.c_[expo, np.zeros(lam.size)]  # out-of-range steps: error 0
    terms = log_m[:, None, :] + expo[None, :, :]  # (steps, λ, widths+1)
    top = terms.max(axis=2, keepdims=True)
    return np.log(np.exp(terms - top).sum(axis=2)) + top[:, :, 0]


def coupling_shift(
    steps: DiscreteSteps,
    counts: np.ndarray,
    eta: float,
    table: tuple[np.ndarray, np.ndarray] | None = None,
) -> float:
    """t with Pr[Σ(Ỹ − Y) > t] ≤ eta for the discretisation coupling (the lower-bound shift).

    Given Y in a bin of width w, Ỹ − Y has conditional mean ≤ c(w) and lies in an interval of
    length w, so E[e^{λ(Ỹ−Y)}] ≤ Σ_w m_w·e^{λc(w) + λ²w²/8} + m_out (Hoeffding's lemma per bin;
    out-of-range steps are excluded from the lower bound, so their error counts as 0), and
    Chernoff's inequality gives t = min_λ (Σ_r k_r log M_r(λ) + log 1/η)/λ. ``table`` is a
    precomputed (λ, :func:`coupling_log_mgf`) pair.
    """
    if table is None:
        k = float(counts.sum())
        lam = coupling_lambdas(k, k, steps.h, eta)
        table = (lam, coupling_log_mgf(steps, lam))
    lam, log_mgf = table
    used = counts > 0
    total = np.einsum("r,rl->l", counts[used].astype(float), log_mgf[used])
    return float(np.min((total - math.log(eta)) / lam))


# ---------------------------------------------------------------------------- band limit
@functools.lru_cache(maxsize=64)
def _cells(n_half: int) -> np.ndarray:
    """Start indices of geometric cells (ratio ~1.04) covering the fine frequencies 1..n_half,
    followed by n_half + 1."""
    count = int(math.log(max(n_half, 2)) / math.log(1.04)) + 2
    edges = np.unique(np.ceil(1.04 ** np.arange(count)).astype(np.int64))
    edges = np.unique(np.r_[np.arange(1, min(26, n_half + 1)), edges])
    return np.r_[edges[edges <= n_half], n_half + 1]


def _taylor(w_lo: np.ndarray, w_hi: np.ndarray, var: np.ndarray, rho3: np.ndarray) -> np.ndarray:
    """|1 − ω²σ²/2| + |ω|³ρ₃/6 maximised over each cell (steps × cells)."""
    v = var[:, None]
    a = np.maximum(np.abs(1 - 0.5 * v * w_lo**2), np.abs(1 - 0.5 * v * w_hi**2))
    return a + rho3[:, None] * w_hi**3 / 6.0


def _bounds(
    steps: DiscreteSteps, used: np.ndarray, w_lo: np.ndarray, w_hi: np.ndarray
) -> np.ndarray:
    """β ≥ |F_r(ω)| on each cell [w_lo, w_hi] (ω ≤ π/h), for the steps in ``used``."""
    h = steps.h
    mass = steps.mass[used][:, None]
    sparse = steps.sparse_mass[used][:, None]
    bound = mass * _taylor(w_lo, w_hi, steps.var[used], steps.rho3[used])
    dense = steps.dense_mass[used][:, None]
    dense_taylor = dense * _taylor(w_lo, w_hi, steps.dense_var[used], steps.dense_rho3[used])
    bound = np.minimum(bound, np.where(dense > 0, dense_taylor + sparse, np.inf))
    with np.errstate(divide="ignore"):
        tv = steps.dense_tv[used][:, None] / (2 * np.sin(np.minimum(w_lo * h, math.pi) / 2))
    bound = np.minimum(bound, np.where(dense > 0, tv + sparse, np.inf))
    return np.minimum(bound, mass)


def _fft_bound(prv: DiscretePrv, w_lo: np.ndarray, w_hi: np.ndarray) -> np.ndarray:
    """max |F_dense| over each cell from an oversampled FFT, plus a Lipschitz margin."""
    dense = prv.dense
    if dense.size == 0:
        return np.zeros(w_lo.size)
    n_f = scipy.fft.next_fast_len(max(8 * dense.size, 256), real=True)
    spec = np.abs(scipy.fft.rfft(dense, n_f))
    step = 2 * math.pi / (n_f * prv.h)
    c_lo = np.clip(np.rint(w_lo / step).astype(np.int64), 0, spec.size - 1)
    c_hi = np.clip(np.rint(w_hi / step).astype(np.int64), 0, spec.size - 1)
    out = np.array([spec[a : b + 1].max() for a, b in zip(c_lo, c_hi, strict=True)])
    return out + prv.dense_abs_deviation * step / 2


def band_limit(
    steps: DiscreteSteps,
    counts: np.ndarray,
    n: int,
    eta: float,
    log_beta: np.ndarray | None = None,
) -> tuple[int, float]:
    """(M, bound): the smallest band M found with 2·Σ_{m>M}|G_m| ≤ eta, and that bound.

    ``log_beta`` optionally holds the (steps × cells) log bounds of :func:`band_bounds` for the
    same n (they do not depend on the counts). Returns (n//2, 0.0) when no band below Nyquist is
    certified.
    """
    edges = _cells(n // 2)
    widths = np.diff(edges).astype(float)
    if log_beta is None:
        log_beta = band_bounds(steps, n, np.flatnonzero(counts > 0))
        log_beta_used = log_beta
    else:
        log_beta_used = log_beta[counts > 0]
    k = counts[counts > 0].astype(float)

    def tail(log_b: np.ndarray) -> np.ndarray:
        terms = widths * np.exp(np.minimum(log_b, 0.0))
        return 2 * np.cumsum(terms[::-1])[::-1]

    log_b = np.einsum("r,rc->c", k, log_beta_used)
    best = _first_cell(tail(log_b), eta)
    if best is None:
        return n // 2, 0.0
    return int(edges[best]) - 1, float(tail(log_b)[best])


def band_bounds(steps: DiscreteSteps, n: int, rows: np.ndarray) -> np.ndarray:
    """(rows × cells) log β_r ≥ log|F_r| on the geometric frequency cells of an n-point DFT.

    β_r is the smallest of the Taylor, total-variation and small-FFT bounds (the FFT bound for
    the eight steps of largest variance only, where it is most likely to matter).
    """
    h = steps.h
    edges = _cells(n // 2)
    step = 2 * math.pi / (n * h)
    w_lo = edges[:-1] * step
    w_hi = (edges[1:] - 1) * step
    beta = _bounds(steps, rows, w_lo, w_hi)
    for i in np.argsort(-steps.var[rows])[:8]:
        prv = steps.prvs[rows[i]]
        cache = prv.__dict__.setdefault("_fft_cells", {})
        if n not in cache:
            cache[n] = _fft_bound(prv, w_lo, w_hi)
        beta[i] = np.minimum(beta[i], cache[n] + steps.sparse_mass[rows[i]])
    with np.errstate(divide="ignore"):
        return np.maximum(np.log(np.minimum(beta, 1.0)), -1e300)


def _first_cell(tails: np.ndarray, eta: float) -> int | None:
    ok = np.flatnonzero(tails <= eta)
    if ok.size == 0:
        return None
    # tails is non-increasing, so the first index that passes starts a passing suffix
    return int(ok[0])


# ---------------------------------------------------------------------------- composed law
@attrs.frozen(eq=False, slots=False)
class ComposedLoss:
    """The composed discrete loss of one direction on a window, with its error terms.

    Attributes:
        h: mesh width.
        start: mesh index J_A of the window's first point.
        size: N, the number of mesh points of the window (and of the DFT).
        spectrum: G_m for m = 0..band.
        band: the highest frequency index kept (N//2 means the full spectrum).
        gaussian_mu: μ of the exact Gaussian part (0 for none).
        wrap_below: Chernoff bound on the mass below the window.
        wrap_above: Chernoff bound on the mass above the window.
        band_error: bound on the δ error of dropping frequencies above the band.
        float_error: estimate of the δ error of floating-point arithmetic.
        out_probability: probability that some step falls outside its discretised range.
        shift: the coupling shift t of the lower bound.
        shift_failure: the probability η with which the shift may fail.
        method: ``"band"`` or ``"full"``.
    """

    h: float
    start: int
    size: int
    spectrum: np.ndarray
    band: int
    gaussian_mu: float
    wrap_below: float
    wrap_above: float
    band_error: float
    float_error: float
    out_probability: float
    shift: float
    shift_failure: float
    method: str

    @property
    def upper_slack(self) -> float:
        """What the upper bound adds to the computed δ."""
        return self.out_probability + self.wrap_above + self.band_error + self.float_error

    @property
    def lower_slack(self) -> float:
        """What the lower bound subtracts from the computed δ (at ε + shift)."""
        return (
            self.shift_failure
            + self.wrap_below
            + self.wrap_above
            + self.band_error
            + self.float_error
        )

    @property
    def top(self) -> float:
        """The loss at the window's last point."""
        return (self.start + self.size - 1) * self.h

    # ------------------------------------------------------------------ evaluation
    def delta(self, epsilon: float) -> float:
        """δ(ε) of the computed (wrapped, band-limited) law, with the Gaussian part folded in."""
        return float(self.delta_many(np.array([float(epsilon)]))[0])

    def delta_many(self, epsilon: np.ndarray) -> np.ndarray:
        """δ at each ε of an array (vectorised; see :meth:`delta`)."""
        epsilon = np.asarray(epsilon, dtype=float)
        if self.gaussian_mu == 0.0 and self.band < min(self.size // 2, _MAX_CLOSED_FORM_BAND):
            return self._closed_form(epsilon)
        if self.gaussian_mu > 0:
            f = self._density()
            s = (self.start + np.arange(self.size)) * self.h
            out = np.empty(epsilon.size)
            for i, e in enumerate(epsilon):
                _check_deadline()  # each point costs a pass over the whole window
                out[i] = max(dot(f, gaussian_delta(e - s, self.gaussian_mu)), 0.0)
            return out
        return self._materialised(epsilon)

    def _kernel_parts(self) -> tuple[np.ndarray, ...]:
        """The ε-independent pieces of the closed form, in the spectrum's precision."""
        cache = self.__dict__
        if "_parts" not in cache:
            real: type[np.floating[Any]] = (
                np.longdouble if self.spectrum.dtype == np.clongdouble else np.float64
            )
            tau = 2 * (_PI_LONG if real is np.longdouble else real(math.pi))
            hh = real(self.h)
            m = np.arange(1, self.band + 1, dtype=np.int64)
            theta = (tau / self.size) * m.astype(real)
            cache["_parts"] = (
                m,
                hh,
                tau,
                -np.expm1(1j * theta),  # 1 − z
                -np.expm1(-hh + 1j * theta),  # 1 − z·e^{−h}
                -np.expm1(-hh),  # 1 − e^{−h}
            )
        return cache["_parts"]

    def _closed_form(self, epsilon: np.ndarray) -> np.ndarray:
        """δ(ε) = (1/N)·Σ_m G_m·K_m(ε) with K_m the geometric sums of the module docstring.

        K_m(ε) = Σ_{j=J₀}^{J₁} z^j (1 − e^{ε − jh}) for z = e^{2πim/N}, J₀ the first mesh point
        above ε and J₁ the window's last; the arithmetic follows the spectrum's precision.
        """
        n = self.size
        m, hh, tau, one_minus_z, one_minus_zh, one_minus_h = self._kernel_parts()
        j0 = self._first_index(epsilon)
        count = self.start + n - j0
        live = count > 0
        j0, count = j0[live], count[live]
        real = hh.dtype.type if hasattr(hh, "dtype") else np.float64
        scale = np.exp(epsilon[live].astype(real) - j0.astype(real) * hh)  # ≤ 1
        phase0 = (tau / n) * np.mod(np.outer(np.mod(j0, n), m), n).astype(real)
        phase_count = (tau / n) * np.mod(np.outer(count, m), n).astype(real)
        first = -np.expm1(1j * phase_count) / one_minus_z
        second = (
            scale[:, None]
            * -np.expm1(-count.astype(real)[:, None] * hh + 1j * phase_count)
            / one_minus_zh
        )
        kernel = np.exp(1j * phase0) * (first - second)
        k0 = count - scale * (-np.expm1(-count.astype(real) * hh)) / one_minus_h
        g = self.spectrum
        value = (g[0].real * k0 + 2 * np.einsum("em,m->e", kernel, g[1:]).real) / n
        out = np.zeros(epsilon.size)
        out[live] = np.maximum(value.astype(float), 0.0)
        return out

    def _first_index(self, epsilon: np.ndarray) -> np.ndarray:
        """The first window index above each ε (start … start + size), clipped in float64
        before the conversion to int64, so that no ε (however large) overflows it."""
        first = np.floor(epsilon / self.h) + 1.0
        return np.clip(first, self.start, self.start + self.size).astype(np.int64)

    def _density(self) -> np.ndarray:
        cache = self.__dict__
        if "_f" not in cache:
            full = np.zeros(self.size // 2 + 1, dtype=complex)
            full[: self.band + 1] = self.spectrum[: self.band + 1]
            f = scipy.fft.irfft(full, n=self.size)
            cache["_f"] = np.roll(f, -(self.start % self.size))
        return cache["_f"]

    def _suffix(self) -> tuple[np.ndarray, np.ndarray]:
        """U(i) = Σ_{j>i} f_j(1 − e^{−(j−i)h}) and V(i) = Σ_{j≥i} f_j e^{−(j−i)h}."""
        cache = self.__dict__
        if "_uv" not in cache:
            f = self._density()
            decay = math.exp(-self.h)
            rev = f[::-1]
            v = scipy.signal.lfilter([1.0], [1.0, -decay], rev)[::-1]
            tail = np.cumsum(rev)[::-1]  # T1(i) = Σ_{j≥i} f_j
            shifted = np.r_[tail[1:], 0.0]
            u = scipy.signal.lfilter([-math.expm1(-self.h)], [1.0, -decay], shifted[::-1])[::-1]
            cache["_uv"] = (u, v)
        return cache["_uv"]

    def _materialised(self, epsilon: np.ndarray) -> np.ndarray:
        """δ(ε) = U(i₀) + (1 − e^{ε − s_{i₀}})·V(i₀) for the first window point s_{i₀} > ε."""
        u, v = self._suffix()
        i0 = self._first_index(epsilon) - self.start
        live = i0 < self.size
        out = np.zeros(epsilon.size)
        idx = i0[live]
        s0 = (self.start + idx) * self.h
        out[live] = np.maximum(u[idx] + (-np.expm1(epsilon[live] - s0)) * v[idx], 0.0)
        return out


def _float_error(spectrum: np.ndarray, rel: np.ndarray, n: int, ulp: float) -> float:
    """Estimate of the δ error from the relative error ``rel`` of each computed G_m.

    δ = (1/N)·Σ_m G_m·K_m with |K_m|/N ≤ 1 for m = 0 and ≤ 1/m otherwise (the kernel is a
    geometric sum), so the error is at most Σ_m |ΔG_m|·min(1, 1/m), counted twice for ±m; the
    final summation adds a few ulps of Σ|G_m|.
    """
    weight = 1.0 / np.maximum(np.arange(spectrum.size), 1)
    mag = np.abs(spectrum).astype(float)
    err = mag * np.minimum(rel, 1e300) * weight
    size = mag * weight
    if spectrum.size > _MAX_CLOSED_FORM_BAND:  # evaluated through an inverse FFT
        size = size * math.log2(max(n, 2))
    return float(err[0] + 2 * err[1:].sum() + 8 * ulp * (size[0] + 2 * size[1:].sum()))


def compose(
    steps: DiscreteSteps,
    counts: np.ndarray,
    *,
    gaussian_mu: float,
    eta_wrap: float,
    eta_band: float,
    eta_shift: float,
    max_points: int,
    method: str = "auto",
    precise: bool = False,
) -> ComposedLoss:
    """Compose the steps of one direction ``counts`` times each and bound every error term.

    Args:
        steps: the discretised distinct steps.
        counts: how many times each is composed (at least one count ≥ 1).
        gaussian_mu: μ of the exact Gaussian (full-batch) part, 0 for none.
        eta_wrap: target wrap mass on each side of the window.
        eta_band: target band-limit error.
        eta_shift: failure probability of the lower-bound shift.
        max_points: largest window (in mesh points) the full spectrum may use.
        method: ``"auto"``, or ``"full"`` to force the full spectrum (for checks).
        precise: compute the spectra and their powers in extended precision
            (``numpy.longdouble``), for small δ where float64 rounding, amplified k-fold by
            the powers, would not be small against δ.

    Raises:
        MemoryError: when neither a certified band nor a full spectrum of at most
            ``max_points`` points is available (the caller coarsens the mesh).
    """
    counts = np.asarray(counts, dtype=np.int64)
    h = steps.h
    used = np.flatnonzero(counts > 0)
    chernoff = _Chernoff(steps, counts, eta_wrap)
    s_lo, s_hi = chernoff.quantiles(eta_wrap)
    lo, hi = _support(steps, counts)
    j_lo, j_hi, n = _window(s_lo, s_hi, h, lo, hi)
    above = 0.0 if j_hi >= hi else chernoff.above((j_hi + 1) * h)
    below = 0.0 if j_lo <= lo else chernoff.below((j_lo - 1) * h)
    full_cost = used.size * n * math.log2(n) * 2.0
    band, band_error = n // 2, 0.0
    if n > 4096 and method != "full":
        band, band_error = band_limit(steps, counts, n, eta_band)
    check_index_range(j_lo, n, band)
    use_band = False
    if band < n // 2:
        block, terms, remainder = _spectral_block(chernoff.block, n, band)
        blocks = steps.block_moments(block, terms)[0].size
        band_cost = blocks * (band + 1) * (terms + 8.0)
        use_band = band_cost < full_cost or n > max_points
        if use_band and band_cost > _MAX_BAND_WORK:
            raise MemoryError(f"a band of {band} frequencies over {blocks} blocks is too large")
    if n > max_points and (not use_band or gaussian_mu > 0 or band >= _MAX_CLOSED_FORM_BAND):
        # the full spectrum, the Gaussian fold and the materialised δ all use the whole window
        raise MemoryError(f"window of {n} points exceeds the limit of {max_points}")
    if not use_band:
        band, band_error, remainder = n // 2, 0.0, 0.0
    if use_band:
        spectra = steps.band_spectrum(n, band, block, terms, precise)[used]
    else:
        spectra = np.stack([steps.full_spectrum(int(i), n, precise) for i in used])
    return _assemble(
        steps,
        counts,
        _log(spectra),
        np.abs(spectra).astype(float),
        start=j_lo,
        size=n,
        band=band,
        wraps=(below, above),
        band_error=band_error,
        unit=(4 if use_band else 2 * math.log2(n)) * _ulp(precise) + remainder,
        closed_form=precise and use_band and band < _MAX_CLOSED_FORM_BAND and gaussian_mu == 0,
        gaussian_mu=gaussian_mu,
        eta_shift=eta_shift,
        method="band" if use_band else "full",
    )


def _window(s_lo: float, s_hi: float, h: float, lo: int, hi: int) -> tuple[int, int, int]:
    """(j_lo, j_hi, n): the window [s_lo, s_hi] in mesh indices, within the support [lo, hi]
    (S̃ cannot leave [Σ k_r·min_r, Σ k_r·max_r]), widened to an even FFT-friendly size n.

    Raises:
        MemoryError: when the window reaches beyond :data:`MAX_MESH_INDEX` (checked on the
            float quantiles, before any conversion to an integer).
    """
    far = max(abs(s_lo), abs(s_hi)) / h
    if not far <= MAX_MESH_INDEX:  # also NaN
        raise MemoryError(
            f"the composed window reaches mesh index {far:.3g}: beyond exact int64/float64 "
            f"index arithmetic (|index| <= {MAX_MESH_INDEX:.3g}); the mesh must be coarser"
        )
    j_lo = max(math.floor(s_lo / h), lo)
    j_hi = max(min(math.ceil(s_hi / h), hi), j_lo)
    n = scipy.fft.next_fast_len(j_hi - j_lo + 1, real=True)
    if n % 2:
        n = scipy.fft.next_fast_len(n + 1, real=True)
    return j_lo, j_lo + n - 1, n


def _log(values: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(values)


def _ulp(precise: bool) -> float:
    return float(np.finfo(np.longdouble).eps) if precise else _U


def _assemble(
    steps: DiscreteSteps,
    counts: np.ndarray,
    log_spectra: np.ndarray,
    magnitudes: np.ndarray,
    *,
    start: int,
    size: int,
    band: int,
    wraps: tuple[float, float],
    band_error: float,
    unit: float,
    closed_form: bool,
    gaussian_mu: float,
    eta_shift: float,
    method: str,
    shift_table: tuple[np.ndarray, np.ndarray] | None = None,
) -> ComposedLoss:
    """G = Π_r F_r^{k_r} from the used steps' log-spectra, and the remaining error terms.

    ``unit`` is the relative error of each F_r(ω_m) per unit of mass (a few ulps for the block
    sums with exactly reduced phases, ~log2(n) ulps for an FFT, plus the Taylor remainder); the
    powers amplify it k_r-fold.
    """
    used = np.flatnonzero(counts > 0)
    k = counts[used].astype(float)
    per_unit = unit * steps.mass[used][:, None]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        log_g = np.einsum("r,rm->m", k.astype(log_spectra.real.dtype), log_spectra)
        rel = np.einsum("r,rm->m", k, per_unit / np.maximum(magnitudes, 1e-300))
        spectrum = np.exp(log_g)
    spectrum[~np.isfinite(log_g.real.astype(float))] = 0.0
    if not closed_form:
        spectrum = spectrum.astype(complex)  # only the closed form evaluates in extended precision
    out = -math.expm1(float(k @ np.log1p(-np.minimum(steps.out_mass[used], 0.5))))
    return ComposedLoss(
        h=steps.h,
        start=start,
        size=size,
        spectrum=spectrum,
        band=band,
        gaussian_mu=gaussian_mu,
        wrap_below=wraps[0],
        wrap_above=wraps[1],
        band_error=band_error,
        float_error=_float_error(spectrum, rel, size, float(np.finfo(spectrum.real.dtype).eps)),
        out_probability=out,
        shift=coupling_shift(steps, counts, eta_shift, shift_table),
        shift_failure=eta_shift,
        method=method,
    )


def compose_prefixes(
    steps: DiscreteSteps,
    counts: np.ndarray,
    *,
    gaussian_mu: np.ndarray,
    eta_wrap: float,
    eta_band: float,
    eta_shift: float,
    max_points: int,
) -> list[ComposedLoss | None]:
    """:func:`compose` for many count vectors (the prefixes of a ledger) on one window.

    The window is the last (largest) prefix's; each prefix's wrap mass on it is bounded with
    MGFs computed once on a λ grid that covers all prefixes, its band is certified separately,
    and the per-step spectra are computed once up to the largest band. A prefix whose wrap mass
    or band cannot be certified this way gets None (the caller composes it on its own).

    Args:
        steps: the discretised distinct steps.
        counts: (prefixes × steps) composition counts, each row with a count ≥ 1.
        gaussian_mu: μ of the exact Gaussian part of each prefix.
        eta_wrap, eta_band, eta_shift, max_points: as for :func:`compose`.

    Raises:
        MemoryError: when the window lies beyond exact index arithmetic
            (:func:`check_index_range`).
    """
    h = steps.h
    counts = np.asarray(counts, dtype=np.int64)
    spread = np.sqrt(counts.astype(float) @ steps.var)
    lam = lambda_grid(max(spread.min(), 4 * h), max(spread.max(), 4 * h), eta_wrap, h)
    block = mgf_block(lam, h)
    log_mgf = steps.log_mgf(np.concatenate([lam, -lam]), block)
    last = counts[int(np.argmax(spread))]
    full = _Chernoff(steps, last, eta_wrap, lam, log_mgf)
    s_lo, s_hi = full.quantiles(eta_wrap)
    lo, hi = _support(steps, last)
    j_lo, j_hi, n = _window(s_lo, s_hi, h, lo, hi)
    check_index_range(j_lo, n, 0)
    log_beta = band_bounds(steps, n, np.arange(len(steps))) if n > 4096 else None
    totals = counts.sum(axis=1)
    shift_lam = coupling_lambdas(float(totals.min()), float(totals.max()), h, eta_shift)
    shift_table = (shift_lam, coupling_log_mgf(steps, shift_lam))
    plans: list[tuple[bool, tuple[float, float], int, float]] = []
    for row in counts:
        chernoff = _Chernoff(steps, row, eta_wrap, lam, log_mgf)
        lo_t, hi_t = _support(steps, row)
        above = 0.0 if j_hi >= hi_t else chernoff.above((j_hi + 1) * h)
        below = 0.0 if j_lo <= lo_t else chernoff.below((j_lo - 1) * h)
        if log_beta is not None:
            band, band_error = band_limit(steps, row, n, eta_band, log_beta)
        else:
            band, band_error = n // 2, 0.0
        good = max(above, below) <= eta_wrap and band < min(n // 2, _MAX_CLOSED_FORM_BAND)
        # the Gaussian fold evaluates the density on the whole window
        good = good and (n <= max_points or gaussian_mu[len(plans)] == 0)
        plans.append((good, (below, above), band, band_error))
    bands = [band for good, _, band, _ in plans if good]
    if not bands:
        return [None] * len(plans)
    # the first prefixes, narrow distributions on the last prefix's wide window, need far more
    # frequencies than the rest: they are left to the caller rather than widening every band
    top = min(max(bands), 4 * int(np.median(bands)) + 16)
    check_index_range(j_lo, n, top)
    plans = [(good and band <= top, wraps, band, err) for good, wraps, band, err in plans]
    spec_block, terms, remainder = _spectral_block(block, n, top)
    blocks = steps.block_moments(spec_block, terms)[0].size
    if blocks * (top + 1) * (terms + 8.0) > _MAX_BAND_WORK:
        return [None] * len(plans)
    spectra = steps.band_spectrum(n, top, spec_block, terms)
    with np.errstate(divide="ignore"):
        log_spectra = np.log(spectra)
    magnitudes = np.abs(spectra)
    out: list[ComposedLoss | None] = []
    for row, mu, (good, wraps, band, band_error) in zip(counts, gaussian_mu, plans, strict=True):
        if not good:
            out.append(None)
            continue
        used = row > 0
        out.append(
            _assemble(
                steps,
                row,
                log_spectra[used, : band + 1],
                magnitudes[used, : band + 1],
                start=j_lo,
                size=n,
                band=band,
                wraps=wraps,
                band_error=band_error,
                unit=4 * _U + remainder,
                closed_form=False,
                gaussian_mu=float(mu),
                eta_shift=eta_shift,
                method="band",
                shift_table=shift_table,
            )
        )
    return out


def _spectral_block(block: int, n: int, band: int) -> tuple[int, int, float]:
    """(block, terms, remainder) for the band spectrum.

    The block is the Chernoff block (whose moments are cached) halved until θ = ω_band·h·block/2
    ≤ 1/4, and the Taylor terms are TERMS unless the block cannot shrink further; ``remainder``
    = θ^terms/terms! bounds the relative truncation error per unit of mass.
    """
    theta_unit = 2 * math.pi / n
    while block > 1 and theta_unit * band * block / 2 > 0.25:
        block //= 2
    theta_max = theta_unit * band * block / 2
    terms = TERMS
    while theta_max**terms / FACTORIALS[terms] > _TARGET_TRUNCATION and theta_max > 0.25:
        terms += 1
    return block, terms, theta_max**terms / FACTORIALS[terms]
