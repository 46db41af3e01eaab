"""The array operations the mechanisms need, as a small protocol, with a NumPy implementation.

Every mechanism in :mod:`dpledger.mechanisms` touches arrays only through an :class:`ArrayBackend`,
so the same mechanism code runs on NumPy arrays (:class:`NumpyBackend`, here) and on PyTorch or
TensorFlow tensors (the adapters implement the protocol on their tensors, on the device where
the tensors live). A *records array* has the records along its leading axis: shape ``(B, ...)``
for B records, each record an array of shape ``(...)``.

Division of labour. The backend does the work that scales with the size of the arrays (norms,
scaling, sums, noise), on the arrays' device. Everything per record that is small — group norms,
clip factors, validation — is done by the mechanisms in float64 NumPy on the host, so it is
identical on every backend; the backend converts such per-record vectors with
:meth:`~ArrayBackend.to_host` and accepts them back as ``factors`` (a float64 NumPy vector).

Precision contract (what an implementation must do):

- Norms (:meth:`~ArrayBackend.record_norms`, :meth:`~ArrayBackend.norm`) are accumulated in
  float64, whatever the array's dtype. A norm that overflows float64 although every element is
  finite should be recomputed with scaling (the NumPy backend does); an implementation that
  cannot may return ``inf``, which the mechanisms reject with an error (safe, never silent).
- Factors are converted to the array's dtype before multiplying. A converted factor below the
  smallest normal number of that dtype is treated as 0 (the record contributes nothing), because
  a subnormal factor has too few significant bits to scale a record to within its bound.
- Noise is drawn in float64 (standard normals times the float64 standard deviation), added to
  the float64 value of the sum, and the result is rounded once to the sum's dtype. Frameworks
  usually draw float32 noise for float32 parameters; we draw in float64 so that the distribution
  added is N(0, σ̃²) for the exact σ̃ recorded in the ledger, and the only rounding is of the
  released value, which is post-processing. The cost is one float64 temporary the size of the
  sum, once per query per step.

Batched operations (optional). A backend may also implement ``norms(xs)`` (the float64 norms of
several arrays as one float64 NumPy vector, read back from the device at once),
``add_gaussian_noise_many(xs, *, stddevs, generator)`` (noise for several arrays, drawn in one
call over their concatenation) and ``scale_many(xs, factor)``, with the same precision contract
as their single-array versions. The mechanisms call them through :func:`array_norms`,
:func:`add_noise_to_all` and :func:`scale_all`, which fall back to one call per array for a
backend without them. On an accelerator this makes a release of several arrays one host
synchronisation and one random draw instead of one per array. The noise of a batched draw is
N(0, σ̃_j² I) on every array j all the same; only which standard normal lands on which
coordinate differs from drawing array by array.

Releases on summaries. A release (the sensitivity check, the events, the noise standard
deviations) needs only the float64 norms, shapes and dtypes of the clipped sums, not the sums:
:class:`SummaryBackend` runs the mechanisms' release on the host over :class:`SumSummary` values
while the sums stay on the device, and answers each noise draw with a :class:`NoiseOrder` that
the caller carries out on the device (the TensorFlow adapter's graph does).

Randomness: ``generator`` is the backend's own generator type (``numpy.random.Generator`` here).
Note that general-purpose PRNGs are not cryptographically secure; seed from OS entropy in
deployment, and use a fixed seed only for tests and reproducible experiments.
"""

from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable

import numpy as np

from dpledger.errors import InvalidParameterError

__all__ = [
    "Array",
    "ArrayBackend",
    "NoiseOrder",
    "NumpyBackend",
    "SumSummary",
    "SummaryBackend",
    "add_noise_to_all",
    "array_norms",
    "resolve_backend",
    "scale_all",
]

Array = Any
"""A backend's array type (``numpy.ndarray``, ``torch.Tensor``, ``tf.Tensor``, …)."""


