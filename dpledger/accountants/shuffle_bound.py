"""Certified lower bounds on the (ε, δ) of DP-SGD with shuffled fixed-size batches.

This module is pure math (NumPy and SciPy). It gives a *lower* bound on the privacy parameters of
the Adaptive Batch Linear Queries mechanism (ABLQ, the mechanism whose post-processing DP-SGD is)
when every epoch cuts a fresh uniformly random permutation of the n records into T batches of b
records (n = b·T), for E epochs, at noise multiplier z. Upper bounds for shuffling are not known
in a useful form; the point of a lower bound is to show when an ε computed as if batches were
Poisson-subsampled is *not* a valid guarantee for the shuffled implementation: whenever the lower
bound exceeds the Poisson ε, the shuffled run is provably less private than reported.

The bound is the construction of Chua, Ghazi, Kamath, Kumar, Manurangsi, Sinha & Zhang:

* one epoch: "How Private are DP-SGD Implementations?" (ICML 2024, arXiv:2403.17673), the lower
  bound on δ of ABLQ with the shuffle batch sampler (the pair of data sets and the test sets
  described below);
* several epochs: "Scalable DP-SGD: Shuffling vs. Poisson Subsampling" (NeurIPS 2024,
  arXiv:2411.04205), the lower bound for *dynamic* shuffling, i.e. a new permutation every epoch
  (Theorem 3.8 there), which composes the per-epoch privacy loss of the statistic "largest
  coordinate of the epoch" over the epochs.

Units: sensitivities and noise are measured in units of the clipping norm S, so the noise on
every coordinate of every batch sum is N(0, σ²) with σ = z.

The pair of data sets
---------------------
Take one-dimensional linear queries (all records' clipped gradients on one axis). Let every record
but one have value −1 (in units of S); the remaining record has value +1 in x. In x′ it has

* value 0 under ``neighboring="add_remove"``: the record is removed while the batch structure is
  kept (the zero-out form of add/remove that Chua et al. analyse, so that n = b·T and every batch
  has b slots in both data sets; the sum query's sensitivity is S);
* value −1 under ``neighboring="replace_one"``: the record is replaced by another one (sensitivity
  2S).

Each epoch's output is the vector of the T noisy batch sums. Subtracting the known −b from every
coordinate, the record's batch is uniform over the T batches, so one epoch's output is distributed
as the mixture of Gaussians

    MoG(m) = (1/T) Σ_t N(m·e_t, σ² I_T)

with P = MoG(2) for x and Q = MoG(m_Q) for x′, where m_Q = 1 (add/remove) or m_Q = 0 (replace-one:
Q = N(0, σ² I_T)). E epochs with independent permutations give P^⊗E and Q^⊗E. Since (P^⊗E, Q^⊗E)
are output distributions of the mechanism on neighbouring inputs, its δ(ε) is at least the
hockey-stick divergence

    H_ε(P^⊗E ‖ Q^⊗E) = sup_S P^⊗E(S) − e^ε Q^⊗E(S),

and any particular test set S gives a lower bound. For T = 1 the pair is exactly a Gaussian
mechanism's (means 1 or 2 apart), and for every T the deterministic-batching ε (E Gaussian
mechanisms, μ = √E·sensitivity/σ) is an upper bound on the shuffled mechanism's true ε. How the
bound scales between the relations: replace-one is the pair (MoG(2), MoG(0)) at noise σ, which is
(MoG(1), MoG(0)) at noise σ/2, not the add/remove pair at σ/2 — so unlike a Gaussian mechanism's
ε the two relations are not related by a plain factor of 2 in the sensitivity.

One epoch: threshold sets (closed form)
---------------------------------------
Chua et al. use S_C = {w ∈ ℝ^T : max_t w_t > C}. With

    F_m(C) = MoG(m)(max_t w_t ≤ C) = Φ((C − m)/σ) · Φ(C/σ)^{T−1},

P(S_C) = 1 − F_2(C), Q(S_C) = 1 − F_{m_Q}(C), and

    δ_lower(ε) = max_C [(1 − F_2(C)) − e^ε (1 − F_{m_Q}(C))].

Both probabilities are computed from log F = log Φ(·) + (T − 1) log Φ(·)
(``scipy.special.log_ndtr``) and 1 − F = −expm1(log F), which keeps full relative precision
when they are as small as 1e-300.
For a given δ and C the largest ε with P(S_C) − e^ε Q(S_C) ≥ δ is log((P(S_C) − δ)/Q(S_C)), so
ε_lower(δ) is the maximum of that over C; no bisection is needed in this case.

The search over C: every C gives a valid bound, so the search only decides how tight it is. C runs
over a grid of 4001 points from m_Q − 4σ to 2 + σ·Φ̄⁻¹(10⁻³⁰⁰/T) (past which P(S_C) < 10⁻³⁰⁰),
and the best grid point is refined by a bounded scalar search between its neighbours; the value
reported is the best of all evaluated C.

Several epochs: composition of the per-epoch maximum (Theorem 3.8 of arXiv:2411.04205)
--------------------------------------------------------------------------------------
Post-process each epoch's output to M_e = max_t w_t. Under P (resp. Q) the M_e are i.i.d. with CDF
F_2 (resp. F_{m_Q}). The lower bound is the hockey-stick divergence of the E-fold products of
these one-dimensional distributions, computed on a discretisation that is itself a
post-processing, so that what is computed is a lower bound and not an estimate:

1. Cut the real line at caps c_0 < … < c_K (spacing Δσ²/(2 − m_Q)/2, from where F_2 < e^{−40}
   to where 1 − F_2 < e^{−40}/T; the two tails are the first and last bucket). Recording only the
   bucket of M_e is a post-processing. Each bucket's P- and Q-mass is enclosed in an interval
   (below).
2. Give each bucket the bin ⌊ℓ/Δ⌋ of its (estimated) privacy loss ℓ = log(p/q), and record, for
   each epoch, only that bin: again a post-processing, whatever the estimate. Per bin, a lower
   bound on its P-mass and an upper bound on its Q-mass are kept (the sums over its buckets).
3. The bin of the *sum* of the E per-epoch bins is a post-processing of the E-epoch output. Its
   P- and Q-masses are the E-fold convolutions of the per-epoch bin masses; the convolutions are
   computed directly (``numpy.convolve``, by repeated squaring), never by FFT, so that each
   entry is a sum of non-negative products with a relative error of at most (length + 1)·u.
4. δ_lower(ε) = Σ_j (A_j − e^ε B_j)_+, with A_j the lower bounds on the P-masses and B_j the
   upper bounds on the Q-masses: a lower bound on the hockey-stick divergence of the
   post-processed pair, hence of (P^⊗E, Q^⊗E).

Keeping both masses per bin (rather than rounding every loss down to the grid and keeping only the
P-mass, as dp-accounting's optimistic PLD does) loses nothing by the rounding itself; merging
buckets of nearly equal loss only loses a little tightness. Δ is 0.005, or coarser when
E·(loss range)/Δ would exceed 2¹³ bins (to bound the cost of the convolutions to milliseconds; at
q = 256/60000, z = 1.1, 15 epochs, δ = 1e-5 the ε bound is 6.0104 with 2¹³ bins and 6.0109 with
2¹⁵). The one-epoch threshold bound is also valid for E epochs (ignoring later epochs is a
post-processing), so for E ≥ 2 the larger of the two bounds is returned.

ε_lower(δ) for E ≥ 2 is the largest ε with δ_lower(ε) ≥ δ, found by bisection on ε. The bisection
keeps the invariant δ_lower(lo) ≥ δ and returns lo: the answer is rounded *down*, because a lower
bound that is rounded up could claim more privacy loss than has been proven.

Floating point
--------------
The values are certified in floating point too, under the same assumption as
:mod:`dpledger.accountants.rdp_moments`: ``log_ndtr`` is accurate to a few ulp of its magnitude.
Each log F is given an absolute error bound 8u·(|log Φ(x₁)| + |x₁|h(x₁) + (T − 1)(|log Φ(x₀)| +
|x₀|h(x₀)) + |log F|), u = 2⁻⁵², h = φ/Φ (which covers the rounding of the arguments x = (C − m)/σ
and C/σ), and every mass is enclosed by interval arithmetic from those bounds (1 − F is
decreasing in log F, a bucket mass F(c_{k+1})(1 − e^{−d}) increasing in log F(c_{k+1}) and in
d = log F(c_{k+1}) − log F(c_k)). Sums and convolutions of non-negative numbers are widened by
their recursive-summation bound, e^ε by two ulp. The widening moves the bound by about 10⁻¹² in
relative terms; it is there so that "lower bound" holds without a caveat.

What it does not cover
----------------------
n not divisible by b. The parameter is T, the number of batches per epoch. When n = b·(T − 1) + r
with 0 < r < b and the last batch holds the r remaining records (a ``shuffle(b, n)`` event,
T = ⌈n/b⌉), the record's batch is not uniform (batch t with probability b_t / n), but the bound
still holds as computed: batch sizes are public, so after subtracting each batch's known offset
the record's batch is shifted by m and the others are not, and the distribution of the maximum
given the record's batch, Φ((C − m)/σ)·Φ(C/σ)^{T−1}, does not depend on which batch it is. Every
quantity above is a function of that distribution only. With ``drop_last`` (the r records left
out of the epoch) the pair changes and this module does not cover it. Persistent shuffling (one
permutation reused for all epochs) is also not covered: its lower bound is the one-epoch bound at
σ/√E (Theorem 3.5 of arXiv:2411.04205), which callers can get with ``epochs=1`` and z/√E.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from scipy.special import log_ndtr, ndtri

from dpledger.ledger.events import NeighboringRelation
from dpledger.validation import (
    check_delta,
    check_enum,
    check_non_negative_finite,
    check_positive_finite,
    check_positive_int,
)

__all__ = ["shuffle_delta_lower_bound", "shuffle_epsilon_lower_bound"]

_U = 2.0**-52
# The mean of the record's batch sum under x (in units of S, after the shift by b).
_MEAN_P = 2.0
# Loss-bin width of the multi-epoch composition, and the cap on E · (bins per epoch).
_BIN_WIDTH = 0.005
_MAX_COMPOSED_BINS = 2**13
# Tails of the per-epoch maximum merged into the first and last bucket: log of their P-mass.
_LOG_TAIL_MASS = -40.0
_THRESHOLD_GRID = 4001
_LOG_SMALLEST_TAIL = math.log(1e-300)
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


def _mean_q(neighboring: NeighboringRelation) -> float:
    """The record's mean under x′: removed (0) or replaced by a −1 record (−1), shifted by +1."""
    return 1.0 if neighboring is NeighboringRelation.ADD_REMOVE else 0.0


