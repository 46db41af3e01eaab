"""Matrix factorizations of the prefix-sum workload: tree aggregation, banded and BLT strategies.

The matrix mechanism (Li et al. 2015; Denisov et al. 2022; Choquette-Choo et al. 2023) releases
a linear workload A·X of a stream X (row t: the sum of the clipped gradients of step t) through a
factorization A = B·C: it adds Gaussian noise to C·X and multiplies by B,

    B·(C·X + Z) = A·X + B·Z,        Z ~ N(0, σ² I).

For A the prefix sums (lower-triangular ones; SGD's iterates are prefix sums of gradients) and a
square invertible C, B = A·C⁻¹ and the released prefix sums are the prefix sums of
X + C⁻¹·Z: the optimizer adds the noise w_t = (C⁻¹·Z)_t to step t's gradient instead of
independent noise. That is how the streaming generators of :mod:`.noise` work.

Strategies here (float64 throughout):

* **tree aggregation** (Kairouz et al. 2021, DP-FTRL): C has one row per complete dyadic interval
  of [0, T) (one per node of a binary tree), B picks the nodes of the binary decomposition of each
  prefix ("standard") or combines all nodes of each subtree by inverse-variance weights
  ("honaker", Honaker 2015; the online form of Kairouz et al. 2021, appendix);
* **banded Toeplitz** (BandMF; McKenna 2024, "Scaling up the Banded Matrix Factorization
  Mechanism"): C lower-triangular Toeplitz with b bands, coefficients c_0 = 1, c_1, …, c_{b−1};
  :func:`optimize_banded_toeplitz` chooses them to minimise the prefix-sum error;
* **BLT** (buffered linear Toeplitz; Dvijotham et al. 2024): C⁻¹ lower-triangular Toeplitz with
  coefficients 1 and Σ_i ω_i θ_i^{m−1} at lag m ≥ 1, generated with one buffer per (ω_i, θ_i).
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import scipy.optimize
import scipy.signal

from dpledger.errors import InvalidParameterError
from dpledger.validation import MAX_MATRIX_BYTES, check_allocation, check_positive_int

__all__ = [
    "MAX_MATRIX_BYTES",
    "MatrixFactorization",
    "StrategyKind",
    "banded_toeplitz_factorization",
    "blt_factorization",
    "blt_prefix_error",
    "inverse_toeplitz_coefficients",
    "matrix_hash",
    "optimize_banded_toeplitz",
    "optimize_blt",
    "prefix_error",
    "prefix_sum_workload",
    "tree_factorization",
    "tree_nodes",
]

StrategyKind = str
"""One of ``"tree"``, ``"tree_honaker"``, ``"banded_toeplitz"``, ``"blt"``."""

Matrix = npt.NDArray[np.float64]


def _check_size(num_steps: int, rows: int, extra_entries: int = 0) -> None:
    """Refuse, before allocating, factorizations whose dense matrices exceed the budget: C
    (rows × T), B (T × rows), A (T × T) and ``extra_entries`` more, in float64."""
    needed = 8 * (2 * rows * num_steps + num_steps * num_steps + extra_entries)
    suggestion = "a factorization is dense (O(T²) memory): use fewer steps per stream"
    check_allocation("num_steps", num_steps, needed, suggestion)


def _check_vectors(count: int, per_item: int, parameter: str = "num_steps") -> None:
    """Refuse a computation holding ``per_item`` float64 values per step (or per buffer, for
    ``parameter`` ``"omega"`` or ``"buffers"``) of ``count``."""
    item = "step" if parameter == "num_steps" else "buffer"
    advice = f"it holds {per_item} float64 values per {item}: use fewer {item}s"
    check_allocation(parameter, count, 8 * count * per_item, advice)


def prefix_sum_workload(num_steps: int) -> Matrix:
    """A: the T×T lower-triangular matrix of ones (row t sums steps 0..t).

    Raises:
        ComputationBudgetError: A would exceed :data:`MAX_MATRIX_BYTES` (refused before
            allocating).
    """
    t = check_positive_int("num_steps", num_steps)
    _check_size(t, 0)
    return np.tril(np.ones((t, t), dtype=np.float64))


def matrix_hash(strategy: npt.ArrayLike) -> str:
    """SHA-256 (hex) of C: its shape as two little-endian int64 then its float64 entries,
    little-endian, row-major. The ledger records it to name the matrix that was used."""
    c = np.ascontiguousarray(np.asarray(strategy, dtype="<f8"))
    h = hashlib.sha256(np.asarray(c.shape, dtype="<i8").tobytes())
    h.update(c.tobytes())
    return h.hexdigest()


@attrs.frozen(eq=False)
class MatrixFactorization:
    """A factorization A = B·C of the prefix-sum workload, with what identifies it.

    Attributes:
        kind: ``"tree"``, ``"tree_honaker"``, ``"banded_toeplitz"`` or ``"blt"``.
        params: the parameters that determine C and B (JSON-serialisable; the ledger records
            them).
        strategy: C, shape (m, T), float64.
        decoder: B, shape (T, m), float64, with B·C = A (checked on construction).
    """

    kind: str
    params: dict[str, Any]
    strategy: Matrix
    decoder: Matrix

    def __attrs_post_init__(self) -> None:
        c, b = self.strategy, self.decoder
        if c.ndim != 2 or b.shape != (c.shape[1], c.shape[0]):
            raise InvalidParameterError(
                "decoder", f"shape {b.shape}", f"shape (T, m) for C of shape {c.shape}"
            )
        if not (np.all(np.isfinite(c)) and np.all(np.isfinite(b))):
            raise InvalidParameterError("strategy", self.kind, "finite matrices C and B")
        # B·C = A, checked on random vectors (O(m·T) instead of O(m·T²)): B·(C·V) against
        # the prefix sums of V, within the rounding that |B|·(|C|·|V|) bounds
        v = np.random.default_rng(0).standard_normal((c.shape[1], 3))
        err = float(np.max(np.abs(b @ (c @ v) - np.cumsum(v, axis=0))))
        scale = float(np.max(np.abs(b) @ (np.abs(c) @ np.abs(v))))
        if not err <= 1e-9 * max(1.0, scale):
            raise InvalidParameterError(
                "decoder", f"B·C − A off by {err:.3g}", "a factorization B·C = A"
            )

    @property
    def num_steps(self) -> int:
        """T, the length of the stream."""
        return int(self.strategy.shape[1])

    @property
    def strategy_hash(self) -> str:
        """:func:`matrix_hash` of C."""
        return matrix_hash(self.strategy)

    def noise_covariance(self) -> Matrix:
        """B·Bᵀ: the covariance of the prefix-sum noise B·Z per unit noise variance."""
        return self.decoder @ self.decoder.T


def tree_nodes(num_steps: int) -> list[tuple[int, int]]:
    """The complete dyadic intervals [start, start + 2^h) of [0, T), as (level h, start), in
    the order they complete (by their last step; at one step, lower levels first).

    Raises:
        ComputationBudgetError: T so large that the tree's C (one row per node) would exceed
            :data:`MAX_MATRIX_BYTES` (refused before the nodes are listed).
    """
    t = check_positive_int("num_steps", num_steps)
    _check_size(t, 2 * t)  # the nodes are the rows of the tree's C
    nodes = []
    for step in range(t):
        h = 0
        while (step + 1) % (1 << h) == 0:
            nodes.append((h, step + 1 - (1 << h)))
            h += 1
    return nodes


def _decomposition(prefix_len: int) -> list[tuple[int, int]]:
    """The dyadic intervals whose disjoint union is [0, prefix_len), largest first."""
    out, start = [], 0
    for h in range(prefix_len.bit_length() - 1, -1, -1):
        if prefix_len & (1 << h):
            out.append((h, start))
            start += 1 << h
    return out


def _honaker_weights(levels: int) -> list[tuple[float, float]]:
    """(weight of the node's own noisy value, weight of its children's estimate sum) by level.

    The inverse-variance combination: V_0 = 1, V_h = 1 / (1 + 1 / (2 V_{h−1})) (unit noise
    variance), own weight V_h, children's weight V_h / (2 V_{h−1}).
    """
    out, v = [(1.0, 0.0)], 1.0
    for _ in range(1, levels):
        vn = 1.0 / (1.0 + 1.0 / (2.0 * v))
        out.append((vn, vn / (2.0 * v)))
        v = vn
    return out


def tree_factorization(num_steps: int, *, honaker: bool = False) -> MatrixFactorization:
    """Tree aggregation (DP-FTRL; Kairouz et al. 2021) over T steps.

    C has one 0/1 row per node of :func:`tree_nodes` (the node's interval); row t of B sums the
    nodes of the binary decomposition of [0, t] ("standard"), or, with ``honaker=True``, the
    inverse-variance estimates of those nodes built bottom-up from each node and its subtree
    (Honaker 2015), which lowers the variance and keeps B·C = A.

    Args:
        num_steps: T.
        honaker: use the variance-reduced estimator.
    """
    t = check_positive_int("num_steps", num_steps)
    _check_size(t, 2 * t, extra_entries=4 * t * t)  # the node estimates, m × m with m < 2T
    nodes = tree_nodes(t)
    index = {node: i for i, node in enumerate(nodes)}
    m = len(nodes)
    c = _tree_strategy(nodes, t)
    # est[i]: the row vector (over the m node noises) of node i's estimate
    est = np.eye(m)
    if honaker:
        weights = _honaker_weights(t.bit_length() + 1)
        for i, (h, start) in enumerate(nodes):
            if h > 0:
                own, kids = weights[h]
                left = index[(h - 1, start)]
                right = index[(h - 1, start + (1 << (h - 1)))]
                est[i] = own * est[i] + kids * (est[left] + est[right])
    b = np.zeros((t, m))
    for step in range(t):
        for node in _decomposition(step + 1):
            b[step] += est[index[node]]
    kind = "tree_honaker" if honaker else "tree"
    return MatrixFactorization(kind, {"num_steps": t}, c, b)


def _tree_strategy(nodes: list[tuple[int, int]], num_steps: int) -> Matrix:
    """The tree's C: one 0/1 row per node, the node's interval."""
    c = np.zeros((len(nodes), num_steps))
    for i, (h, start) in enumerate(nodes):
        c[i, start : start + (1 << h)] = 1.0
    return c


def _toeplitz(coeffs: Matrix, num_steps: int) -> Matrix:
    col = np.zeros(num_steps)
    n = min(num_steps, coeffs.shape[0])
    col[:n] = coeffs[:n]
    idx = np.subtract.outer(np.arange(num_steps), np.arange(num_steps))
    out = np.where(idx >= 0, col[np.clip(idx, 0, num_steps - 1)], 0.0)
    return np.asarray(out, dtype=np.float64)


def inverse_toeplitz_coefficients(coeffs: Sequence[float] | Matrix, num_steps: int) -> Matrix:
    """The first T coefficients of the inverse of a lower-triangular Toeplitz matrix.

    With c_0 ≠ 0: r_0 = 1 / c_0 and r_m = −(Σ_{i=1}^{min(m, len−1)} c_i r_{m−i}) / c_0 (the
    power series 1 / c(x)).

    Raises:
        InvalidParameterError: ``coeffs`` is not a 1-D finite sequence with c_0 ≠ 0.
        ComputationBudgetError: T so large that the coefficients would exceed
            :data:`MAX_MATRIX_BYTES` (refused before allocating).
    """
    c = np.asarray(coeffs, dtype=np.float64)
    if c.ndim != 1 or c.shape[0] < 1 or not np.all(np.isfinite(c)) or c[0] == 0.0:
        raise InvalidParameterError(
            "coeffs", coeffs, "a 1-D sequence of finite floats with c_0 != 0"
        )
    t = check_positive_int("num_steps", num_steps)
    _check_vectors(t, 3)  # the impulse, the output and the filter's work
    impulse = np.zeros(t)
    impulse[0] = 1.0
    # the recursion above is the IIR filter 1/c(x) applied to an impulse
    return np.asarray(scipy.signal.lfilter([1.0], c[:t], impulse), dtype=np.float64)


def _check_coefficients(coeffs: Sequence[float] | Matrix) -> Matrix:
    c = np.asarray(coeffs, dtype=np.float64)
    if c.ndim != 1 or c.shape[0] < 1 or not np.all(np.isfinite(c)) or c[0] <= 0.0:
        raise InvalidParameterError(
            "coefficients", coeffs, "a 1-D sequence of finite floats with c_0 > 0"
        )
    return c


def banded_toeplitz_factorization(
    num_steps: int, coefficients: Sequence[float] | Matrix
) -> MatrixFactorization:
    """BandMF with a Toeplitz C of b = len(coefficients) bands (C[t, j] = c_{t−j}, 0 ≤ t−j < b).

    Noise for step t needs only the b − 1 previous noise vectors (:class:`.BandedNoise`).

    Args:
        num_steps: T.
        coefficients: c_0 > 0, c_1, …, c_{b−1}.
    """
    t = check_positive_int("num_steps", num_steps)
    c = _check_coefficients(coefficients)
    _check_size(t, t)
    cm = _toeplitz(c, t)
    b = prefix_sum_workload(t) @ _toeplitz(inverse_toeplitz_coefficients(c, t), t)
    params = {"num_steps": t, "coefficients": [float(x) for x in c]}
    return MatrixFactorization("banded_toeplitz", params, cm, b)


def blt_factorization(
    num_steps: int, *, omega: Sequence[float], theta: Sequence[float]
) -> MatrixFactorization:
    """BLT: C⁻¹ Toeplitz with coefficients 1 and Σ_i ω_i θ_i^{m−1} at lag m ≥ 1.

    The noise of step t is z_t + Σ_i ω_i s_i with buffers s_i ← θ_i s_i + z_t: one vector per
    buffer (:class:`.BltNoise`; Dvijotham et al. 2024, "Efficient and Near-Optimal Noise
    Generation for Streaming Differential Privacy").

    Args:
        num_steps: T.
        omega: the buffers' output weights ω_i (finite).
        theta: the buffers' decays θ_i, each in [0, 1).
    """
    t = check_positive_int("num_steps", num_steps)
    w, th = _check_blt(omega, theta)
    _check_size(t, t)
    inv = _blt_inverse_coefficients(w, th, t)
    c = inverse_toeplitz_coefficients(inv, t)
    b = prefix_sum_workload(t) @ _toeplitz(inv, t)
    params = {"num_steps": t, "omega": [float(x) for x in w], "theta": [float(x) for x in th]}
    return MatrixFactorization("blt", params, _toeplitz(c, t), b)


def _check_blt(
    omega: Sequence[float] | Matrix, theta: Sequence[float] | Matrix
) -> tuple[Matrix, Matrix]:
    w = np.asarray(omega, dtype=np.float64)
    th = np.asarray(theta, dtype=np.float64)
    if w.ndim != 1 or w.shape != th.shape or not np.all(np.isfinite(w)):
        raise InvalidParameterError("omega", omega, "a 1-D sequence as long as theta")
    if not np.all((th >= 0.0) & (th < 1.0)):
        raise InvalidParameterError("theta", theta, "decays in [0, 1)")
    return w, th


def prefix_error(coefficients: Sequence[float] | Matrix, num_steps: int) -> float:
    """‖A·C⁻¹‖_F² · max_j ‖C_j‖² for banded Toeplitz C: the total squared error of the T prefix
    sums per unit noise multiplier and participation (the BandMF objective; columns b or more
    apart are orthogonal, so under b-min-sep with k participations the error is k times this).

    With s the prefix sums of C⁻¹'s coefficients, ‖A·C⁻¹‖_F² = Σ_m (T − m) s_m².
    """
    c = _check_coefficients(coefficients)
    _check_vectors(check_positive_int("num_steps", num_steps), 6)
    s = np.cumsum(inverse_toeplitz_coefficients(c, num_steps))
    weights = num_steps - np.arange(num_steps, dtype=np.float64)
    return float(np.dot(weights, s * s) * np.dot(c, c))


@functools.lru_cache(maxsize=32)
def _optimized(num_steps: int, bands: int) -> tuple[float, ...]:
    if bands == 1:
        return (1.0,)

    def objective(x: Matrix) -> float:
        return math.log(prefix_error(np.concatenate([[1.0], x]), num_steps))

    # start: the coefficients of 1/sqrt(1 − x) truncated (the optimal single-epoch Toeplitz
    # factor, Fichtenberger et al. 2023), a good and stable start
    x0 = np.ones(bands)
    for m in range(1, bands):
        x0[m] = x0[m - 1] * (2 * m - 1) / (2 * m)
    res = scipy.optimize.minimize(objective, x0[1:], method="L-BFGS-B")
    best = res.x if objective(res.x) <= objective(x0[1:]) else x0[1:]
    return (1.0, *(float(v) for v in best))


def optimize_banded_toeplitz(*, num_steps: int, bands: int) -> MatrixFactorization:
    """BandMF: the b-banded Toeplitz C minimising :func:`prefix_error`, cached by (T, b).

    The coefficients start from the series of 1/√(1 − x) (optimal among Toeplitz factors for a
    single epoch, Fichtenberger et al. 2023) truncated to b bands and are refined by L-BFGS-B on
    the log of the objective (McKenna 2024, section 4).

    Args:
        num_steps: T.
        bands: b, 1 ≤ b ≤ T (b = 1 is independent noise: DP-SGD).
    """
    t = check_positive_int("num_steps", num_steps)
    b = check_positive_int("bands", bands)
    if b > t:
        raise InvalidParameterError("bands", bands, f"at most num_steps={t}")
    _check_size(t, t)
    return banded_toeplitz_factorization(t, _optimized(t, b))


def _blt_inverse_coefficients(omega: Matrix, theta: Matrix, num_steps: int) -> Matrix:
    """C⁻¹'s Toeplitz coefficients for BLT parameters: 1, then Σ_i ω_i θ_i^{m−1} (a T × buffers
    table, refused before allocating when over the budget)."""
    _check_vectors(num_steps, 5)
    _check_vectors(omega.size, 2 * num_steps + 3, "omega")
    lags = np.arange(num_steps - 1, dtype=np.float64)
    tail = (omega[None, :] * theta[None, :] ** lags[:, None]).sum(axis=1)
    return np.concatenate([[1.0], tail])


def blt_prefix_error(
    *, omega: Sequence[float] | Matrix, theta: Sequence[float] | Matrix, num_steps: int
) -> float:
    """‖A·C⁻¹‖_F² · max_j ‖C_j‖² for a BLT (single participation; C Toeplitz, so its first
    column has the largest norm): the objective :func:`optimize_blt` minimises.

    Raises:
        ComputationBudgetError: T (or T × buffers) so large that the coefficients would exceed
            :data:`MAX_MATRIX_BYTES` (refused before allocating).
    """
    t = check_positive_int("num_steps", num_steps)
    w, th = np.asarray(omega, dtype=np.float64), np.asarray(theta, dtype=np.float64)
    _check_vectors(t, 6)
    inv = _blt_inverse_coefficients(w, th, t)
    c = inverse_toeplitz_coefficients(inv, num_steps)
    s = np.cumsum(inv)
    weights = num_steps - np.arange(num_steps, dtype=np.float64)
    return float(np.dot(weights, s * s) * np.dot(c, c))


_MAX_LOGIT = 30.0
"""Largest |u| of the decays' logistic parametrisation in :func:`optimize_blt` (θ < 1 − 9e-14)."""


@functools.lru_cache(maxsize=32)
def _optimized_blt(num_steps: int, buffers: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    def unpack(x: Matrix) -> tuple[Matrix, Matrix]:
        # θ_i = 1/(1 + e^{−u_i}) keeps every decay in (0, 1) without bounds; u_i is capped at
        # ±30 because for u_i above about 37 the logistic rounds to exactly 1.0 in float64 (a
        # decay of 1 is no BLT), and θ = 1/(1 + e^{−30}) ≈ 1 − 9.4e-14 is as close to 1 as needed
        u = np.clip(x[buffers:], -_MAX_LOGIT, _MAX_LOGIT)
        return x[:buffers], 1.0 / (1.0 + np.exp(-u))

    def objective(x: Matrix) -> float:
        omega, theta = unpack(x)
        if not np.all(np.isfinite(omega)):  # C⁻¹'s coefficients would not be finite
            return 1e300
        value = blt_prefix_error(omega=omega, theta=theta, num_steps=num_steps)
        return math.log(value) if math.isfinite(value) and value > 0 else 1e300

    # a start whose C stays bounded: 1 + Σ_i ω_i x/(1 − θ_i x) is 1/2 at x = 1 (as √(1 − x),
    # the optimal single-epoch factor, vanishes there) and positive on [0, 1]
    theta0 = 1.0 - np.geomspace(0.5, 0.5 / num_steps, buffers)
    x0 = np.concatenate([-(1.0 - theta0) / (2.0 * buffers), np.log(theta0 / (1.0 - theta0))])
    best = x0
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for method in ("L-BFGS-B", "Nelder-Mead"):
            res = scipy.optimize.minimize(
                objective, best, method=method, options={"maxiter": 400 * buffers}
            )
            if objective(res.x) < objective(best):
                best = res.x
    omega, theta = unpack(best)
    return tuple(float(v) for v in omega), tuple(float(v) for v in theta)


def optimize_blt(*, num_steps: int, buffers: int) -> MatrixFactorization:
    """A BLT with ``buffers`` buffers minimising :func:`blt_prefix_error`, cached by (T, buffers).

    The decays start spread geometrically towards 1, with weights −(1 − θ_i)/(2·buffers) that
    keep C bounded; L-BFGS-B, then Nelder-Mead, refine both on the log of the objective, each
    decay a logistic function of a free parameter (Dvijotham et al. 2024 optimise the same kind
    of objective). The
    noise of one step then costs ``buffers`` vector updates (:class:`.BltNoise`).

    Args:
        num_steps: T.
        buffers: the number of buffers, ≥ 1.
    """
    t = check_positive_int("num_steps", num_steps)
    n = check_positive_int("buffers", buffers)
    _check_size(t, t)
    _check_vectors(n, 2 * t + 3, "buffers")  # the T × buffers table of the objective
    omega, theta = _optimized_blt(t, n)
    return blt_factorization(t, omega=omega, theta=theta)