@runtime_checkable
class ArrayBackend(Protocol):
    """The operations the mechanisms perform on arrays.

    ``x`` is always a backend array; *records arrays* have the records on the leading axis.
    ``factors`` is a 1-D float64 ``numpy.ndarray`` with one entry per record. Implementations
    must not modify their inputs.
    """

    name: str
    """A short name for messages, e.g. ``"numpy"``."""

    def shape(self, x: Array) -> tuple[int, ...]:
        """The shape of ``x`` as a tuple of ints."""
        ...

    def float_info(self, x: Array) -> tuple[float, float]:
        """``(eps, tiny)`` of the floating dtype ``x`` is computed in.

        ``eps`` is the machine epsilon, ``tiny`` the smallest positive normal number (as in
        ``numpy.finfo``). Integer arrays are computed in the backend's default float dtype.
        """
        ...

    def record_norms(self, x: Array) -> np.ndarray:
        """Per-record L2 norms ‖x_i‖₂ over all but the leading axis, accumulated in float64.

        Returns a float64 NumPy vector of length B on the host. A record containing NaN has
        norm NaN; one containing ±inf has norm inf.
        """
        ...

    def norm(self, x: Array) -> float:
        """The L2 norm of all elements of ``x``, accumulated in float64, as a Python float."""
        ...

    def weighted_sum(self, x: Array, factors: np.ndarray) -> Array:
        """Σ_i f_i·x_i over the leading axis, in x's dtype and on x's device.

        Factors are first converted to x's dtype; a converted factor below that dtype's
        smallest normal number counts as 0. With B = 0 the result is zeros of shape x.shape[1:].
        """
        ...

    def scale_records(self, x: Array, factors: np.ndarray) -> Array:
        """The records array (f_i·x_i)_i, same shape, dtype and device as x (same rule for f)."""
        ...

    def scale(self, x: Array, factor: float) -> Array:
        """c·x for a Python float c, in x's dtype and on x's device."""
        ...

    def add_gaussian_noise(self, x: Array, *, stddev: float, generator: Any) -> Array:
        """x + N(0, stddev² I) with noise drawn from ``generator`` (see the module docstring).

        Noise is drawn in float64 and added in float64; the result is rounded once to x's
        dtype and placed on x's device. ``x`` itself is not modified.
        """
        ...

    def to_host(self, x: Array) -> np.ndarray:
        """A float64 NumPy copy of a (small) array."""
        ...

    def from_host(self, values: np.ndarray, *, like: Array | None) -> Array:
        """A backend array holding ``values``, with the dtype and device of ``like``.

        With ``like=None`` the backend's default float dtype and device are used.
        """
        ...


