"""The mechanisms' :class:`~dpledger.mechanisms.ArrayBackend` on TensorFlow tensors.

With :class:`TensorFlowBackend` the framework-neutral mechanisms (Gaussian sum queries, grouped
queries, averaging, clipping of materialised records) run unchanged on ``tf.Tensor`` values, on
the device where the tensors live. The precision contract is the one stated in
:mod:`dpledger.mechanisms.backend`:

- norms are accumulated in float64 (squares of float32 values are exact in float64);
- per-record factors arrive as float64 NumPy vectors, are converted to the tensor's dtype, and a
  converted factor below that dtype's smallest normal number counts as 0;
- Gaussian noise is drawn in float64 from a ``tf.random.Generator`` (Philox, counter based), added
  to the float64 value of the sum, and the result is rounded once to the sum's dtype. The draw
  is placed on the sum's device (``tf.device(x.device)``), so noise for parameters on a GPU is
  generated there; the generator's small state variable is read from wherever it was created.

Every method except :meth:`~TensorFlowBackend.record_norms`, :meth:`~TensorFlowBackend.norm` and
:meth:`~TensorFlowBackend.to_host` (which return host values by definition) is made of TensorFlow
ops only, so it can also be used inside a ``tf.function``; there ``stddev`` may be a scalar
tensor computed in the graph.

Randomness: :func:`make_generator` creates the Philox generator from a seed (or from OS entropy
when the seed is None). Philox is not a cryptographically secure generator: seed from OS entropy
in deployment and use fixed seeds only for tests and reproducible experiments.
"""

from __future__ import annotations

import math
import secrets
from typing import Any

import numpy as np
import tensorflow as tf

from dpledger.errors import InvalidParameterError

__all__ = ["TensorFlowBackend", "make_generator"]


def make_generator(seed: int | None = None) -> tf.random.Generator:
    """A Philox ``tf.random.Generator`` seeded with ``seed`` (OS entropy when None).

    Raises:
        InvalidParameterError: for a seed that is not a non-negative integer or None.
    """
    if seed is None:
        seed = secrets.randbits(63)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise InvalidParameterError("seed", seed, "a non-negative integer or None")
    return tf.random.Generator.from_seed(int(seed), alg="philox")


def _tensor(x: Any) -> tf.Tensor:
    if isinstance(x, tf.Variable):
        return tf.convert_to_tensor(x)
    if tf.is_tensor(x):
        return x
    value = getattr(x, "value", None)  # a Keras variable
    if isinstance(value, tf.Variable):
        return tf.convert_to_tensor(value)
    try:
        return tf.convert_to_tensor(x)
    except (TypeError, ValueError):
        raise InvalidParameterError("x", type(x).__name__, "a tf.Tensor or array-like") from None


def _floating(t: tf.Tensor) -> tf.Tensor:
    if t.dtype.is_floating:
        return t
    if t.dtype.is_integer or t.dtype == tf.bool:
        return tf.cast(t, tf.float64)
    raise InvalidParameterError("x", f"a tensor of dtype {t.dtype.name}", "a real numeric tensor")


