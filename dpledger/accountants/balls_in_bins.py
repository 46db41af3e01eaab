"""Monte-Carlo estimates of the privacy of balls-in-bins batch sampling (random allocation).

The sampler
-----------
In each epoch every record is put in exactly one of k batches, chosen uniformly and independently
of the other records; each batch is one Gaussian sum query (clipping norm S, noise N(0, σ̃²) per
coordinate, noise multiplier z = σ̃/S). Chua, Ghazi, Harrison, Leeman, Kamath, Kumar, Manurangsi,
Sinha & Zhang (2025, "Balls-and-Bins Sampling for DP-SGD", AISTATS; arXiv:2412.16802) analyse
the adaptive batch linear queries mechanism with this sampler (their ABLQ_B) under the add/remove
relation, with sensitivity 1 and noise σ = z, through the pair

    P = (1/k)·Σ_{t=1}^{k} N(e_t, σ²I_k),     Q = N(0, σ²I_k),

(e_t the t-th unit vector of R^k: the record lands in one batch, the others see pure noise), and
δ(ε) = max{D_{e^ε}(P‖Q), D_{e^ε}(Q‖P)} with the hockey-stick divergence
D_{e^ε}(A‖B) = ∫ (A − e^ε B)_+. E epochs use independent allocations, so they compose as the
product pair (P^{⊗E}, Q^{⊗E}). The pair is the paper's dominating pair for ABLQ_B (its privacy
analysis section); it is also what the authors' released accountant samples
(google-research ``dpsgd_batch_sampler_accounting/balls_and_bins.py``, whose multi-epoch losses
add up per epoch). The theorem's number in the paper could not be checked against its text when
this module was written; the pair itself was checked against the released code, and for k = 1 it
is the Gaussian mechanism (tested against the closed form of Balle & Wang 2018).

The estimator
-------------
With the privacy loss of one epoch

    L(x) = log(p(x)/q(x)) = log Σ_t exp(x_t/σ²) − log k − 1/(2σ²),

and L_E the sum over epochs,

    D_{e^ε}(P‖Q) = E_{x∼P}[(1 − e^{ε − L_E(x)})_+],
    D_{e^ε}(Q‖P) = E_{x∼Q}[(1 − e^{ε + L_E(x)})_+].

By the symmetry of L under permuting the batches, sampling x from P is sampling from its first
component N(e_1, σ²I_k) in each epoch. This is plain Monte Carlo (no importance sampling): each
direction averages ``samples`` independent values in [0, 1]. Its standard error is about
√(δ/samples), so a relative accuracy r at a small δ needs about 1/(r²δ) samples (10⁶ for 10% at
δ = 10⁻⁴). The cost is samples × k × E normal draws per direction; they are drawn in chunks of at
most ~2²⁰ numbers, so memory stays bounded whatever the sample count.

Confidence. Each direction's upper confidence bound is the Chernoff–Hoeffding bound for the mean
of independent variables in [0, 1] (Hoeffding 1963, Theorem 1): with m̂ the sample mean, n the
sample count and c the direction's error probability, the bound is the largest p ≥ m̂ with
n·KL(m̂ ‖ p) ≤ log(1/c), KL the Bernoulli relative entropy. It is exact at every n (not
asymptotic). The two directions share the error probability 1 − confidence by a union bound
(c = (1 − confidence)/2 each), so the maximum of their bounds is an upper bound on δ(ε) with
probability at least ``confidence`` over the draws. It bounds the δ of the pair above only: it is
not a certified upper bound in the sense of the RDP accountant (it can fail with probability
1 − confidence, and floating-point rounding of the losses is not bounded).

ε for a target δ. Every sample's term is non-increasing in ε, so both the estimate and the
confidence bound are non-increasing in ε for a fixed seed. Every ε tried sees the same draws
(regenerated from the seed, or, up to 2²² samples per direction, drawn once and kept), and ε is
found by repeatedly evaluating a grid of ε values in one pass over the draws and narrowing the
bracket (a vectorised bisection), to a relative 10⁻⁹.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator

import attrs
import numpy as np
from scipy.optimize import brentq
from scipy.special import logsumexp

from dpledger.errors import InvalidParameterError
from dpledger.validation import (
    check_delta,
    check_non_negative_finite,
    check_non_negative_int,
    check_positive_finite,
    check_positive_int,
)

__all__ = ["BallsInBinsEstimate", "balls_in_bins_delta", "balls_in_bins_epsilon"]

_CHUNK_ELEMENTS = 1 << 20  # normal draws held at once per direction
_KEEP_SAMPLES = 1 << 22  # the ε search keeps up to this many losses per direction (32 MiB)
_GRID = 33  # ε values evaluated per pass over the draws in the ε search
_EPS_RELATIVE = 1e-9  # the ε search stops when the bracket is this narrow (relative, or absolute
# below 1)
_REMOVE, _ADD = 0, 1


@attrs.frozen
class BallsInBinsEstimate:
    """A Monte-Carlo estimate of a privacy parameter of balls-in-bins sampling.

    Attributes:
        estimate: the Monte-Carlo estimate (δ for :func:`balls_in_bins_delta`; for
            :func:`balls_in_bins_epsilon`, the ε at which the estimated δ meets the target).
        upper_confidence: an upper bound holding with probability at least ``confidence`` over
            the draws (the Chernoff–Hoeffding bound on δ; for ε, the ε at which that bound on δ
            meets the target, +∞ if it never does with this many samples).
        confidence: the probability the upper bound holds with.
        standard_error: the estimated standard error of the δ estimate (of the direction with the
            larger estimate, at the returned ε for :func:`balls_in_bins_epsilon`).
        samples: the number of draws per direction.
        seed: the seed the draws were generated from (the same seed gives the same numbers).
    """

    estimate: float
    upper_confidence: float
    confidence: float
    standard_error: float
    samples: int
    seed: int


def _loss_chunks(
    sigma: float, k: int, epochs: int, direction: int, samples: int, seed: int
) -> Iterator[np.ndarray]:
    """Privacy-loss samples of one direction, chunk by chunk, the same for the same arguments.

    ``_REMOVE``: L_E(x) for x ∼ P (first component in each epoch). ``_ADD``: −L_E(x) for x ∼ Q.
    The hockey-stick term is (1 − e^{ε − loss})_+ either way.
    """
    rng = np.random.default_rng(np.random.SeedSequence([seed, direction]))
    rows = max(1, _CHUNK_ELEMENTS // k)
    shift = math.log(k) + 0.5 / (sigma * sigma)
    inv_sigma = 1.0 / sigma
    first = 1.0 / (sigma * sigma)  # e_1/σ²: the first coordinate's mean shift in x/σ²
    for start in range(0, samples, rows):
        m = min(rows, samples - start)
        loss = np.zeros(m)
        for _ in range(epochs):
            scaled = rng.standard_normal((m, k)) * inv_sigma  # x/σ² for x = σ·g
            if direction == _REMOVE:
                scaled[:, 0] += first
            loss += logsumexp(scaled, axis=1) - shift
        yield loss if direction == _REMOVE else -loss


def _hockey_sums(
    chunks: Iterable[np.ndarray], eps: np.ndarray
) -> tuple[np.ndarray, np.ndarray, float]:
    """Σ and Σ² of the hockey-stick terms (1 − e^{ε − loss})_+ at each ε over the loss samples
    in ``chunks``, and the largest loss."""
    total = np.zeros(eps.shape[0])
    squares = np.zeros(eps.shape[0])
    largest = -math.inf
    # the draws are chunked independently of the grid (so every grid sees the same numbers);
    # the terms are formed a block of rows at a time, so that rows × grid stays bounded too
    block = max(1, _CHUNK_ELEMENTS // eps.shape[0])
    for loss in chunks:
        largest = max(largest, float(loss.max()))
        for start in range(0, loss.shape[0], block):
            part = loss[start : start + block, None]
            with np.errstate(over="ignore"):
                terms = np.maximum(-np.expm1(eps[None, :] - part), 0.0)
            total += terms.sum(axis=0)
            squares += np.square(terms).sum(axis=0)
    return total, squares, largest


def _bernoulli_kl(m: float, p: float) -> float:
    """KL(Bernoulli(m) ‖ Bernoulli(p)) for 0 ≤ m ≤ p < 1."""
    out = 0.0
    if m > 0.0:
        out += m * math.log(m / p)
    if m < 1.0:
        out += (1.0 - m) * (math.log1p(-m) - math.log1p(-p))
    return out


def _upper_confidence(mean: float, n: int, error: float) -> float:
    """The largest p ≥ mean with n·KL(mean ‖ p) ≤ log(1/error) (Chernoff–Hoeffding, [0, 1])."""
    mean = min(max(mean, 0.0), 1.0)
    if mean >= 1.0:
        return 1.0
    budget = math.log(1.0 / error) / n
    if mean == 0.0:
        return -math.expm1(-budget)  # KL(0 ‖ p) = −log(1 − p)
    hi = 1.0 - 1e-16
    if _bernoulli_kl(mean, hi) <= budget:
        return 1.0
    p = brentq(lambda p: _bernoulli_kl(mean, p) - budget, mean, hi, xtol=1e-300, rtol=1e-15)
    # round up by the root's tolerance (the KL is evaluated to a few ulp; far below it)
    return min(1.0, p * (1.0 + 4e-15) + 1e-300)


def _check_common(
    noise_multiplier: float,
    num_batches: int,
    epochs: int,
    samples: int,
    seed: int,
    confidence: float,
) -> tuple[float, int, int, int, int, float]:
    sigma = check_positive_finite("noise_multiplier", noise_multiplier)
    k = check_positive_int("num_batches", num_batches)
    e = check_positive_int("epochs", epochs)
    n = check_positive_int("samples", samples)
    if n < 2:
        raise InvalidParameterError("samples", samples, "an integer >= 2")
    s = check_non_negative_int("seed", seed)
    c = check_delta("confidence", confidence)
    return sigma, k, e, n, s, c


def _directions(
    sources: list[Callable[[], Iterable[np.ndarray]]], samples: int, eps: np.ndarray
) -> list[tuple[np.ndarray, np.ndarray, float]]:
    """Per direction: the mean and the standard error at each ε, and the largest loss drawn."""
    out = []
    for source in sources:
        total, squares, largest = _hockey_sums(source(), eps)
        mean = total / samples
        variance = np.maximum(squares - samples * mean * mean, 0.0) / (samples - 1)
        out.append((mean, np.sqrt(variance / samples), largest))
    return out


def _sources(
    sigma: float, k: int, epochs: int, samples: int, seed: int, *, keep: bool
) -> list[Callable[[], Iterable[np.ndarray]]]:
    """For each direction, a function giving its loss samples (the same ones on every call):
    drawn again from the seed each time, or drawn once and kept when ``keep`` and they fit in
    ``_KEEP_SAMPLES`` (8 bytes each)."""
    out: list[Callable[[], Iterable[np.ndarray]]] = []
    for direction in (_REMOVE, _ADD):
        if keep and samples <= _KEEP_SAMPLES:
            kept = list(_loss_chunks(sigma, k, epochs, direction, samples, seed))

            def kept_chunks(kept: list[np.ndarray] = kept) -> Iterable[np.ndarray]:
                return kept

            out.append(kept_chunks)
        else:

            def fresh_chunks(d: int = direction) -> Iterable[np.ndarray]:
                return _loss_chunks(sigma, k, epochs, d, samples, seed)

            out.append(fresh_chunks)
    return out


def balls_in_bins_delta(
    epsilon: float,
    noise_multiplier: float,
    num_batches: int,
    *,
    epochs: int = 1,
    samples: int,
    seed: int,
    confidence: float = 0.99,
) -> BallsInBinsEstimate:
    """Estimate δ(ε) of E epochs of balls-in-bins sampling with Gaussian sum queries (add/remove).

    Args:
        epsilon: ε ≥ 0.
        noise_multiplier: z = σ̃/S > 0 (the pair's σ, sensitivity 1).
        num_batches: k ≥ 1, the number of batches per epoch (k = 1: one full-batch Gaussian
            query per epoch).
        epochs: E ≥ 1 epochs, composed as the product pair.
        samples: draws per direction (≥ 2); the standard error is about √(δ/samples).
        seed: a non-negative integer; the draws are ``numpy.random.default_rng`` streams of
            ``SeedSequence([seed, direction])``, so the same seed gives the same result.
        confidence: the probability, in (0, 1), that ``upper_confidence`` bounds the true δ.

    Returns:
        :class:`BallsInBinsEstimate` with the estimate max(δ̂_remove, δ̂_add), the
        Chernoff–Hoeffding upper confidence bound (the larger of the two directions' bounds, each
        at error probability (1 − confidence)/2), and the standard error of the larger estimate.
        An *estimate* with a probabilistic bound, not a certified bound (module docstring).

    Raises:
        InvalidParameterError: for a parameter outside the ranges above.
    """
    eps = check_non_negative_finite("epsilon", epsilon)
    sigma, k, e, n, s, c = _check_common(
        noise_multiplier, num_batches, epochs, samples, seed, confidence
    )
    results = _directions(_sources(sigma, k, e, n, s, keep=False), n, np.array([eps]))
    means = [float(r[0][0]) for r in results]
    errors = [float(r[1][0]) for r in results]
    bounds = [_upper_confidence(m, n, (1.0 - c) / 2.0) for m in means]
    worst = int(np.argmax(means))
    return BallsInBinsEstimate(
        estimate=means[worst],
        upper_confidence=max(max(bounds), means[worst]),
        confidence=c,
        standard_error=errors[worst],
        samples=n,
        seed=s,
    )


def balls_in_bins_epsilon(
    delta: float,
    noise_multiplier: float,
    num_batches: int,
    *,
    epochs: int = 1,
    samples: int,
    seed: int,
    confidence: float = 0.99,
) -> BallsInBinsEstimate:
    """Estimate the ε at which δ(ε) of balls-in-bins sampling meets a target δ.

    Args:
        delta: the target δ, 0 < δ < 1.
        noise_multiplier, num_batches, epochs, samples, seed, confidence: as for
            :func:`balls_in_bins_delta`.

    Returns:
        :class:`BallsInBinsEstimate` with ``estimate`` the smallest ε ≥ 0 at which the estimated
        δ is at most the target, and ``upper_confidence`` the smallest ε at which the
        Chernoff–Hoeffding upper confidence bound on δ is at most the target (so with probability
        at least ``confidence`` the pair is (upper_confidence, δ)-DP); +∞ where that bound never
        gets down to the target with this many samples (it is at least
        1 − ((1 − confidence)/2)^{1/n} even where every draw gives 0). Both to a relative 10⁻⁹
        (absolute below ε = 1), rounded up. ``standard_error`` is that of the δ estimate at the
        returned ``estimate``.

    Raises:
        InvalidParameterError: for a parameter outside the ranges above.
    """
    target = check_delta("delta", delta)
    sigma, k, e, n, s, c = _check_common(
        noise_multiplier, num_batches, epochs, samples, seed, confidence
    )
    error = (1.0 - c) / 2.0
    sources = _sources(sigma, k, e, n, s, keep=True)

    def evaluate(grid: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        """Estimate, upper bound and standard error of δ at each ε, and the largest loss."""
        (m_r, se_r, l_r), (m_a, se_a, l_a) = _directions(sources, n, grid)
        est = np.maximum(m_r, m_a)
        se = np.where(m_r >= m_a, se_r, se_a)
        ucb = np.array(
            [
                max(_upper_confidence(float(a), n, error), _upper_confidence(float(b), n, error))
                for a, b in zip(m_r, m_a, strict=True)
            ]
        )
        return est, np.maximum(ucb, est), se, max(l_r, l_a)

    # every term vanishes once ε is at least the largest loss drawn, so the estimate is 0 there
    # and the bound is its value for a mean of 0 from there on
    est, ucb, _, largest = evaluate(np.array([0.0]))
    top = max(largest, 0.0)
    values_at_zero = (float(est[0]), float(ucb[0]))
    _, ucb_top, _, _ = evaluate(np.array([top]))
    values_at_top = (0.0, float(ucb_top[0]))
    # brackets [lo, hi] with value(lo) > target ≥ value(hi); None where ε = 0 already meets it,
    # hi = +∞ where no ε does
    brackets: list[list[float] | None] = []
    for at_zero, at_top in zip(values_at_zero, values_at_top, strict=True):
        if at_zero <= target:
            brackets.append(None)
        else:
            brackets.append([0.0, top if at_top <= target else math.inf])

    def unresolved(b: list[float] | None) -> bool:
        return (
            b is not None and math.isfinite(b[1]) and b[1] - b[0] > _EPS_RELATIVE * max(1.0, b[1])
        )

    while any(unresolved(b) for b in brackets):
        live = [(i, b) for i, b in enumerate(brackets) if b is not None and unresolved(b)]
        grid = np.unique(np.concatenate([np.linspace(b[0], b[1], _GRID) for _, b in live]))
        est, ucb, _, _ = evaluate(grid)
        for i, b in live:
            values = (est, ucb)[i]
            inside = (grid >= b[0]) & (grid <= b[1])
            g, v = grid[inside], values[inside]
            above, below = g[v > target], g[v <= target]
            if above.size:
                b[0] = float(above.max())
            if below.size:
                b[1] = float(below.min())
    eps_est = 0.0 if brackets[0] is None else brackets[0][1]
    eps_ucb = 0.0 if brackets[1] is None else brackets[1][1]
    _, _, se, _ = evaluate(np.array([eps_est]))
    return BallsInBinsEstimate(
        estimate=eps_est,
        upper_confidence=eps_ucb,
        confidence=c,
        standard_error=float(se[0]),
        samples=n,
        seed=s,
    )
