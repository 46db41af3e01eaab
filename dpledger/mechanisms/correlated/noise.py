"""Streaming correlated noise: the noise w_t added to step t's summed gradient.

Each generator draws the i.i.d. Gaussian noise Z of the matrix mechanism (standard deviation
``noise_stddev`` per coordinate, from a seeded ``numpy.random.Generator``) one step at a time and
returns the noise of that step, so that the prefix sums of the noised gradients are the released
A·X + B·Z of the factorization (:mod:`.strategies`). Memory:

* :class:`TreeNoise`: one vector per tree level, O(d log T) (plus one pending estimate per
  level for the Honaker estimator);
* :class:`BandedNoise`: the b − 1 previous outputs, O(b·d);
* :class:`BltNoise`: one vector per buffer, O(buffers·d).

``state_dict()`` holds the generator's bit-generator state, the step and the buffers (float64
copies): restoring it (``load_state_dict``) continues the stream exactly, for checkpoints.

The buffers grow with d, which the model fixes, so there is no fixed budget: a generator whose
buffers and one step's draws (8 bytes per float) would exceed the machine's physical memory (as
``os.sysconf`` reports it) can never work and is refused before anything is allocated
(``ComputationBudgetError`` naming ``dim``).
"""

from __future__ import annotations

import abc
import copy
import math
import os
from typing import Any

import numpy as np
import numpy.typing as npt

from dpledger.errors import ComputationBudgetError, InvalidParameterError, LedgerStateError
from dpledger.mechanisms.correlated.strategies import (
    MatrixFactorization,
    _decomposition,
    _honaker_weights,
)
from dpledger.validation import FLOAT_INT_MAX, check_non_negative_finite, check_positive_int

__all__ = [
    "BandedNoise",
    "BltNoise",
    "CorrelatedNoise",
    "TreeNoise",
    "noise_for",
]

Vector = npt.NDArray[np.float64]

_MAX_BYTES = 2**63 - 1  # no NumPy array can be larger


def _memory_limit() -> int:
    """The most bytes a noise generator's buffers may take: the machine's physical memory
    (``os.sysconf``), or 2⁶³ − 1 (the most any NumPy array can hold) where it is not known."""
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return _MAX_BYTES
    return min(pages * size, _MAX_BYTES) if pages > 0 and size > 0 else _MAX_BYTES


