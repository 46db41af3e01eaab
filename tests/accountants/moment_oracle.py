"""An independent 50-digit oracle for the Poisson-subsampled Gaussian's RDP log-moment.

log A_α with A_α = E_{x∼N(0, z²)}[(1 − q + q·e^{(2x − 1)/(2z²)})^α], computed by numerical
integration (mpmath ``quad``, 50 significant digits) of the non-negative integrand

    A_α − 1 = E[(1 + u)^α − 1 − α·u],   u = q·(e^{(2x − 1)/(2z²)} − 1)   (E[u] = 0),

so that nothing cancels however small A_α − 1 is. No series is involved, so this checks the
accountant's series, its truncation bound and its rounding bound independently.
"""

from __future__ import annotations

import math

import mpmath as mp
import numpy as np

DIGITS = 50


def _log_integrand_f64(x: np.ndarray, q: float, z: float, alpha: float) -> np.ndarray:
    """A float64 approximation of the integrand's logarithm, only to place breakpoints."""
    t = (2.0 * x - 1.0) / (2.0 * z * z)
    log_mix = np.logaddexp(math.log1p(-q), math.log(q) + t)
    return -0.5 * (x / z) ** 2 + alpha * log_mix


def log_moment(q: float, z: float, alpha: float) -> mp.mpf:
    """log A_α to about 50 digits (0 < q < 1, z > 0, α > 1)."""
    with mp.workdps(DIGITS):
        qm, zm, am = mp.mpf(q), mp.mpf(z), mp.mpf(alpha)

        z0 = z * z * math.log((1.0 - q) / q) + 0.5
        lo, hi = min(-12.0 * z, z0 - 12.0 * z), max(alpha + 12.0 * z, z0 + 12.0 * z)
        grid = np.linspace(lo, hi, 4001)
        log_f = _log_integrand_f64(grid, q, z, alpha)
        peak = float(grid[np.argmax(log_f)])
        # scale the integrand to O(1) at its peak, so that quad's error control is relative
        scale = mp.exp(-max(0.0, float(np.max(log_f))))

        def integrand(x: mp.mpf) -> mp.mpf:
            u = qm * mp.expm1((2 * x - 1) / (2 * zm * zm))
            return scale * mp.npdf(x, 0, zm) * ((1 + u) ** am - 1 - am * u)

        centres = (0.0, peak, z0)
        points = {lo, hi}
        for c in centres:
            points.update(c + z * np.arange(-12.0, 12.5, 1.5))
        inner = sorted(p for p in points if lo <= p <= hi)
        nodes = [-mp.inf, *[mp.mpf(p) for p in inner], mp.inf]
        scaled = mp.quad(integrand, nodes)
        return mp.log1p(scaled / scale)


def log_moment_integer(q: float, z: float, alpha: int) -> mp.mpf:
    """log A_α for an integer order by its finite binomial sum, exactly to 50 digits."""
    with mp.workdps(DIGITS):
        qm, zm = mp.mpf(q), mp.mpf(z)
        return mp.log(
            mp.fsum(
                mp.binomial(alpha, k)
                * (1 - qm) ** (alpha - k)
                * qm**k
                * mp.exp(mp.mpf(k * k - k) / (2 * zm * zm))
                for k in range(alpha + 1)
            )
        )