class TensorFlowBackend:
    """:class:`~dpledger.mechanisms.ArrayBackend` for ``tf.Tensor`` (and ``tf.Variable``) values.

    ``generator`` in :meth:`add_gaussian_noise` is a ``tf.random.Generator`` (see
    :func:`make_generator`). Integer and boolean tensors are computed in float64.

    Example:
        >>> from dpledger import PrivacyLedger
        >>> from dpledger.mechanisms import GaussianSumQuery, sampled_step
        >>> backend, ledger = TensorFlowBackend(), PrivacyLedger()
        >>> query = GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=1.1)
        >>> with sampled_step(ledger, sampling_probability=0.01, population_size=10_000,
        ...                   generator=make_generator(0), backend=backend) as step:
        ...     (noised,) = step.run(query, tf.ones([97, 4]))
        >>> noised.dtype.name
        'float32'
    """

    name = "tensorflow"

    def shape(self, x: Any) -> tuple[int, ...]:
        """See :meth:`ArrayBackend.shape`; every dimension must be known."""
        t = _tensor(x)
        if not t.shape.is_fully_defined():
            return tuple(int(d) for d in tf.shape(t).numpy())
        return tuple(int(d) for d in t.shape)

    def float_info(self, x: Any) -> tuple[float, float]:
        """See :meth:`ArrayBackend.float_info`."""
        dtype = _floating(_tensor(x)).dtype
        info = np.finfo(dtype.as_numpy_dtype)
        return float(info.eps), float(info.tiny)

    @staticmethod
    def _squared_rows(t: tf.Tensor) -> tf.Tensor:
        rows = tf.reshape(tf.cast(t, tf.float64), [tf.shape(t)[0], -1])
        return tf.reduce_sum(tf.square(rows), axis=1)

    def record_norms(self, x: Any) -> np.ndarray:
        """See :meth:`ArrayBackend.record_norms`; float64 accumulation, rescued on overflow."""
        t = _floating(_tensor(x))
        if t.shape.rank == 0:
            raise InvalidParameterError(
                "x", "a 0-d tensor", "a tensor with the records on its leading axis"
            )
        out = np.sqrt(self._squared_rows(t).numpy())
        bad = ~np.isfinite(out)
        for i in np.flatnonzero(bad):  # overflow of the float64 sum, or a NaN/inf element
            row = tf.reshape(tf.cast(t[int(i)], tf.float64), [-1]).numpy()
            m = float(np.max(np.abs(row))) if row.size else 0.0
            if not math.isfinite(m) or m == 0.0:
                out[i] = m
                continue
            scaled = row / m
            out[i] = m * math.sqrt(float(np.dot(scaled, scaled)))
        return out

    def norm(self, x: Any) -> float:
        """See :meth:`ArrayBackend.norm`."""
        t = _floating(_tensor(x))
        return float(self.record_norms(tf.reshape(t, [1, -1]))[0])

    @staticmethod
    def _factors(t: tf.Tensor, factors: Any) -> tf.Tensor:
        with tf.device(t.device or None):
            f = tf.cast(tf.convert_to_tensor(factors, dtype=tf.float64), t.dtype)
            tiny = np.finfo(t.dtype.as_numpy_dtype).tiny
            return tf.where(f < tiny, tf.zeros_like(f), f)

    def weighted_sum(self, x: Any, factors: Any) -> tf.Tensor:
        """See :meth:`ArrayBackend.weighted_sum`."""
        t = _floating(_tensor(x))
        f = self._factors(t, factors)
        with tf.device(t.device or None):
            return tf.tensordot(f, t, axes=[[0], [0]])

    def scale_records(self, x: Any, factors: Any) -> tf.Tensor:
        """See :meth:`ArrayBackend.scale_records`."""
        t = _floating(_tensor(x))
        f = self._factors(t, factors)
        with tf.device(t.device or None):
            shape = tf.concat([tf.shape(f), tf.ones([t.shape.rank - 1], tf.int32)], axis=0)
            return t * tf.reshape(f, shape)

    def scale(self, x: Any, factor: Any) -> tf.Tensor:
        """See :meth:`ArrayBackend.scale` (``factor`` may also be a scalar tensor)."""
        t = _floating(_tensor(x))
        with tf.device(t.device or None):
            if tf.is_tensor(factor):
                return t * tf.cast(factor, t.dtype)
            return t * tf.constant(float(factor), t.dtype)

    def add_gaussian_noise(self, x: Any, *, stddev: Any, generator: Any) -> tf.Tensor:
        """See :meth:`ArrayBackend.add_gaussian_noise`: x + N(0, stddev² I), drawn in float64
        on x's device and rounded once to x's dtype.

        Args:
            x: the sum.
            stddev: σ ≥ 0, a Python float or a scalar float64 tensor (inside a graph).
            generator: a ``tf.random.Generator``.
        """
        return self.add_scaled_noise(x, self.standard_normal(x, generator=generator), stddev=stddev)

    def standard_normal(self, x: Any, *, generator: Any) -> tf.Tensor:
        """float64 N(0, I) draws of x's shape on x's device (the first half of
        :meth:`add_gaussian_noise`, so a graph can draw before the standard deviation is known).
        """
        if not isinstance(generator, tf.random.Generator):
            raise InvalidParameterError(
                "generator",
                generator,
                "a tf.random.Generator "
                "(e.g. dpledger.adapters.tensorflow.backend.make_generator(seed))",
            )
        t = _floating(_tensor(x))
        with tf.device(t.device or None):
            return generator.normal(tf.shape(t), dtype=tf.float64)

    def add_scaled_noise(self, x: Any, noise: tf.Tensor, *, stddev: Any) -> tf.Tensor:
        """x + stddev·noise computed in float64 and rounded once to x's dtype (the second half
        of :meth:`add_gaussian_noise`)."""
        t = _floating(_tensor(x))
        with tf.device(t.device or None):
            # A Python float goes to float64 directly (tf.cast would round it to float32 first).
            if tf.is_tensor(stddev):
                sd = tf.cast(stddev, tf.float64)
            else:
                sd = tf.constant(float(stddev), tf.float64)
            value = tf.cast(t, tf.float64) + noise * sd
            return value if t.dtype == tf.float64 else tf.cast(value, t.dtype)

    def to_host(self, x: Any) -> np.ndarray:
        """See :meth:`ArrayBackend.to_host`."""
        return np.array(tf.cast(_tensor(x), tf.float64).numpy(), dtype=np.float64)

    def from_host(self, values: np.ndarray, *, like: Any | None) -> tf.Tensor:
        """See :meth:`ArrayBackend.from_host`."""
        if like is None:
            return tf.convert_to_tensor(np.asarray(values), dtype=tf.float32)
        t = _floating(_tensor(like))
        with tf.device(t.device or None):
            return tf.convert_to_tensor(np.asarray(values), dtype=t.dtype)

    def __repr__(self) -> str:
        return "TensorFlowBackend()"