class CorrelatedNoise(abc.ABC):
    """The noise of one step at a time of a matrix mechanism.

    Args:
        dim: d, the number of coordinates (the flattened parameters).
        noise_stddev: σ, the standard deviation of each entry of Z.
        num_steps: T; a step beyond T is refused.
        seed: seeds ``numpy.random.default_rng``.
        vectors: how many vectors of d float64 values the generator holds at most (its
            buffers and one step's draws), for the memory check.

    Raises:
        ComputationBudgetError: ``vectors`` × d float64 values exceed the machine's physical
            memory (refused before anything is allocated).
    """

    def __init__(
        self, *, dim: int, noise_stddev: float, num_steps: int, seed: int, vectors: int = 2
    ) -> None:
        self.dim = check_positive_int("dim", dim)
        needed, limit = 8 * self.dim * vectors, _memory_limit()
        if needed > limit:  # in integers: any d, even past the float64 range, is refused
            raise ComputationBudgetError(
                parameter="dim",
                value=self.dim,
                estimated_bytes=float(needed) if needed <= FLOAT_INT_MAX else math.inf,
                budget_bytes=float(limit),
                suggestion=(
                    f"the noise generator holds {vectors} vectors of d float64 values, more "
                    "than this machine's physical memory: use fewer parameters (or fewer "
                    "bands or buffers)"
                ),
            )
        self.noise_stddev = check_non_negative_finite("noise_stddev", noise_stddev)
        self.num_steps = check_positive_int("num_steps", num_steps)
        self.rng = np.random.default_rng(seed)
        self.step = 0

    def _draw(self, rows: int = 1) -> npt.NDArray[np.float64]:
        return self.rng.standard_normal((rows, self.dim)) * self.noise_stddev

    def next(self) -> Vector:
        """The noise of the next step (shape (d,), float64)."""
        if self.step >= self.num_steps:
            raise LedgerStateError(
                f"the noise stream has num_steps={self.num_steps} steps; all were drawn"
            )
        out = self._next()
        self.step += 1
        return out

    @abc.abstractmethod
    def _next(self) -> Vector: ...

    @abc.abstractmethod
    def _buffers(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def _set_buffers(self, buffers: dict[str, Any]) -> None: ...

    @staticmethod
    def _restored(buffers: dict[str, Any], key: str, like: Vector) -> Vector:
        """A float64 copy of ``buffers[key]``, refused unless it has the shape of ``like``."""
        value = np.asarray(buffers[key], dtype=np.float64)
        if value.shape != like.shape:
            raise InvalidParameterError("state['buffers']", value.shape, str(like.shape))
        return value.copy()

    def buffer_floats(self) -> int:
        """The number of float64 values held between steps (the generator's memory)."""

        def count(x: Any) -> int:
            if isinstance(x, np.ndarray):
                return int(x.size)
            if isinstance(x, dict):
                return sum(count(v) for v in x.values())
            if isinstance(x, (list, tuple)):
                return sum(count(v) for v in x)
            return 0

        return count(self._buffers())

    def state_dict(self) -> dict[str, Any]:
        """A deep copy of the state: ``rng`` (bit-generator state), ``step``, ``buffers``."""
        return {
            "rng": copy.deepcopy(self.rng.bit_generator.state),
            "step": self.step,
            "buffers": copy.deepcopy(self._buffers()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream from ``state`` (from :meth:`state_dict` of the same generator).

        A state that is refused leaves the generator as it was.
        """
        try:
            rng = copy.deepcopy(state["rng"])
            step = int(state["step"])
            buffers = copy.deepcopy(state["buffers"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidParameterError("state", type(state).__name__, "a state_dict()") from exc
        if not 0 <= step <= self.num_steps:
            raise InvalidParameterError("state['step']", step, f"0..{self.num_steps}")
        saved = self.state_dict()
        try:
            self._set_buffers(buffers)
            self.rng.bit_generator.state = rng
        except Exception as exc:
            self._set_buffers(saved["buffers"])
            self.rng.bit_generator.state = saved["rng"]
            if isinstance(exc, InvalidParameterError):
                raise
            raise InvalidParameterError("state", type(state).__name__, "a state_dict()") from exc
        self.step = step


class BandedNoise(CorrelatedNoise):
    """w = C⁻¹·Z for a lower-triangular C with b bands, by forward substitution:

        w_t = (z_t − Σ_{j=t−b+1}^{t−1} C[t, j] w_j) / C[t, t].

    Only the last b − 1 outputs are kept (a ring of b − 1 vectors of d floats), besides the
    T·b band coefficients of C, which do not grow with d.

    Args:
        factorization: a factorization whose C is lower-triangular with at most ``bands``
            bands (checked).
        bands: b.
        dim: d, the number of coordinates of each step's noise (as :class:`CorrelatedNoise`).
        noise_stddev: σ, the standard deviation of the Gaussian entries of Z (as
            :class:`CorrelatedNoise`).
        seed: the noise generator's seed (as :class:`CorrelatedNoise`).
    """

    def __init__(
        self,
        factorization: MatrixFactorization,
        *,
        bands: int,
        dim: int,
        noise_stddev: float,
        seed: int,
    ) -> None:
        c = factorization.strategy
        t = factorization.num_steps
        b = check_positive_int("bands", bands)
        if b > t:  # the ring holds b − 1 vectors of d floats: never more bands than steps
            raise InvalidParameterError("bands", bands, f"at most num_steps={t}")
        offsets = np.subtract.outer(np.arange(c.shape[0]), np.arange(t))
        if c.shape != (t, t) or np.any(c[(offsets < 0) | (offsets >= b)] != 0.0):
            raise InvalidParameterError(
                "factorization", factorization.kind, f"a lower-triangular C with {b} bands"
            )
        if np.any(np.diag(c) <= 0.0):
            raise InvalidParameterError("factorization", factorization.kind, "C[t, t] > 0")
        # the ring of b − 1 outputs, one step's draw and its copy
        super().__init__(dim=dim, noise_stddev=noise_stddev, num_steps=t, seed=seed, vectors=b + 1)
        self.bands = b
        # only the bands are kept: band[t, l] = C[t, t − l]
        self._band = np.zeros((t, b))
        for lag in range(b):
            self._band[lag:, lag] = np.diagonal(c, -lag)
        self._ring = np.zeros((max(b - 1, 0), self.dim))

    def _next(self) -> Vector:
        t, b = self.step, self.bands
        w = self._draw()[0]
        for lag in range(1, min(b, t + 1)):
            w -= self._band[t, lag] * self._ring[(t - lag) % (b - 1)]
        w /= self._band[t, 0]
        if b > 1:
            self._ring[t % (b - 1)] = w
        return w.copy()

    def _buffers(self) -> dict[str, Any]:
        return {"ring": self._ring}

    def _set_buffers(self, buffers: dict[str, Any]) -> None:
        self._ring = self._restored(buffers, "ring", self._ring)


class BltNoise(CorrelatedNoise):
    """BLT noise: w_t = z_t + Σ_i ω_i s_i, then s_i ← θ_i s_i + z_t (one buffer per i).

    Equal to C⁻¹·Z for :func:`~.strategies.blt_factorization` with the same ω, θ.
    """

    def __init__(
        self,
        factorization: MatrixFactorization,
        *,
        dim: int,
        noise_stddev: float,
        seed: int,
    ) -> None:
        if factorization.kind != "blt":
            raise InvalidParameterError("factorization", factorization.kind, "a 'blt' one")
        buffers = len(factorization.params["omega"])
        super().__init__(  # the buffers, their update's temporary, the draw, the output
            dim=dim,
            noise_stddev=noise_stddev,
            num_steps=factorization.num_steps,
            seed=seed,
            vectors=2 * buffers + 3,
        )
        self._omega = np.asarray(factorization.params["omega"], dtype=np.float64)
        self._theta = np.asarray(factorization.params["theta"], dtype=np.float64)
        self._state = np.zeros((self._omega.shape[0], self.dim))

    def _next(self) -> Vector:
        z = self._draw()[0]
        w = z + self._omega @ self._state
        self._state = self._theta[:, None] * self._state + z[None, :]
        return np.asarray(w, dtype=np.float64)

    def _buffers(self) -> dict[str, Any]:
        return {"state": self._state}

    def _set_buffers(self, buffers: dict[str, Any]) -> None:
        self._state = self._restored(buffers, "state", self._state)


class TreeNoise(CorrelatedNoise):
    """Tree-aggregation noise: w_t = p_t − p_{t−1}, p_t the noise of prefix [0, t] (B·Z)_t.

    The node noises are drawn when their interval completes (the order of
    :func:`~.strategies.tree_nodes`); only the nodes of the current binary decomposition (and,
    for Honaker, the last completed estimate per level) are kept.
    """

    def __init__(
        self,
        factorization: MatrixFactorization,
        *,
        dim: int,
        noise_stddev: float,
        seed: int,
    ) -> None:
        if factorization.kind not in ("tree", "tree_honaker"):
            raise InvalidParameterError("factorization", factorization.kind, "a tree")
        t = factorization.num_steps
        honaker = factorization.kind == "tree_honaker"
        # one estimate per level (three with Honaker's pending pairs), the prefixes, the draw
        levels = (t.bit_length() + 1) * (3 if honaker else 1)
        super().__init__(
            dim=dim, noise_stddev=noise_stddev, num_steps=t, seed=seed, vectors=levels + 4
        )
        self.honaker = honaker
        self._weights = _honaker_weights(t.bit_length() + 1)
        self._levels: dict[int, Vector] = {}  # level -> last completed node estimate
        self._pend: dict[int, list[Vector]] = {}  # level -> its last two estimates (Honaker)
        self._prefix = np.zeros(self.dim)

    def _next(self) -> Vector:
        t = self.step
        h = 0
        while (t + 1) % (1 << h) == 0:
            z = self._draw()[0]
            if h > 0 and self.honaker:
                own, kids = self._weights[h]
                z = own * z + kids * (self._pend[h - 1][0] + self._pend[h - 1][1])
            self._store(h, z)
            h += 1
        prefix = np.zeros(self.dim)
        for level, _ in _decomposition(t + 1):
            prefix += self._levels[level]
        w = prefix - self._prefix
        self._prefix = prefix
        return w

    def _store(self, level: int, estimate: Vector) -> None:
        if self.honaker:
            pend = self._pend.setdefault(level, [])
            if len(pend) == 2:
                pend.clear()
            pend.append(estimate)
        self._levels[level] = estimate

    def _buffers(self) -> dict[str, Any]:
        out: dict[str, Any] = {"prefix": self._prefix}
        out["levels"] = {str(k): v for k, v in self._levels.items()}
        if self.honaker:
            out["pending"] = {str(k): list(v) for k, v in self._pend.items()}
        return out

    def _set_buffers(self, buffers: dict[str, Any]) -> None:
        self._prefix = self._restored(buffers, "prefix", self._prefix)
        self._levels = {
            int(k): np.asarray(v, dtype=np.float64) for k, v in buffers["levels"].items()
        }
        self._pend = {
            int(k): [np.asarray(x, dtype=np.float64) for x in v]
            for k, v in buffers.get("pending", {}).items()
        }


def noise_for(
    factorization: MatrixFactorization,
    *,
    dim: int,
    noise_stddev: float,
    seed: int,
    bands: int | None = None,
) -> CorrelatedNoise:
    """The streaming generator of a factorization (tree, banded Toeplitz or BLT).

    Raises:
        ComputationBudgetError: the generator's buffers for ``dim`` coordinates would exceed the
            machine's physical memory (refused before allocating; module docstring).
        InvalidParameterError: an unknown kind, or ``bands`` beyond the factorization's T.
    """
    if factorization.kind in ("tree", "tree_honaker"):
        return TreeNoise(factorization, dim=dim, noise_stddev=noise_stddev, seed=seed)
    if factorization.kind == "blt":
        return BltNoise(factorization, dim=dim, noise_stddev=noise_stddev, seed=seed)
    if factorization.kind == "banded_toeplitz":
        b = len(factorization.params["coefficients"]) if bands is None else bands
        return BandedNoise(factorization, bands=b, dim=dim, noise_stddev=noise_stddev, seed=seed)
    raise InvalidParameterError("factorization", factorization.kind, "tree, banded or blt")