class NumpyBackend:
    """:class:`ArrayBackend` for NumPy arrays; ``generator`` is a ``numpy.random.Generator``.

    Integer and boolean arrays are computed in float64. Norms overflow-safe: rows whose float64
    sum of squares overflows are recomputed as m·‖x/m‖ with m = max|x_i|.
    """

    name = "numpy"

    @staticmethod
    def _array(x: Array) -> np.ndarray:
        a = np.asarray(x)
        if not np.issubdtype(a.dtype, np.floating):
            if a.dtype == object or not (
                np.issubdtype(a.dtype, np.integer) or np.issubdtype(a.dtype, np.bool_)
            ):
                raise InvalidParameterError("x", type(x).__name__, "a real numeric array")
            a = a.astype(np.float64)
        return a

    def shape(self, x: Array) -> tuple[int, ...]:
        """See :meth:`ArrayBackend.shape`."""
        return tuple(int(s) for s in np.shape(x))

    def float_info(self, x: Array) -> tuple[float, float]:
        """See :meth:`ArrayBackend.float_info`."""
        info = np.finfo(self._array(x).dtype)
        return float(info.eps), float(info.tiny)

    @staticmethod
    def _rows_norms(rows: np.ndarray) -> np.ndarray:
        # rows: 2-D (B, d). Fast path: float64 sum of squares; rescue overflowed rows.
        if rows.shape[1] == 0:
            return np.zeros(rows.shape[0], dtype=np.float64)
        squares = np.einsum("ij,ij->i", rows, rows, dtype=np.float64)
        out = np.sqrt(squares)
        bad = ~np.isfinite(out)
        if bad.any():
            for i in np.flatnonzero(bad):
                row = rows[i].astype(np.float64)
                m = float(np.max(np.abs(row)))  # NaN if any element is NaN, inf if one is inf
                if not math.isfinite(m):
                    out[i] = m
                    continue
                scaled = row / m
                out[i] = m * math.sqrt(float(np.dot(scaled, scaled)))
        return out

    def record_norms(self, x: Array) -> np.ndarray:
        """See :meth:`ArrayBackend.record_norms`."""
        a = self._array(x)
        if a.ndim == 0:
            raise InvalidParameterError(
                "x", "a 0-d array", "an array with the records on its leading axis"
            )
        return self._rows_norms(a.reshape(a.shape[0], math.prod(a.shape[1:])))

    def norm(self, x: Array) -> float:
        """See :meth:`ArrayBackend.norm`."""
        a = self._array(x)
        return float(self._rows_norms(a.reshape(1, -1))[0])

    def _factors(self, a: np.ndarray, factors: np.ndarray) -> np.ndarray:
        f = np.asarray(factors, dtype=np.float64).astype(a.dtype)
        f[f < np.finfo(a.dtype).tiny] = 0  # subnormal factors cannot scale accurately
        return f

    def weighted_sum(self, x: Array, factors: np.ndarray) -> Array:
        """See :meth:`ArrayBackend.weighted_sum`."""
        a = self._array(x)
        f = self._factors(a, factors)
        return np.tensordot(f, a, axes=(0, 0))

    def scale_records(self, x: Array, factors: np.ndarray) -> Array:
        """See :meth:`ArrayBackend.scale_records`."""
        a = self._array(x)
        f = self._factors(a, factors)
        return a * f.reshape((a.shape[0],) + (1,) * (a.ndim - 1))

    def scale(self, x: Array, factor: float) -> Array:
        """See :meth:`ArrayBackend.scale`."""
        a = self._array(x)
        return np.asarray(a * a.dtype.type(factor))

    def add_gaussian_noise(self, x: Array, *, stddev: float, generator: Any) -> Array:
        """See :meth:`ArrayBackend.add_gaussian_noise`."""
        if not isinstance(generator, np.random.Generator):
            raise InvalidParameterError(
                "generator", generator, "a numpy.random.Generator (e.g. numpy.random.default_rng())"
            )
        a = self._array(x)
        noise = generator.standard_normal(size=a.shape)  # float64
        noise *= stddev
        noise += a  # float64 addition (a is upcast)
        return noise.astype(a.dtype, copy=False) if a.dtype != np.float64 else noise

    def to_host(self, x: Array) -> np.ndarray:
        """See :meth:`ArrayBackend.to_host`."""
        return np.array(x, dtype=np.float64)

    def from_host(self, values: np.ndarray, *, like: Array | None) -> Array:
        """See :meth:`ArrayBackend.from_host`."""
        dtype = np.float64 if like is None else self._array(like).dtype
        return np.array(values, dtype=dtype)

    def __repr__(self) -> str:
        return "NumpyBackend()"


_NUMPY = NumpyBackend()


def resolve_backend(backend: ArrayBackend | None) -> ArrayBackend:
    """``backend``, or the NumPy backend for None; anything else is an error naming ``backend``."""
    if backend is None:
        return _NUMPY
    kind = type(backend)
    if kind in _CHECKED_BACKEND_TYPES:  # a runtime Protocol check costs microseconds per call
        return backend
    if not isinstance(backend, ArrayBackend):
        raise InvalidParameterError(
            "backend", backend, "an ArrayBackend (e.g. dpledger.mechanisms.backend.NumpyBackend())"
        )
    _CHECKED_BACKEND_TYPES.add(kind)
    return backend


