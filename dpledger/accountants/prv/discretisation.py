"""Discretisation of each step's privacy loss onto the mesh hℤ by "connecting the dots".

Gopi, Lee & Wutschitz (2021, §5) discretise a privacy loss random variable (PRV) Y on a uniform
mesh and compose the discrete PRVs by FFT. We discretise each bin (β_i, β_{i+1}] of the loss with
the two-point rule that keeps *both* the P-mass m_i and the Q-mass n_i of the bin: the bin's P-mass
is split between its end points,

    b_i = (m_i − n_i·e^{β_i}) / (1 − e^{−r_i}) at β_{i+1},   a_i = m_i − b_i at β_i,

with r_i = β_{i+1} − β_i, and the Q-mass of an atom at β is its P-mass times e^{−β}. This is the
"connect the dots" pair of Doroshenko, Ghazi, Kamath, Kumar & Manurangsi (2022): the true pair is a
post-processing of the discrete pair (the kernel sends the atom β_i to ω in the bin with
probability λ(ω) ∝ e^{−L(ω)} − e^{−β_{i+1}}), so the discrete pair *dominates* the true one and
every composition of discrete pairs dominates the composition of the true ones: the δ(ε) it gives
is an upper bound for all ε, with no error term at all.

For the lower bound the same kernel is a coupling of Y and its discretisation Ỹ: given Y = y in a
bin of width r, Ỹ is one of the two end points, so Ỹ − Y lies in an interval of length r with
conditional mean at most c(r) = r·max_u[(1 − e^{−ur})/(1 − e^{−r}) − u] ≈ r²/8 (the same bound
holds under Q for the add direction). The composition module turns this into a Chernoff bound on
Σ(Ỹ − Y) (Gopi et al.'s Theorem 5.5 with Hoeffding replaced by the exact mixture of bin widths).

Bins are h wide where the loss carries its mass and grow (by powers of two, end points still on
the mesh, so the dominance holds everywhere) where it carries little: a bin of width w costs the
lower bound about k·m·(e^{λ²w²/8} − 1) in the Chernoff exponent, and the widths minimise the
number of bins for a fixed total cost. The atoms then number a few thousand per step instead of
the hundreds of thousands a uniform mesh over the heavy tail of the subsampled Gaussian loss would
need. The longest stretch of h-wide bins is the *dense* part (used by the spectral bounds); the
rest is the *sparse* part. Mass beyond the truncation points is reported as ``out_mass``: the
upper bound charges it to δ, the lower bound drops it.

All steps of a ledger are discretised together (:func:`discretise_steps`) and kept concatenated
(:class:`DiscreteSteps`), so that sums over atoms cost a few numpy calls for the whole ledger
rather than per distinct step.

This module is over 500 lines because the discretisation is one construction: the choice of bin
widths, the two-point rule and the masses it keeps, and the concatenated layout with the moments
and spectra computed from it must agree atom for atom for the dominance and the coupling above
to hold, so they are kept and reviewed together.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import attrs
import numpy as np

from dpledger.accountants.prv.pairs import StepPair, noise_at_loss, p_tails, q_tails

__all__ = ["DiscretePrv", "DiscreteSteps", "conditional_bias", "discretise", "discretise_steps"]

TERMS = 15  # Taylor terms of the block moments (0.25^15/15! < 1e-21)
FACTORIALS = np.cumprod(np.r_[1.0, np.arange(1.0, 80.0)])
_CHUNK = 1 << 19  # atoms per chunk of the block moments


def dot(a: np.ndarray, b: np.ndarray) -> float:
    """Σ a·b without BLAS (BLAS threads stall on a loaded machine for vectors this small)."""
    return float(np.einsum("i,i->", a, b))


def logsumexp_segments(a: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """log Σ exp over consecutive row segments of ``a`` beginning at ``starts`` (−∞ allowed)."""
    top = np.maximum.reduceat(a, starts, axis=0)
    top = np.where(np.isfinite(top), top, 0.0)
    sizes = np.diff(np.r_[starts, a.shape[0]])
    with np.errstate(divide="ignore", invalid="ignore"):
        summed = np.add.reduceat(np.exp(a - np.repeat(top, sizes, axis=0)), starts, axis=0)
        return np.log(summed) + top


def conditional_bias(width: float) -> float:
    """c(r): the largest conditional mean of Ỹ − Y in a bin of width r (≈ r²/8)."""
    if width <= 0:
        return 0.0
    ratio = -math.expm1(-width) / width  # (1 − e^{−r})/r
    u = min(max(-math.log(ratio) / width, 0.0), 1.0)
    return width * (-math.expm1(-u * width) / -math.expm1(-width) - u)


@attrs.frozen(eq=False, slots=False)
class DiscretePrv:
    """The discretised privacy loss of one step in one direction.

    Attributes:
        h: mesh width; atom k sits at loss ``positions[k]·h``.
        positions: sorted global mesh indices of the atoms (int64).
        masses: probability of each atom (float64).
        dense_start: index into ``positions`` where the consecutive (dense) atoms start.
        dense_stop: index into ``positions`` one past the last dense atom.
        out_mass: probability outside the discretised range.
    """

    h: float
    positions: np.ndarray
    masses: np.ndarray
    dense_start: int
    dense_stop: int
    out_mass: float

    @cached_property
    def mass(self) -> float:
        """Total probability of the atoms (1 − out_mass up to rounding)."""
        return float(self.masses.sum())

    @cached_property
    def dense(self) -> np.ndarray:
        """The dense atoms (consecutive mesh points)."""
        return self.masses[self.dense_start : self.dense_stop]

    @cached_property
    def dense_abs_deviation(self) -> float:
        """Σ p_j |x_j − c| over the dense atoms (a Lipschitz constant of |F_dense(ω)|)."""
        p = self.dense
        if p.size == 0:
            return 0.0
        x = self.positions[self.dense_start : self.dense_stop] * self.h
        c = dot(p, x) / float(p.sum())
        return dot(p, np.abs(x - c))

    def delta(self, epsilon: float) -> float:
        """δ(ε) of this single discretised step, out-of-range mass counted in full."""
        x = self.positions * self.h
        return float(np.sum(self.masses * np.maximum(-np.expm1(epsilon - x), 0.0))) + self.out_mass


class DiscreteSteps:
    """The discretised steps of one direction, concatenated for batched sums.

    Args:
        prvs: one :class:`DiscretePrv` per distinct step.
        widths: the bin widths (units of h) used by any step.
        width_masses: (steps × widths) probability of the bins of each width, per step.
    """

    def __init__(
        self, prvs: Sequence[DiscretePrv], widths: np.ndarray, width_masses: np.ndarray
    ) -> None:
        self.prvs = list(prvs)
        self.h = self.prvs[0].h
        self.widths = widths
        self.width_masses = width_masses
        sizes = np.array([p.positions.size for p in self.prvs])
        self.starts = np.r_[0, np.cumsum(sizes)[:-1]]
        self.positions = np.concatenate([p.positions for p in self.prvs])
        self.masses = np.concatenate([p.masses for p in self.prvs])
        self.run = np.repeat(np.arange(len(self.prvs)), sizes)
        self.out_mass = np.array([p.out_mass for p in self.prvs])
        self.lowest = np.array([int(p.positions[0]) for p in self.prvs], dtype=np.int64)
        self.highest = np.array([int(p.positions[-1]) for p in self.prvs], dtype=np.int64)
        self.sizes = sizes
        self.dense_lo = self.starts + np.array([p.dense_start for p in self.prvs])
        self.dense_hi = self.starts + np.array([p.dense_stop for p in self.prvs])
        self._stats()
        self._moments: dict[tuple[int, int, bool], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def __len__(self) -> int:
        return len(self.prvs)

    @staticmethod
    def _segment_sums(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Σ values[lo_i:hi_i] for increasing, non-overlapping segments (empty ones give 0)."""
        bounds = np.ravel(np.column_stack([lo, hi]))
        if bounds[-1] >= values.size:  # the last segment then runs to the end of the array
            bounds = bounds[:-1]
        sums = np.add.reduceat(values, np.minimum(bounds, values.size - 1))[::2]
        return np.where(hi > lo, sums, 0.0)

    def _stats(self) -> None:
        """Per-step mass, variance and third absolute moment, for all atoms and dense ones."""
        p = self.masses
        x = self.positions * self.h
        starts = self.starts
        self.mass = np.add.reduceat(p, starts)
        mean = np.add.reduceat(p * x, starts) / self.mass
        d = x - np.repeat(mean, self.sizes)
        pd2 = p * d * d
        self.var = np.add.reduceat(pd2, starts) / self.mass
        self.rho3 = np.add.reduceat(pd2 * np.abs(d), starts) / self.mass
        lo, hi = self.dense_lo, self.dense_hi
        self.dense_mass = self._segment_sums(p, lo, hi)
        safe = np.where(self.dense_mass > 0, self.dense_mass, 1.0)
        dmean = self._segment_sums(p * x, lo, hi) / safe
        dd = x - np.repeat(dmean, self.sizes)
        pdd2 = p * dd * dd
        self.dense_var = self._segment_sums(pdd2, lo, hi) / safe
        self.dense_rho3 = self._segment_sums(pdd2 * np.abs(dd), lo, hi) / safe
        self.sparse_mass = np.maximum(self.mass - self.dense_mass, 0.0)
        # total variation of the dense atoms padded with zeros on both sides
        jumps = np.abs(np.diff(p))  # jumps[i] = |p[i+1] − p[i]|
        inner = self._segment_sums(jumps, lo, np.maximum(hi - 1, lo))
        first = p[np.minimum(lo, p.size - 1)]
        last = p[np.maximum(hi - 1, 0)]
        self.dense_tv = inner + np.where(hi > lo, first + last, 0.0)

    # ------------------------------------------------------------------ block sums
    def block_moments(
        self, block: int, terms: int, precise: bool = False
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(centres in mesh units, moments (blocks × terms), step of each block).

        Blocks are ``block`` consecutive mesh indices of one step; the moments are Σ p·u^n with
        u = (position − centre)/(block/2) ∈ [−1, 1]. Blocks are ordered by step. ``precise``
        sums in extended precision (``numpy.longdouble``). Cached.
        """
        key = (block, terms, precise)
        if key not in self._moments:
            self._moments[key] = self._block_moments(block, terms, precise)
        return self._moments[key]

    def _block_moments(
        self, block: int, terms: int, precise: bool
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        real: type[np.floating[Any]] = np.longdouble if precise else np.float64
        ids = np.floor_divide(self.positions, block)
        new = np.r_[True, (ids[1:] != ids[:-1]) | (self.run[1:] != self.run[:-1])]
        starts = np.flatnonzero(new)
        centres = ids[starts] * block + (block - 1) / 2.0
        moments = np.empty((starts.size, terms), dtype=real)
        # chunks end at block starts, so no block straddles two chunks
        size = self.positions.size
        cuts = [0]
        while cuts[-1] < size:
            i = int(np.searchsorted(starts, cuts[-1] + _CHUNK))
            cuts.append(int(starts[i]) if i < starts.size else size)
        for a, b in itertools.pairwise(cuts):
            s0, s1 = np.searchsorted(starts, [a, b])
            local = starts[s0:s1] - a
            sizes = np.diff(np.r_[local, b - a])
            u = (self.positions[a:b] - np.repeat(centres[s0:s1], sizes)).astype(real) / real(
                block / 2.0
            )
            cur = self.masses[a:b].astype(real)
            for n in range(terms):
                moments[s0:s1, n] = np.add.reduceat(cur, local)
                if n + 1 < terms:
                    cur *= u
        return centres, moments, self.run[starts]

    def block_starts(self, block: int, terms: int) -> np.ndarray:
        """Index of each step's first block in the block arrays (steps without blocks: none)."""
        _, _, owner = self.block_moments(block, terms)
        return np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])

    def log_mgf(self, lam: np.ndarray, block: int) -> np.ndarray:
        """(steps × λ) upper bounds on log E[e^{λỸ}] (sub-probability).

        E[e^{λỸ}] = Σ_b e^{λc_b h} Σ_n y^n/n!·μ_{b,n} with y = λ·block·h/2; truncating after
        TERMS terms leaves at most |y|^T/T!·e^{|y|} per unit of mass, which is added. Requires
        |λ|·block·h/2 ≤ 1.5.
        """
        centres, moments, _ = self.block_moments(block, TERMS)
        y = lam * block * self.h / 2
        powers = y[None, :] ** np.arange(TERMS)[:, None] / FACTORIALS[:TERMS, None]
        inner = np.einsum("bt,tl->bl", moments, powers)
        remainder = np.abs(y) ** TERMS / FACTORIALS[TERMS] * np.exp(np.abs(y))
        inner = np.maximum(inner, 0.0) + remainder[None, :] * moments[:, :1]
        with np.errstate(divide="ignore"):
            logs = np.log(inner) + (centres * self.h)[:, None] * lam[None, :]
        return logsumexp_segments(logs, self.block_starts(block, TERMS))

    def band_spectrum(
        self, n: int, m_max: int, block: int, terms: int, precise: bool = False
    ) -> np.ndarray:
        """(steps × (m_max + 1)) F(ω_m) = Σ_j p_j e^{−2πi m j/n} from the block moments.

        ``precise`` computes in extended precision and returns ``numpy.clongdouble``.
        """
        real: type[np.floating[Any]] = np.longdouble if precise else np.float64
        cplx: type[np.complexfloating[Any, Any]] = np.clongdouble if precise else np.complex128
        pi = real(np.pi) if not precise else np.longdouble("3.14159265358979323846264338327950288")
        centres, moments, owner = self.block_moments(block, terms, precise)
        m = np.arange(m_max + 1)
        theta = (2 * pi / n) * m.astype(real) * (block / 2)
        coeff = (-1j * theta[None, :].astype(cplx)) ** np.arange(terms)[:, None] / FACTORIALS[
            :terms, None
        ].astype(real)
        out = np.zeros((len(self.prvs), m_max + 1), dtype=cplx)
        rows = max(1, (1 << 21) // (m_max + 1))  # bound the (blocks × band) temporaries
        for b0 in range(0, centres.size, rows):
            b1 = min(b0 + rows, centres.size)
            inner = np.einsum("bt,tm->bm", moments[b0:b1], coeff)
            # phase 2π·c·m/n reduced exactly in integers (2c is an integer): error ~ u, not u·c·m
            twice = np.rint(2 * centres[b0:b1]).astype(np.int64) % (2 * n)
            turns = (np.outer(twice, m) % (2 * n)).astype(real)
            inner *= np.exp((-1j * (pi / n)) * turns.astype(cplx))
            own = owner[b0:b1]
            seg = np.flatnonzero(np.r_[True, own[1:] != own[:-1]])
            out[own[seg]] += np.add.reduceat(inner, seg, axis=0)
        return out

    def full_spectrum(self, step: int, n: int, precise: bool = False) -> np.ndarray:
        """F(ω_m), m = 0..n/2, of one step by FFT of its atoms wrapped modulo n."""
        import scipy.fft

        p = self.prvs[step]
        wrapped = np.bincount(np.mod(p.positions, n), weights=p.masses, minlength=n)
        return scipy.fft.rfft(wrapped.astype(np.longdouble) if precise else wrapped)


# ---------------------------------------------------------------------------- discretisation
def _coupling_cost(width: np.ndarray, lam: float) -> np.ndarray:
    """e^{λc(w) + λ²w²/8} − 1: the Chernoff cost per unit mass of a bin of width w."""
    bias = np.array([conditional_bias(float(w)) for w in width])
    with np.errstate(over="ignore"):
        return np.expm1(lam * bias + (lam * width) ** 2 / 8)


def _choose_widths(
    weight: np.ndarray, stride: int, h: float, lam: float, budget: float
) -> np.ndarray:
    """Power-of-two bin width per segment: fewest bins with Σ weight·(E_w − E_h) ≤ budget.

    ``weight`` is k·m, the expected number of steps landing in the segment. Lagrangian
    relaxation: each segment minimises stride/w + μ·weight·(E_w − E_h); μ is found by bisection.
    """
    widths = stride >> np.arange(int(math.log2(stride)) + 1)[::-1]  # 1, 2, …, stride
    cost = _coupling_cost(widths * h, lam)
    cost = cost - cost[0]
    bins = (stride // widths).astype(float)
    with np.errstate(invalid="ignore"):
        extra = np.where(weight[:, None] > 0, weight[:, None] * cost[None, :], 0.0)
    rows = np.arange(weight.size)

    def pick(mu: float) -> tuple[np.ndarray, float]:
        with np.errstate(over="ignore"):  # an infinite cost only rules a width out
            choice = np.argmin(bins[None, :] + mu * extra, axis=1)
        return choice, float(extra[rows, choice].sum())

    hi = 1.0
    choice, total = pick(hi)
    while total > budget and hi < 1e300:
        hi *= 1e4
        choice, total = pick(hi)
    lo = hi * 1e-8
    for _ in range(10):  # the multiplier only needs to be right to within ~20 per cent
        mid = math.sqrt(lo * hi)
        c, t = pick(mid)
        if t <= budget:
            hi, choice = mid, c
        else:
            lo = mid
    return widths[choice]


def _bin_masses(le: np.ndarray, gt: np.ndarray) -> np.ndarray:
    """Mass of each bin from the tails at its end points, using the smaller (accurate) tail."""
    upper = gt[:-1] < 0.5
    m = np.where(upper, gt[:-1] - gt[1:], le[1:] - le[:-1])
    return np.maximum(m, 0.0)


_FAR_LOSS = 700.0  # above this loss e^ℓ is near the float64 limit


def _log_q_upper_bin(
    x0: np.ndarray, x1: np.ndarray, q: np.ndarray, z: np.ndarray, replace: bool
) -> np.ndarray:
    """log Q(x0 < X ≤ x1) for bins in the upper tail of Q, without underflow."""
    import scipy.special

    def log_gt(x: np.ndarray) -> np.ndarray:
        t = scipy.special.log_ndtr(-x / z)
        if not replace:
            return t
        return np.logaddexp(np.log1p(-q) + t, np.log(q) + scipy.special.log_ndtr(-(x + 1.0) / z))

    a, b = log_gt(x0), log_gt(x1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return a + np.log1p(-np.exp(b - a))


def _ranges(starts: np.ndarray, stops: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Concatenation of arange(starts[i], stops[i], step[i]) (all stops − starts divisible)."""
    counts = (stops - starts) // step
    offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + offsets * np.repeat(step, counts)


def _dense_run(widths: np.ndarray, masses: np.ndarray) -> tuple[int, int]:
    """Atom index range [start, stop) of the h-wide stretch of bins carrying the most mass."""
    unit = np.r_[False, widths == 1, False]
    change = np.flatnonzero(np.diff(unit.astype(np.int8)))
    starts, stops = change[0::2], change[1::2]  # bins [starts, stops) are h wide
    if starts.size == 0:
        return 0, 0
    cum = np.r_[0.0, np.cumsum(masses)]
    best = int(np.argmax(cum[stops + 1] - cum[starts]))
    return int(starts[best]), int(stops[best]) + 1  # atoms at both ends of those bins


def discretise_steps(
    pairs: Sequence[StepPair],
    counts: Sequence[int],
    *,
    h: float,
    out_mass: float,
    shift_lambda: float,
    budget: float = 8.0,
    stride: int = 256,
    max_segments: float = math.inf,
    max_atoms: float = math.inf,
) -> tuple[DiscreteSteps, DiscreteSteps | None]:
    """Discretise the distinct steps of a ledger for the remove and (unless symmetric) add sides.

    Args:
        pairs: the distinct steps' dominating pairs (all with the same relation).
        counts: how many times each step is composed (sets how wide its tail bins may be).
        h: mesh width.
        out_mass: P-probability left beyond the truncation points (each side), per step.
        shift_lambda: the λ at which the lower bound's Chernoff bound is expected to be tight.
        budget: total increase of that Chernoff exponent the wide bins may cause.
        stride: the widest bin, in units of h (a power of two).
        max_segments: the most stride-wide segments (over all steps) the truncated ranges may
            span; checked from the range ends alone, before any array is allocated.
        max_atoms: the most bin end points (atoms, over all steps); checked once the bin
            widths are chosen from the segments' masses, before any atom is computed (a step
            whose mass is spread over h-wide bins has ``stride`` atoms per segment).

    Returns:
        (remove, add): the laws of L under P, and of −L under Q (None for symmetric pairs).

    Raises:
        MemoryError: when the ranges span more than ``max_segments`` segments or the bins
            need more than ``max_atoms`` atoms (the caller coarsens the mesh or refuses).
    """
    replace = pairs[0].replace_one
    q = np.array([p.q for p in pairs])
    z = np.array([p.z for p in pairs])
    k = np.asarray(counts, dtype=float)
    # ---- truncation and segments (stride·h wide, aligned on multiples of stride)
    top_f = np.array([p.loss_with_upper_tail(out_mass) / h for p in pairs])
    if replace:
        bottom_f = np.array([p.loss_with_lower_tail(out_mass) / h for p in pairs])
    else:
        bottom_f = np.log1p(-q) / h
    spanned = float(np.sum((top_f - bottom_f) / stride + 2.0))
    if not spanned <= max_segments:  # also NaN and ∞
        raise MemoryError(
            f"the truncated privacy-loss ranges span about {spanned:.3g} segments of "
            f"{stride} mesh points at mesh width {h!r} (limit {max_segments:.3g})"
        )
    top = np.ceil(top_f).astype(np.int64)
    bottom = np.floor(bottom_f).astype(np.int64)
    first = bottom // stride * stride
    last = -(-np.maximum(top, bottom + 1) // stride) * stride
    n_seg = (last - first) // stride
    edge_run = np.repeat(np.arange(len(pairs)), n_seg + 1)
    edges = _ranges(first, last + stride, np.full(len(pairs), stride))
    x = noise_at_loss(edges * h, q[edge_run], z[edge_run], replace)
    le, gt = p_tails(x, q[edge_run], z[edge_run])
    inner = edge_run[1:] == edge_run[:-1]  # consecutive edges of the same step
    seg_mass = _bin_masses(le, gt)[inner]
    seg_run = edge_run[:-1][inner]
    width = _choose_widths(k[seg_run] * seg_mass, stride, h, shift_lambda, budget)
    atoms = float(np.sum(stride // width)) + len(pairs)
    if not atoms <= max_atoms:
        raise MemoryError(
            f"the bins of the truncated privacy-loss ranges need {atoms:.3g} atoms at mesh "
            f"width {h!r} (limit {max_atoms:.3g})"
        )
    seg_start = edges[:-1][inner]
    widths = stride >> np.arange(int(math.log2(stride)) + 1)[::-1]
    removes: list[DiscretePrv] = []
    adds: list[DiscretePrv] = []
    rem_wm = np.zeros((len(pairs), widths.size))
    add_wm = np.zeros((len(pairs), widths.size))
    # the atoms of a few hundred steps at a time, so that memory stays bounded
    seg_bounds = np.searchsorted(seg_run, np.arange(len(pairs) + 1))
    group = max(1, _CHUNK // max(1, int(seg_mass.size * stride // max(len(pairs), 1) // 8)))
    for g0 in range(0, len(pairs), group):
        g1 = min(g0 + group, len(pairs))
        s0, s1 = seg_bounds[g0], seg_bounds[g1]
        _atoms(
            pairs_slice=(g0, g1),
            q=q,
            z=z,
            replace=replace,
            h=h,
            stride=stride,
            widths=widths,
            seg_start=seg_start[s0:s1],
            seg_run=seg_run[s0:s1],
            seg_width=width[s0:s1],
            last=last[g0:g1],
            removes=removes,
            adds=adds,
            width_masses=(rem_wm, add_wm),
        )
    remove = DiscreteSteps(removes, widths, rem_wm)
    add = None if replace else DiscreteSteps(adds, widths, add_wm)
    return remove, add


def _atoms(
    *,
    pairs_slice: tuple[int, int],
    q: np.ndarray,
    z: np.ndarray,
    replace: bool,
    h: float,
    stride: int,
    widths: np.ndarray,
    seg_start: np.ndarray,
    seg_run: np.ndarray,
    seg_width: np.ndarray,
    last: np.ndarray,
    removes: list[DiscretePrv],
    adds: list[DiscretePrv],
    width_masses: tuple[np.ndarray, np.ndarray],
) -> None:
    """Connect-the-dots atoms of the steps g0..g1 (appended to ``removes`` and ``adds``)."""
    g0, g1 = pairs_slice
    # bin boundaries: each segment cut into bins of its width, plus each step's last edge
    inside = _ranges(seg_start, seg_start + stride, seg_width)
    inside_run = np.repeat(seg_run, stride // seg_width)
    j = np.concatenate([inside, last])
    run = np.concatenate([inside_run, np.arange(g0, g1)])
    order = np.lexsort((j, run))
    j, run = j[order], run[order]
    beta = j * h
    x = noise_at_loss(beta, q[run], z[run], replace)
    p_le, p_gt = p_tails(x, q[run], z[run])
    q_le, q_gt = q_tails(x, q[run], z[run], replace)
    same = run[1:] == run[:-1]
    m = np.where(same, _bin_masses(p_le, p_gt), 0.0)
    n = np.where(same, _bin_masses(q_le, q_gt), 0.0)
    r = np.diff(beta)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        n_scaled = n * np.exp(beta[:-1])  # Q-mass·e^β, which is at most the P-mass m
        # beyond e^700 the product overflows and the Q-mass underflows: take it in log space
        far = np.flatnonzero(same & (beta[:-1] > _FAR_LOSS))
        if far.size:
            log_n = _log_q_upper_bin(x[far], x[far + 1], q[run[far]], z[run[far]], replace)
            n_scaled[far] = np.exp(log_n + beta[far])
        b = (m - n_scaled) / -np.expm1(-r)
    del x
    b = np.clip(np.nan_to_num(b, nan=0.0, posinf=0.0, neginf=0.0), 0.0, m)
    atoms = np.zeros(j.size)
    atoms[:-1] += m - b
    atoms[1:] += b
    bin_width = np.where(same, np.diff(j), 0)
    w_index = np.searchsorted(widths, np.maximum(bin_width, 1))
    cell = (run[:-1][same] - g0) * widths.size + w_index[same]
    size = (g1 - g0) * widths.size
    rem_wm, add_wm = width_masses
    rem_wm[g0:g1] = np.bincount(cell, weights=m[same], minlength=size).reshape(g1 - g0, -1)
    add_wm[g0:g1] = np.bincount(cell, weights=n[same], minlength=size).reshape(g1 - g0, -1)
    with np.errstate(over="ignore"):
        q_atoms = atoms * np.exp(-beta)
    bounds = np.r_[0, np.flatnonzero(~same) + 1, j.size]
    for lo, hi in itertools.pairwise(bounds):
        pos, mass = j[lo:hi], atoms[lo:hi]
        d0, d1 = _dense_run(bin_width[lo : hi - 1], mass)
        keep = mass > 0
        keep[d0:d1] = True  # the dense block stays contiguous
        new_d0 = int(np.count_nonzero(keep[:d0]))
        new_d1 = new_d0 + (d1 - d0)
        kept = pos[keep]
        removes.append(
            DiscretePrv(
                h=h,
                positions=kept,
                masses=mass[keep],
                dense_start=new_d0,
                dense_stop=new_d1,
                out_mass=float(p_le[lo] + p_gt[hi - 1]),
            )
        )
        if not replace:
            adds.append(
                DiscretePrv(
                    h=h,
                    positions=-kept[::-1],
                    masses=q_atoms[lo:hi][keep][::-1].copy(),
                    dense_start=kept.size - new_d1,
                    dense_stop=kept.size - new_d0,
                    out_mass=float(q_le[lo] + q_gt[hi - 1]),
                )
            )


def discretise(
    pair: StepPair, *, h: float, out_mass: float, steps: int, shift_lambda: float
) -> tuple[DiscretePrv, DiscretePrv | None]:
    """Discretise one step (composed ``steps`` times) — see :func:`discretise_steps`."""
    remove, add = discretise_steps(
        [pair], [steps], h=h, out_mass=out_mass, shift_lambda=shift_lambda
    )
    return remove.prvs[0], None if add is None else add.prvs[0]
