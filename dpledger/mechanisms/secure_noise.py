"""Secure noise: a ChaCha20 keystream keyed from the OS and a discrete Gaussian on a grid γℤ.

Two weaknesses of ordinary floating-point Gaussian noise are addressed here
(docs/concepts/noise.md, "Where the noise comes from"):

* **Predictable generators.** Mersenne Twister, PCG64 and Philox are not cryptographic: their
  state (or seed) gives every draw. :class:`ChaCha20Stream` is the ChaCha20 block function of
  RFC 8439 (section 2.3), vectorised in NumPy over blocks, keyed with 32 bytes from
  ``os.urandom`` (or a key a test injects), with a 96-bit nonce and a 32-bit block counter; it
  is checked against the RFC's test vector. It is never written to a checkpoint.
* **Floating-point artefacts.** ``x + σ·N`` computed in floating point has a set of reachable
  values that depends on x (Mironov 2012; Jin et al. 2022 for Gaussian samplers), so the low
  bits of the output can reveal x. :func:`secure_noisy_sum` rounds the sum to the grid γℤ
  (γ a power of two), adds integer noise K from the discrete Gaussian N_ℤ(0, (σ/γ)²) and
  returns (round(x/γ) + K)·γ, which is exact in float64: the output is an integer multiple of
  γ whose distribution depends on x only through round(x/γ).

The discrete Gaussian sampler (:func:`discrete_gaussian`) follows Canonne, Kamath & Steinke
(2020), Algorithms 2 and 3: a discrete Laplace proposal Y of scale t = ⌊σ⌋ + 1 accepted with
probability exp(−(|Y| − σ²/t)²/(2σ²)), vectorised over coordinates. Integers are drawn exactly
(uniforms below t by rejection from 64-bit words, geometric counts by Bernoulli(e^(−1))
chains); the probabilities computed in floating point are each compared where a 53-bit uniform
resolves them to a relative error of about 2⁻⁵², so every integer's probability is within a
factor 1 ± 2⁻⁵⁰ of the exact pmf whatever σ is (the bound and what it costs in ε are in
docs/concepts/noise.md). The floating point touches only *which integer* is drawn, never the
output value, and the result is independent of x.

Sensitivity after rounding: rounding each coordinate of both neighbouring sums to γℤ moves each
by at most γ/2 per coordinate, so ‖round(x) − round(x')‖₂ ≤ S + γ√d. :func:`secure_noisy_sum`
records the sum query with that bound (the ledger's ``l2_norm_bound``) and σ, so the accountants
replay the mechanism that ran (the grid is the recorded bound's excess over S, divided by √d).
Which accountants are sound for it is argued in docs/concepts/noise.md.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from dpledger.errors import InvalidParameterError
from dpledger.mechanisms.backend import NumpyBackend
from dpledger.validation import check_positive_finite

__all__ = [
    "ChaCha20Stream",
    "SecureNoiseBackend",
    "add_on_grid",
    "chacha20_blocks",
    "discrete_gaussian",
    "grid_for",
    "recorded_bound",
    "secure_noisy_sum",
]

_CONSTANTS = np.array([0x61707865, 0x3320646E, 0x79622D32, 0x6B206574], dtype=np.uint32)
_CHUNK_BLOCKS = 1 << 16  # blocks per vectorised call (64 KiB of state rows each)


_SHIFTS = {r: (np.uint32(r), np.uint32(32 - r)) for r in (16, 12, 8, 7)}


def _xor_rotl(x: np.ndarray, y: np.ndarray, r: int, tmp: np.ndarray) -> None:
    """x = (x ^ y) <<< r, in place (tmp: scratch of x's shape)."""
    left, right = _SHIFTS[r]
    np.bitwise_xor(x, y, out=x)
    np.right_shift(x, right, out=tmp)
    np.left_shift(x, left, out=x)
    np.bitwise_or(x, tmp, out=x)


def _quarter(s: list[np.ndarray], a: int, b: int, c: int, d: int, tmp: np.ndarray) -> None:
    np.add(s[a], s[b], out=s[a])
    _xor_rotl(s[d], s[a], 16, tmp)
    np.add(s[c], s[d], out=s[c])
    _xor_rotl(s[b], s[c], 12, tmp)
    np.add(s[a], s[b], out=s[a])
    _xor_rotl(s[d], s[a], 8, tmp)
    np.add(s[c], s[d], out=s[c])
    _xor_rotl(s[b], s[c], 7, tmp)


def chacha20_blocks(key: bytes, nonce: bytes, counters: np.ndarray) -> np.ndarray:
    """The ChaCha20 block function (RFC 8439, section 2.3) for many counters at once.

    Args:
        key: 32 bytes.
        nonce: 12 bytes.
        counters: the 32-bit block counters, a 1-D integer array.

    Returns:
        uint32 array of shape (len(counters), 16): each row is one 64-byte block as 16
        little-endian words (``row.tobytes()`` is the keystream block on a little-endian
        machine; :meth:`ChaCha20Stream.words` uses the words directly).
    """
    if not isinstance(key, bytes | bytearray) or len(key) != 32:
        raise InvalidParameterError("key", "<key>", "32 bytes")
    if not isinstance(nonce, bytes | bytearray) or len(nonce) != 12:
        raise InvalidParameterError("nonce", nonce, "12 bytes")
    ctr = np.asarray(counters, dtype=np.uint64)
    if ctr.ndim != 1 or (ctr.size and int(ctr.max()) >= 1 << 32):
        raise InvalidParameterError("counters", "<counters>", "a 1-D array of 32-bit counters")
    k = np.frombuffer(bytes(key), dtype="<u4").astype(np.uint32)
    n = np.frombuffer(bytes(nonce), dtype="<u4").astype(np.uint32)
    fixed = np.concatenate([_CONSTANTS, k, np.zeros(1, np.uint32), n])
    start = [np.full(ctr.size, w, dtype=np.uint32) for w in fixed]
    start[12] = ctr.astype(np.uint32)
    s = [w.copy() for w in start]
    tmp = np.empty(ctr.size, dtype=np.uint32)
    with np.errstate(over="ignore"):
        for _ in range(10):  # 20 rounds: a column round and a diagonal round each
            _quarter(s, 0, 4, 8, 12, tmp)
            _quarter(s, 1, 5, 9, 13, tmp)
            _quarter(s, 2, 6, 10, 14, tmp)
            _quarter(s, 3, 7, 11, 15, tmp)
            _quarter(s, 0, 5, 10, 15, tmp)
            _quarter(s, 1, 6, 11, 12, tmp)
            _quarter(s, 2, 7, 8, 13, tmp)
            _quarter(s, 3, 4, 9, 14, tmp)
        out = np.empty((ctr.size, 16), dtype=np.uint32)
        for i in range(16):
            out[:, i] = s[i] + start[i]
    return out


class ChaCha20Stream:
    """A ChaCha20 keystream as uint32 words: key from ``os.urandom(32)`` unless given.

    Args:
        key: 32 bytes; None (the default, and the only choice outside tests) draws it from the
            operating system. A given key makes the stream reproducible: for tests only.
        nonce: 12 bytes (default zeros: each stream has its own random key).

    The block counter is 32 bits: one stream gives at most 2³² blocks (256 GiB); past that it
    rekeys from the OS (a given key cannot be continued, and raises).
    """

    def __init__(self, key: bytes | None = None, nonce: bytes = bytes(12)) -> None:
        self._given = key is not None
        self._key = os.urandom(32) if key is None else bytes(key)
        chacha20_blocks(self._key, nonce, np.zeros(0, np.uint32))  # checks key and nonce
        self._nonce = bytes(nonce)
        self._counter = 0

    @property
    def keyed_by_caller(self) -> bool:
        """Whether the key was given (a test) rather than drawn from the OS."""
        return self._given

    def words(self, count: int) -> np.ndarray:
        """The next ``count`` keystream words (uint32)."""
        blocks = -(-int(count) // 16)
        if self._counter + blocks > 1 << 32:
            if self._given:
                raise InvalidParameterError("count", count, "at most 2**32 blocks per key")
            self._key, self._counter = os.urandom(32), 0
        parts = []
        for first in range(self._counter, self._counter + blocks, _CHUNK_BLOCKS):
            last = min(first + _CHUNK_BLOCKS, self._counter + blocks)
            parts.append(chacha20_blocks(self._key, self._nonce, np.arange(first, last)))
        self._counter += blocks
        if not parts:
            return np.zeros(0, dtype=np.uint32)
        return np.concatenate(parts).reshape(-1)[: int(count)]

    def uniforms(self, count: int) -> np.ndarray:
        """``count`` float64 uniforms in (0, 1): (m + 0.5)·2⁻⁵³ for a 53-bit integer m made of
        two keystream words."""
        return self.uniforms_and_bits(count)[0]

    def uniforms_and_bits(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`uniforms` and, for each, an independent random bit (one of the 11 bits of
        the two words that the 53-bit integer does not use)."""
        w = self.words(2 * int(count)).astype(np.uint64).reshape(-1, 2)
        m = ((w[:, 0] >> np.uint64(5)) << np.uint64(26)) | (w[:, 1] >> np.uint64(6))
        bits = (w[:, 1] & np.uint64(1)).astype(bool)
        return (m.astype(np.float64) + 0.5) * 2.0**-53, bits

    def __getstate__(self) -> Any:
        raise TypeError("a ChaCha20Stream is never pickled: its key is the noise")


_INV_E = math.exp(-1.0)


def _geometric_counts(stream: ChaCha20Stream, size: int) -> np.ndarray:
    """``size`` draws of J with P[J = j] = e^(−j)·(1 − e^(−1)): the number of successes of
    Bernoulli(e^(−1)) trials before the first failure (each trial a 53-bit uniform compared
    with the double nearest e^(−1)). No truncation: the loop runs until every draw failed."""
    counts = np.zeros(size, dtype=np.int64)
    active = np.arange(size)
    while active.size:
        success = stream.uniforms(active.size) < _INV_E
        active = active[success]
        counts[active] += 1
    return counts


def _exceeds_exponential(stream: ChaCha20Stream, threshold: np.ndarray) -> np.ndarray:
    """Bernoulli(exp(−c)) for each c ≥ 0 of ``threshold``, as E > c for E = J + F ~ Exp(1):
    J the whole part (:func:`_geometric_counts`), F = −ln(1 − U·(1 − e^(−1))) its fraction in
    [0, 1). Comparing J with ⌊c⌋ first keeps the floating point to a fraction below 1, so the
    probability is right to a relative error of a few 2⁻⁵³ however large c is."""
    whole = np.floor(threshold)
    j = _geometric_counts(stream, threshold.size)
    f = -np.log1p(-stream.uniforms(threshold.size) * (1.0 - _INV_E))
    return (j > whole) | ((j == whole) & (f > threshold - whole))


def _uniform_below(stream: ChaCha20Stream, t: int, size: int) -> np.ndarray:
    """``size`` exact uniform integers in [0, t) (t ≤ 2⁴¹) from 32- or 64-bit words, by
    rejection of the words above the largest multiple of t."""
    out = np.empty(size, dtype=np.int64)
    filled = 0
    bits = 32 if t <= 1 << 31 else 64  # one word per draw, or two
    limit = np.uint64(((1 << bits) // t) * t - 1)
    while filled < size:
        w = stream.words((bits // 32) * (size - filled) + 32).astype(np.uint64)
        if bits == 64:
            w = w.reshape(-1, 2)
            m = (w[:, 0] << np.uint64(32)) | w[:, 1]
        else:
            m = w
        m = m[m <= limit] % np.uint64(t)
        take = min(size - filled, m.size)
        out[filled : filled + take] = m[:take].astype(np.int64)
        filled += take
    return out


def discrete_gaussian(stream: ChaCha20Stream, sigma: float, size: int) -> np.ndarray:
    """``size`` independent draws of the discrete Gaussian N_ℤ(0, σ²) (int64), by Canonne,
    Kamath & Steinke 2020, Algorithms 2 and 3, vectorised.

    Discrete Laplace proposal of scale t = ⌊σ⌋ + 1: magnitude t·V + R with R uniform in
    [0, t) kept with probability e^(−R/t) and V geometric with ratio e^(−1) (so
    P[t·V + R = g] ∝ e^(−g/t) exactly, up to the acceptance's rounding), a random sign, −0
    refused; then kept with probability exp(−(|Y| − σ²/t)²/(2σ²)) by
    :func:`_exceeds_exponential`. Every probability the floating point computes is compared
    at a scale where the 53-bit uniforms resolve it to a relative error of about 2⁻⁵² (e^(−R/t)
    ≥ e^(−1); the exponentials' fractions), so each integer's probability is within a factor
    1 ± 2⁻⁵⁰ of the exact pmf (docs/concepts/noise.md), independently of σ; nothing is
    truncated. The floating point decides which integer is drawn and never touches its value.
    """
    sigma = check_positive_finite("sigma", sigma)
    if sigma > 2.0**40:
        raise InvalidParameterError("sigma", sigma, "at most 2**40 grid steps")
    t = math.floor(sigma) + 1
    shift = sigma * sigma / t
    two_var = 2.0 * sigma * sigma
    out = np.empty(int(size), dtype=np.int64)
    filled = 0
    while filled < size:
        need = int(size) - filled
        trials = need * 2 + 64  # about 0.63 · 0.76 of the trials are kept for large σ
        r = _uniform_below(stream, t, trials)
        keep = stream.uniforms(trials) < np.exp(-r / t)  # e^(−R/t) ≥ e^(−1)
        r = r[keep]
        negative = (stream.words(r.size) & np.uint32(1)).astype(bool)
        magnitude = t * _geometric_counts(stream, r.size) + r
        keep = ~(negative & (magnitude == 0))  # −0 and +0 are one value
        magnitude, negative = magnitude[keep], negative[keep]
        c = (magnitude - shift) ** 2 / two_var
        keep = _exceeds_exponential(stream, c)
        value = np.where(negative, -magnitude, magnitude)[keep]
        take = min(need, value.size)
        out[filled : filled + take] = value[:take]
        filled += take
    return out


def grid_for(*, l2_norm_bound: float, dim: int, fraction: float = 1e-3) -> float:
    """The grid γ: the largest power of two with γ·√d ≤ fraction·S, so that the sensitivity
    after rounding, S + γ√d, is at most S·(1 + fraction)."""
    s = check_positive_finite("l2_norm_bound", l2_norm_bound)
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise InvalidParameterError("dim", dim, "an integer >= 1")
    fraction = check_positive_finite("fraction", fraction)
    return 2.0 ** math.floor(math.log2(fraction * s / math.sqrt(dim)))


def secure_noisy_sum(
    clipped_sum: np.ndarray,
    *,
    ledger: Any,
    l2_norm_bound: float,
    noise_stddev: float,
    stream: ChaCha20Stream,
    grid: float | None = None,
    label: str | None = None,
) -> np.ndarray:
    """Release a clipped sum with discrete Gaussian noise on the grid γℤ (float64).

    Records, in the open step of ``ledger``, one sum query with the sensitivity after rounding
    S + γ√d and σ (write-ahead: flushed before the noisy sum is returned), then returns
    (round(x/γ) + K)·γ with K ~ N_ℤ(0, (σ/γ)²)^d.

    Args:
        clipped_sum: the sum of the contributions, each clipped to L2 norm ≤ S (float64).
        ledger: the ledger whose open step this query belongs to.
        l2_norm_bound: S.
        noise_stddev: σ > 0, the discrete Gaussian's scale (its variance is at most σ²).
        stream: the keystream (:class:`ChaCha20Stream`).
        grid: γ, a power of two; None chooses :func:`grid_for` (S + γ√d ≤ 1.001·S).
        label: the query's label.
    """
    x = np.asarray(clipped_sum, dtype=np.float64)
    d = max(1, x.size)
    s = check_positive_finite("l2_norm_bound", l2_norm_bound)
    sigma = check_positive_finite("noise_stddev", noise_stddev)
    gamma = grid_for(l2_norm_bound=s, dim=d) if grid is None else float(grid)
    mantissa, _ = math.frexp(gamma) if gamma > 0 and math.isfinite(gamma) else (0.0, 0)
    if mantissa != 0.5:
        raise InvalidParameterError("grid", grid, "a positive power of two")
    if not np.isfinite(x).all() or (x.size and float(np.abs(x).max()) / gamma >= 2.0**52):
        raise InvalidParameterError(
            "clipped_sum", "<array>", "finite values below 2**52 grid steps"
        )
    if not isinstance(stream, ChaCha20Stream):
        raise InvalidParameterError("stream", stream, "a ChaCha20Stream")
    ledger.record_sum_query(l2_norm_bound=s + gamma * math.sqrt(d), noise_stddev=sigma, label=label)
    ledger.flush()  # write-ahead: the query reaches the file before its output exists
    return add_on_grid(x, noise_stddev=sigma, grid=gamma, stream=stream)


def add_on_grid(
    x: np.ndarray, *, noise_stddev: float, grid: float, stream: ChaCha20Stream
) -> np.ndarray:
    """(round(x/γ) + K)·γ in float64 with K ~ N_ℤ(0, (σ/γ)²) per coordinate (no recording:
    the caller records the sensitivity after rounding, S + γ√d)."""
    x = np.asarray(x, dtype=np.float64)
    if not np.isfinite(x).all() or (x.size and float(np.abs(x).max()) / grid >= 2.0**52):
        raise InvalidParameterError(
            "clipped_sum", "<array>", "finite values below 2**52 grid steps"
        )
    lattice = np.rint(x / grid).astype(np.int64)
    if noise_stddev == 0.0:
        return lattice.astype(np.float64) * grid
    noise = discrete_gaussian(stream, noise_stddev / grid, x.size).reshape(x.shape)
    return (lattice + noise).astype(np.float64) * grid


class SecureNoiseBackend(NumpyBackend):
    """The NumPy backend with secure noise: every release is rounded to the grid γℤ and gets
    discrete Gaussian noise from a ChaCha20 keystream (:func:`add_on_grid`); the mechanisms
    record each query's sensitivity after rounding, S + γ√d
    (:meth:`sensitivity_after_rounding`), instead of S.

    The ``generator`` the mechanisms pass is ignored: the noise comes from :attr:`stream`.

    Args:
        grid: γ, a power of two (default 2⁻³⁰: S + γ√d exceeds S by 3e-6 at d = 10⁷).
        stream: the keystream; None (the default, and the only choice outside tests) keys a
            new one from the OS.
    """

    name = "numpy-secure"

    def __init__(self, *, grid: float = 2.0**-30, stream: ChaCha20Stream | None = None) -> None:
        mantissa = math.frexp(grid)[0] if isinstance(grid, float) and grid > 0 else 0.0
        if mantissa != 0.5 or not math.isfinite(grid):
            raise InvalidParameterError("grid", grid, "a positive power of two (a float)")
        if stream is not None and not isinstance(stream, ChaCha20Stream):
            raise InvalidParameterError("stream", stream, "a ChaCha20Stream or None")
        self.grid = grid
        self.stream = ChaCha20Stream() if stream is None else stream

    def sensitivity_after_rounding(self, l2_norm_bound: float, shapes: list[Any]) -> float:
        """S + γ√d for a query over arrays of these shapes (d coordinates in all)."""
        d = sum(math.prod(shape) for shape in shapes)
        return float(l2_norm_bound) + self.grid * math.sqrt(max(d, 1))

    def recorded_bound(self, prepared: Any) -> float:
        """The bound the ledger records for a prepared release of the mechanisms
        (``record_releases`` in :mod:`~dpledger.mechanisms.sum_query`): S + γ√d.

        Raises:
            InvalidParameterError: a query with scales ≠ 1 (the grid's extra sensitivity is
                derived here for unscaled groups).
        """
        return recorded_bound(prepared, self.sensitivity_after_rounding)

    def add_gaussian_noise(self, x: Any, *, stddev: float, generator: Any) -> Any:
        """x rounded to the grid plus discrete Gaussian noise of scale ``stddev``, in x's dtype
        (the rounding to float32 of a float32 sum is post-processing)."""
        a = self._array(x)
        out = add_on_grid(a, noise_stddev=float(stddev), grid=self.grid, stream=self.stream)
        return out.astype(a.dtype, copy=False) if a.dtype != np.float64 else out

    def __repr__(self) -> str:
        return f"SecureNoiseBackend(grid={self.grid!r})"


def recorded_bound(prepared: Any, sensitivity_after_rounding: Any) -> float:
    """S + γ√d of a prepared release (its query, its sums' shapes through its backend), by
    ``sensitivity_after_rounding(S, shapes)``; a query with scales ≠ 1 is refused."""
    sigma = prepared.query.noise_stddev
    if any(sd != sigma for sd in prepared.stddevs):
        raise InvalidParameterError(
            "backend",
            prepared.backend,
            "a backend without grid rounding for a query with scales != 1 (the grid's extra "
            "sensitivity is derived for unscaled groups)",
        )
    shapes = [prepared.backend.shape(x) for x in prepared.sums]
    return sensitivity_after_rounding(prepared.query.l2_norm_bound, shapes)