# Classes whose instances passed the protocol check. A class's methods are fixed for its
# instances in practice; an instance that deletes or replaces a method is not supported.
_CHECKED_BACKEND_TYPES: set[type] = set()


def array_norms(backend: ArrayBackend, xs: list[Array]) -> np.ndarray:
    """The float64 L2 norms of ``xs`` as a NumPy vector (the backend's batched ``norms`` if it
    has one: on a device, one read-back for all of them)."""
    batched = getattr(backend, "norms", None)
    if batched is not None:
        return np.asarray(batched(xs), dtype=np.float64)
    return np.array([backend.norm(x) for x in xs], dtype=np.float64)


def add_noise_to_all(
    backend: ArrayBackend, xs: list[Array], *, stddevs: list[float], generator: Any
) -> list[Array]:
    """x_j + N(0, σ_j² I) for every array, as :meth:`ArrayBackend.add_gaussian_noise` (the
    backend's batched ``add_gaussian_noise_many`` if it has one: one draw for all arrays)."""
    batched = getattr(backend, "add_gaussian_noise_many", None)
    if batched is not None:
        return list(batched(xs, stddevs=stddevs, generator=generator))
    return [
        backend.add_gaussian_noise(x, stddev=sd, generator=generator)
        for x, sd in zip(xs, stddevs, strict=True)
    ]


def scale_all(backend: ArrayBackend, xs: list[Array], factor: float) -> list[Array]:
    """c·x for every array (the backend's batched ``scale_many`` if it has one)."""
    batched = getattr(backend, "scale_many", None)
    if batched is not None:
        return list(batched(xs, factor))
    return [backend.scale(x, factor) for x in xs]


class SumSummary:
    """What a release needs of a clipped sum: its float64 norm, its shape, its dtype's eps and
    tiny."""

    __slots__ = ("eps", "norm", "shape", "tiny")

    def __init__(self, *, norm: float, shape: tuple[int, ...], eps: float, tiny: float) -> None:
        self.norm, self.shape, self.eps, self.tiny = norm, shape, eps, tiny


class NoiseOrder:
    """A release's request: add N(0, stddev² I) to this sum (carried out on the device)."""

    __slots__ = ("stddev", "summary")

    def __init__(self, summary: SumSummary, stddev: float) -> None:
        self.summary, self.stddev = summary, float(stddev)


class SummaryBackend:
    """An :class:`ArrayBackend` over :class:`SumSummary` values.

    It lets the mechanisms' release validate, sensitivity-check and record a step whose sums
    stay on the device: the noise draw is returned as a :class:`NoiseOrder`, which the caller
    executes with its own backend. Operations on records or arrays are not part of a release
    and raise ``NotImplementedError``.
    """

    name = "host-summary"

    def shape(self, x: Any) -> tuple[int, ...]:
        return tuple(x.shape)

    def float_info(self, x: Any) -> tuple[float, float]:
        return x.eps, x.tiny

    def record_norms(self, x: Any) -> np.ndarray:
        raise NotImplementedError("a release on summaries has no records")  # pragma: no cover

    def norm(self, x: Any) -> float:
        return float(x.norm)

    def weighted_sum(self, x: Any, factors: np.ndarray) -> Any:
        raise NotImplementedError("a release on summaries has no records")  # pragma: no cover

    def scale_records(self, x: Any, factors: np.ndarray) -> Any:
        raise NotImplementedError("a release on summaries has no records")  # pragma: no cover

    def scale(self, x: Any, factor: float) -> Any:
        raise NotImplementedError("averaging happens on the device")  # pragma: no cover

    def add_gaussian_noise(self, x: Any, *, stddev: float, generator: Any) -> Any:
        return NoiseOrder(x, stddev)

    def to_host(self, x: Any) -> np.ndarray:
        raise NotImplementedError("a release on summaries has no arrays")  # pragma: no cover

    def from_host(self, values: np.ndarray, *, like: Any | None) -> Any:
        raise NotImplementedError("a release on summaries has no arrays")  # pragma: no cover
