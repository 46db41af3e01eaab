"""The dominating pair of one Poisson-subsampled Gaussian step, in noise coordinates.

A ledger step is one Gaussian sum query with noise multiplier z on a Poisson sample drawn with
probability q (McMahan & Andrew, Eq. 1). In units of the clipping bound S the worst-case pair of
output distributions, restricted to the line through the differing record, is a pair of Gaussian
mixtures with standard deviation z:

* add/remove one record: P = (1 − q)·N(0, z²) + q·N(1, z²) and Q = N(0, z²). A data set and its
  neighbour may differ in either direction, so both (P, Q) ("remove") and (Q, P) ("add") must be
  accounted; the add direction is the privacy loss −L under Q (Zhu, Dong & Wang 2022; the same pair
  dp-accounting uses for ``PoissonSampledDpEvent`` under ``ADD_OR_REMOVE_ONE``).
* replace one record by another: P = (1 − q)·N(0, z²) + q·N(1, z²) and
  Q = (1 − q)·N(0, z²) + q·N(−1, z²): the record x is replaced by −x, so a sum query clipped to S
  has sensitivity 2S (for q = 1 this is the Gaussian mechanism with noise multiplier z/2). The
  pair is symmetric (reflection x → −x swaps P and Q), so one direction suffices.

The privacy loss L(x) = log(P(x)/Q(x)) is increasing in the noise coordinate x, so its law under P
or Q is described by the mixture CDFs at the point x(ℓ) where L = ℓ; everything below works in x.
Full-batch steps (q = 1) of either relation are pure Gaussian mechanisms and are handled in closed
form by :mod:`dpledger.accountants.prv.gaussian`, so this module assumes 0 < q < 1.
"""

from __future__ import annotations

import math

import attrs
import numpy as np
import scipy.special

__all__ = ["StepPair", "noise_at_loss", "p_tails", "q_tails"]


def noise_at_loss(
    loss: np.ndarray, q: np.ndarray | float, z: np.ndarray | float, replace_one: bool
) -> np.ndarray:
    """x(ℓ): the noise coordinate where L(x) = ℓ (−∞ at or below the infimum of L).

    Vectorised over ``loss``, ``q`` and ``z`` (broadcast). add/remove:
    e^ℓ = 1 − q + q·exp((2x − 1)/(2z²)), so x = 1/2 + z²·log((1 − q)·expm1(ℓ − log(1 − q))/q),
    written to stay accurate near the infimum log(1 − q). replace-one: with
    c = (1 − q)·e^{1/(2z²)}/q, e^ℓ = u(c + u)/(cu + 1) for u = e^{x/z²}, whose positive root gives
    x = z²·(ℓ/2 + asinh(c·sinh(ℓ/2))), an odd function of ℓ.
    """
    loss = np.asarray(loss, dtype=float)
    q = np.asarray(q, dtype=float)
    z2 = np.asarray(z, dtype=float) ** 2
    log1mq = np.log1p(-q)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        if replace_one:
            log_c = log1mq + 0.5 / z2 - np.log(q)
            half = 0.5 * loss
            y = np.exp(np.minimum(log_c, 700.0)) * np.sinh(half)
            small = (np.abs(y) < 1e150) & (log_c < 700.0)
            # asinh(y) = sign(y)·(log 2|y| + O(1/y²)) for huge |y|;
            # 2·sinh|ℓ/2| = e^{|ℓ|/2}·(1 − e^{−|ℓ|})
            big = np.sign(loss) * (log_c + np.abs(half) + np.log1p(-np.exp(-2 * np.abs(half))))
            asinh = np.where(small, np.arcsinh(np.where(small, y, 0.0)), big)
            return z2 * (half + asinh)
        shifted = loss - log1mq
        positive = np.where(shifted > 0, shifted, np.nan)
        # log(e^s − 1) = s + log(1 − e^{−s}): expm1 overflows beyond s ≈ 709.8
        inner = np.where(
            positive > 700.0, positive + np.log1p(-np.exp(-positive)), np.log(np.expm1(positive))
        )
        x = 0.5 + z2 * (log1mq - np.log(q) + inner)
        return np.where(shifted > 0, x, -np.inf)


def _tails(
    x: np.ndarray, z: np.ndarray | float, components: list[tuple[np.ndarray, float]]
) -> tuple[np.ndarray, np.ndarray]:
    """(Pr[X ≤ x], Pr[X > x]) of a Gaussian mixture, each accurate where it is small."""
    le = np.zeros(np.shape(x))
    gt = np.zeros(np.shape(x))
    for weight, mean in components:
        t = (x - mean) / z
        small = scipy.special.ndtr(-np.abs(t))
        neg = t < 0
        le += weight * np.where(neg, small, 1.0 - small)
        gt += weight * np.where(neg, 1.0 - small, small)
    return le, gt