def _log_phi_and_error(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """log Φ(x) and a bound on its absolute error (a few ulp, plus the argument's rounding)."""
    log_phi = log_ndtr(x)
    # h(x) = φ(x)/Φ(x): d log Φ / dx. The argument carries a relative error of ≤ 2u.
    hazard = np.exp(-0.5 * x * x - _HALF_LOG_2PI - log_phi)
    return log_phi, np.abs(log_phi) + np.abs(x) * hazard


def _log_cdf_of_max(
    caps: np.ndarray, mean: float, sigma: float, batches: int
) -> tuple[np.ndarray, np.ndarray]:
    """log F_mean(c) = log P(max_t w_t ≤ c) under MoG(mean), and an absolute error bound.

    F_mean(c) = Φ((c − mean)/σ) · Φ(c/σ)^{T−1}.
    """
    shifted, shifted_err = _log_phi_and_error((caps - mean) / sigma)
    others, others_err = _log_phi_and_error(caps / sigma)
    value = shifted + (batches - 1) * others
    error = 8.0 * _U * (shifted_err + (batches - 1) * others_err + np.abs(value))
    return value, error


def _tail_mass_bounds(log_cdf: np.ndarray, error: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Enclosure [lo, hi] of 1 − F = −expm1(log F) given log F to within ± error."""
    lo = -np.expm1(np.minimum(log_cdf + error, 0.0)) * (1.0 - 4.0 * _U)
    hi = -np.expm1(log_cdf - error) * (1.0 + 4.0 * _U)
    return np.maximum(lo, 0.0), np.minimum(hi, 1.0)


# --------------------------------------------------------------------------- one epoch


def _threshold_caps(sigma: float, batches: int, mean_q: float) -> np.ndarray:
    """The grid of thresholds C searched for the one-epoch bound (see the module docstring)."""
    # Past this C, P(max > C) ≤ T·Φ̄((C − 2)/σ) < 1e-300.
    top = _MEAN_P + sigma * float(-ndtri(math.exp(_LOG_SMALLEST_TAIL - math.log(batches))))
    return np.linspace(mean_q - 4.0 * sigma, top, _THRESHOLD_GRID)


def _threshold_masses(
    caps: np.ndarray, sigma: float, batches: int, mean_q: float
) -> tuple[np.ndarray, np.ndarray]:
    """(lower bound on P(S_C), upper bound on Q(S_C)) for the threshold sets S_C = {max > C}."""
    p_lo, _ = _tail_mass_bounds(*_log_cdf_of_max(caps, _MEAN_P, sigma, batches))
    _, q_hi = _tail_mass_bounds(*_log_cdf_of_max(caps, mean_q, sigma, batches))
    return p_lo, q_hi


def _threshold_delta(
    caps: np.ndarray, epsilon: float, sigma: float, batches: int, mean_q: float
) -> np.ndarray:
    """Certified lower bounds on P(S_C) − e^ε Q(S_C), one per cap (clipped at 0)."""
    p_lo, q_hi = _threshold_masses(caps, sigma, batches, mean_q)
    factor = math.exp(epsilon) * (1.0 + 2.0 * _U)
    # fl(p − f·q) ≥ (p − f·q)(1 − u) − u·f·q; both error terms are folded into the q side.
    return np.maximum(p_lo - factor * q_hi * (1.0 + 4.0 * _U), 0.0) * (1.0 - 2.0 * _U)


def _threshold_epsilon(
    caps: np.ndarray, delta: float, sigma: float, batches: int, mean_q: float
) -> np.ndarray:
    """Certified lower bounds on log((P(S_C) − δ)/Q(S_C)), −inf where P(S_C) ≤ δ."""
    p_lo, q_hi = _threshold_masses(caps, sigma, batches, mean_q)
    excess = (p_lo - delta) * (1.0 - 2.0 * _U)
    out = np.full(caps.shape, -np.inf)
    ok = (excess > 0.0) & (q_hi > 0.0)
    value = np.log(excess[ok]) - np.log(q_hi[ok])
    # Each log is within a few ulp of its magnitude.
    out[ok] = value - 8.0 * _U * (np.abs(np.log(excess[ok])) + np.abs(np.log(q_hi[ok])) + 1.0)
    return out


def _maximise_over_caps(objective: Any, caps: np.ndarray) -> float:
    """Largest value of a vectorised objective over the grid, refined near the best grid point."""
    values = objective(caps)
    best = int(np.argmax(values))
    lo = caps[max(best - 1, 0)]
    hi = caps[min(best + 1, len(caps) - 1)]
    # A golden-section search between the neighbours: every evaluated C is a valid test set, so
    # this only tightens the bound; the best evaluated value is kept.
    best_value = float(values[best])
    invphi = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = float(lo), float(hi)
    for _ in range(60):
        if b - a <= 1e-12 * max(1.0, abs(a)):
            break
        c1 = b - invphi * (b - a)
        c2 = a + invphi * (b - a)
        f1, f2 = objective(np.array([c1, c2]))
        best_value = max(best_value, float(f1), float(f2))
        if f1 >= f2:
            b = c2
        else:
            a = c1
    return best_value


# --------------------------------------------------------------------------- several epochs


def _bucket_mass_bounds(
    log_cdf: np.ndarray, error: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Masses of the buckets (−∞, c_0], (c_k, c_{k+1}], (c_K, ∞): (lower, upper bounds, estimates).

    The middle masses are F(c_{k+1})·(1 − e^{−d}), d = log F(c_{k+1}) − log F(c_k), enclosed by
    interval arithmetic from the error bounds of log F.
    """
    upper_log, upper_err = log_cdf[1:], error[1:]
    d = log_cdf[1:] - log_cdf[:-1]
    d_err = error[1:] + error[:-1] + _U * np.abs(d)
    middle_lo = np.exp(upper_log - upper_err) * -np.expm1(-np.maximum(d - d_err, 0.0))
    middle_hi = np.exp(upper_log + upper_err) * -np.expm1(-(d + d_err))
    middle_est = np.exp(upper_log) * -np.expm1(-np.maximum(d, 0.0))
    first_lo = np.exp(log_cdf[:1] - error[:1])
    first_hi = np.exp(log_cdf[:1] + error[:1])
    last_lo, last_hi = _tail_mass_bounds(log_cdf[-1:], error[-1:])
    lo = np.concatenate([first_lo, middle_lo, last_lo]) * (1.0 - 8.0 * _U)
    hi = np.concatenate([first_hi, middle_hi, last_hi]) * (1.0 + 8.0 * _U)
    est = np.concatenate([np.exp(log_cdf[:1]), middle_est, -np.expm1(log_cdf[-1:])])
    return lo, np.minimum(hi, 1.0), est


def _convolve(a: np.ndarray, b: np.ndarray, *, round_up: bool) -> np.ndarray:
    """Convolution of non-negative arrays, widened by the recursive-summation bound γ_{n+1}."""
    out = np.convolve(a, b)
    n = min(len(a), len(b)) + 1
    slack = 1.01 * n * _U
    return out * (1.0 + slack) if round_up else out * (1.0 - slack)


def _self_convolve(a: np.ndarray, times: int, *, round_up: bool) -> np.ndarray:
    """a convolved with itself ``times`` times (repeated squaring), widened the same way."""
    result: np.ndarray | None = None
    power = a
    while True:
        if times & 1:
            result = power if result is None else _convolve(result, power, round_up=round_up)
        times >>= 1
        if not times:
            break
        power = _convolve(power, power, round_up=round_up)
    assert result is not None
    return result


def _composed_bins(
    sigma: float, batches: int, epochs: int, mean_q: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The E-fold composed loss bins: (lower bounds on P-masses, upper bounds on Q-masses,
    lower edges of the bins' summed estimated loss)."""
    separation = _MEAN_P - mean_q
    tail = _LOG_TAIL_MASS
    lowest = sigma * float(ndtri(math.exp(tail / batches)))
    highest = _MEAN_P + sigma * float(-ndtri(math.exp(tail) / batches))
    # Slices finer than the loss bins (the loss grows like separation/σ² per unit of C).
    spacing = 0.5 * _BIN_WIDTH * sigma * sigma / separation
    count = int(min(max((highest - lowest) / spacing, 2.0), 200_000))
    caps = np.linspace(lowest, highest, count + 1)
    p_lo, _, p_est = _bucket_mass_bounds(*_log_cdf_of_max(caps, _MEAN_P, sigma, batches))
    _, q_hi, q_est = _bucket_mass_bounds(*_log_cdf_of_max(caps, mean_q, sigma, batches))
    keep = (p_est > 0.0) & (q_est > 0.0)
    loss = np.log(p_est[keep]) - np.log(q_est[keep])
    p_lo, q_hi = p_lo[keep], q_hi[keep]
    span = float(loss.max() - loss.min())
    width = max(_BIN_WIDTH, epochs * span / _MAX_COMPOSED_BINS)
    index = np.floor(loss / width).astype(np.int64)
    offset = int(index.min())
    index -= offset
    n_sum = len(loss) + 1
    a = np.bincount(index, weights=p_lo) * (1.0 - 1.01 * n_sum * _U)
    b = np.bincount(index, weights=q_hi) * (1.0 + 1.01 * n_sum * _U)
    a_comp = _self_convolve(a, epochs, round_up=False)
    b_comp = _self_convolve(b, epochs, round_up=True)
    edges = (np.arange(len(a_comp)) + epochs * offset) * width
    return a_comp, b_comp, edges


def _hockey_stick_lower(a_lo: np.ndarray, b_hi: np.ndarray, epsilon: float) -> float:
    """Certified lower bound on Σ_j (a_j − e^ε b_j)_+ given a_j ≥ a_lo_j and b_j ≤ b_hi_j."""
    factor = math.exp(epsilon) * (1.0 + 2.0 * _U)
    terms = np.maximum(a_lo - factor * b_hi * (1.0 + 4.0 * _U), 0.0) * (1.0 - 2.0 * _U)
    return max(float(np.sum(terms)) * (1.0 - 1.01 * (len(terms) + 1) * _U), 0.0)


def _composed_epsilon(a_lo: np.ndarray, b_hi: np.ndarray, delta: float) -> float:
    """Largest ε (rounded down) with the composed bound's δ_lower(ε) ≥ δ; 0 if none."""
    if _hockey_stick_lower(a_lo, b_hi, 0.0) < delta:
        return 0.0
    positive = (a_lo > 0.0) & (b_hi > 0.0)
    # Past the largest bin loss every term is 0, so δ_lower < δ there.
    hi = float(np.max(np.log(a_lo[positive]) - np.log(b_hi[positive]))) + 1.0
    lo = 0.0
    for _ in range(200):
        if hi - lo <= 1e-12 * max(1.0, lo):
            break
        mid = 0.5 * (lo + hi)
        if _hockey_stick_lower(a_lo, b_hi, mid) >= delta:
            lo = mid
        else:
            hi = mid
    return lo


# --------------------------------------------------------------------------- public API


def _check_common(
    batches_per_epoch: Any, epochs: Any, noise_multiplier: Any, neighboring: Any
) -> tuple[int, int, float, float]:
    batches = check_positive_int("batches_per_epoch", batches_per_epoch)
    n_epochs = check_positive_int("epochs", epochs)
    sigma = check_positive_finite("noise_multiplier", noise_multiplier)
    relation = check_enum("neighboring", neighboring, NeighboringRelation)
    return batches, n_epochs, sigma, _mean_q(relation)


def shuffle_delta_lower_bound(
    *,
    batches_per_epoch: int,
    epochs: int,
    noise_multiplier: float,
    epsilon: float,
    neighboring: str = "add_remove",
) -> float:
    """A certified lower bound on δ(ε) of DP-SGD (ABLQ) with shuffled fixed-size batches.

    Every epoch a new uniformly random permutation of the n = b·T records is cut into
    ``batches_per_epoch`` = T batches of b records; each batch's clipped sum gets N(0, (zS)²)
    noise per coordinate. The result is at most the true δ(ε) of that mechanism under the
    ``neighboring`` relation, so no (ε, δ)-DP guarantee with a smaller δ can hold for it.

    One epoch: the bound of Chua et al. (ICML 2024) with the test sets {max_t w_t > C}, in
    closed form, maximised over C. Several epochs: the composition bound of Chua et al.
    (NeurIPS 2024, Theorem 3.8) on the per-epoch maxima, computed on a post-processed
    discretisation (see the module docstring), or the one-epoch bound if that is larger.

    Args:
        batches_per_epoch: T ≥ 1, the number of batches per epoch, ⌈n / b⌉ (the last batch may
            be smaller; see the module docstring).
        epochs: E ≥ 1, the number of epochs, each with a fresh permutation.
        noise_multiplier: z > 0, noise standard deviation divided by the clipping norm.
        epsilon: ε ≥ 0.
        neighboring: ``"add_remove"`` (the relation Chua et al. analyse: one record removed, in
            its zero-out form that keeps the batch sizes; sensitivity S) or ``"replace_one"``
            (one record replaced; sensitivity 2S).

    Returns:
        The lower bound on δ, in [0, 1].

    Raises:
        InvalidParameterError: for an argument outside the ranges above.
    """
    batches, n_epochs, sigma, mean_q = _check_common(
        batches_per_epoch, epochs, noise_multiplier, neighboring
    )
    eps = check_non_negative_finite("epsilon", epsilon)
    caps = _threshold_caps(sigma, batches, mean_q)
    best = _maximise_over_caps(lambda c: _threshold_delta(c, eps, sigma, batches, mean_q), caps)
    if n_epochs >= 2:
        a_lo, b_hi, _ = _composed_bins(sigma, batches, n_epochs, mean_q)
        best = max(best, _hockey_stick_lower(a_lo, b_hi, eps))
    return min(max(best, 0.0), 1.0)


def shuffle_epsilon_lower_bound(
    *,
    batches_per_epoch: int,
    epochs: int,
    noise_multiplier: float,
    delta: float,
    neighboring: str = "add_remove",
) -> float:
    """A certified lower bound on ε(δ) of DP-SGD (ABLQ) with shuffled fixed-size batches.

    The largest ε for which :func:`shuffle_delta_lower_bound` is at least ``delta``, rounded
    down: the mechanism is not (ε′, δ)-DP for any ε′ below the returned value. 0.0 means the
    construction proves nothing at this δ (ε ≥ 0 holds trivially).

    One epoch: for each threshold C the largest such ε is log((P(S_C) − δ)/Q(S_C)) in closed form,
    maximised over C. Several epochs: bisection on the composed bound's δ_lower(ε), which keeps
    δ_lower(lo) ≥ δ and returns lo; the larger of that and the one-epoch value is returned.

    Args:
        batches_per_epoch: T ≥ 1, the number of batches per epoch, ⌈n / b⌉.
        epochs: E ≥ 1, the number of epochs, each with a fresh permutation.
        noise_multiplier: z > 0, noise standard deviation divided by the clipping norm.
        delta: δ in (0, 1).
        neighboring: ``"add_remove"`` (default, as analysed by Chua et al.) or ``"replace_one"``.

    Returns:
        The lower bound on ε, ≥ 0.

    Raises:
        InvalidParameterError: for an argument outside the ranges above.
    """
    batches, n_epochs, sigma, mean_q = _check_common(
        batches_per_epoch, epochs, noise_multiplier, neighboring
    )
    target = check_delta("delta", delta)
    caps = _threshold_caps(sigma, batches, mean_q)
    best = _maximise_over_caps(
        lambda c: _threshold_epsilon(c, target, sigma, batches, mean_q), caps
    )
    if n_epochs >= 2:
        a_lo, b_hi, _ = _composed_bins(sigma, batches, n_epochs, mean_q)
        best = max(best, _composed_epsilon(a_lo, b_hi, target))
    if not best > 0.0:
        return 0.0
    return math.nextafter(best, 0.0)