def p_tails(
    x: np.ndarray, q: np.ndarray | float, z: np.ndarray | float
) -> tuple[np.ndarray, np.ndarray]:
    """(P[X ≤ x], P[X > x]) for P = (1 − q)·N(0, z²) + q·N(1, z²) (both relations)."""
    q = np.asarray(q, dtype=float)
    return _tails(x, z, [(1.0 - q, 0.0), (q, 1.0)])


def q_tails(
    x: np.ndarray, q: np.ndarray | float, z: np.ndarray | float, replace_one: bool
) -> tuple[np.ndarray, np.ndarray]:
    """(Q[X ≤ x], Q[X > x]): Q = N(0, z²), or (1 − q)·N(0, z²) + q·N(−1, z²) for replace-one."""
    q = np.asarray(q, dtype=float)
    if replace_one:
        return _tails(x, z, [(1.0 - q, 0.0), (q, -1.0)])
    return _tails(x, z, [(np.ones_like(q), 0.0)])


@attrs.frozen
class StepPair:
    """The pair (P, Q) of one Poisson-subsampled Gaussian step.

    Attributes:
        q: sampling probability, 0 < q < 1.
        z: noise multiplier (noise standard deviation in units of the clipping bound), > 0.
        replace_one: the replace-one relation (sensitivity 2) instead of add/remove.
    """

    q: float
    z: float
    replace_one: bool = False

    @property
    def symmetric(self) -> bool:
        """True when the law of L under P equals the law of −L under Q (one direction suffices)."""
        return self.replace_one

    def _components(self, under_q: bool) -> tuple[tuple[float, float], ...]:
        if not under_q:
            return ((1.0 - self.q, 0.0), (self.q, 1.0))
        if self.replace_one:
            return ((1.0 - self.q, 0.0), (self.q, -1.0))
        return ((1.0, 0.0),)

    @property
    def loss_infimum(self) -> float:
        """The infimum of L (log(1 − q) for add/remove, −∞ for replace-one)."""
        return -math.inf if self.replace_one else math.log1p(-self.q)

    def noise_at_loss(self, loss: np.ndarray) -> np.ndarray:
        """x(ℓ) (see :func:`noise_at_loss`)."""
        return noise_at_loss(loss, self.q, self.z, self.replace_one)

    def loss_at_noise(self, x: np.ndarray) -> np.ndarray:
        """L(x) = log(P(x)/Q(x)) for the pair's densities (vectorised)."""
        x = np.asarray(x, dtype=float)
        q, z2 = self.q, self.z * self.z
        lp = np.logaddexp(math.log1p(-q), math.log(q) + (2 * x - 1) / (2 * z2))
        if not self.replace_one:
            return lp
        lq = np.logaddexp(math.log1p(-q), math.log(q) + (-2 * x - 1) / (2 * z2))
        return lp - lq

    def p_tails(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(P[X ≤ x], P[X > x]) — equivalently (P[L ≤ ℓ], P[L > ℓ]) at x = x(ℓ)."""
        return p_tails(x, self.q, self.z)

    def q_tails(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(Q[X ≤ x], Q[X > x])."""
        return q_tails(x, self.q, self.z, self.replace_one)

    def loss_with_upper_tail(self, mass: float, *, under_q: bool = False) -> float:
        """An ℓ with Pr[L > ℓ] ≤ mass under P (or under Q), nearly the smallest such ℓ.

        Each of the k mixture components gets mass/k: its tail Pr[X > x] ≤ mass/(k·weight) at
        x = mean + z·Φ⁻¹(1 − mass/(k·weight)), and the largest such x bounds the mixture.
        """
        comps = self._components(under_q)
        xs = []
        for weight, mean in comps:
            share = mass / (len(comps) * weight)
            if share < 1.0:
                xs.append(mean - self.z * float(scipy.special.ndtri(share)))
        x = max(xs) if xs else -math.inf
        return float(self.loss_at_noise(np.array([x]))[0])

    def loss_with_lower_tail(self, mass: float) -> float:
        """The largest ℓ with P[L < ℓ] ≤ mass (the infimum when L is bounded below)."""
        if not self.replace_one:
            return self.loss_infimum
        # symmetric pair: the law of L under P is the law of −L under Q
        return -self.loss_with_upper_tail(mass, under_q=True)
