"""The host side of the DP step's release: summaries of the clipped sums that stay on the device.

The release of a step (the sensitivity check, the sampling and sum-query events, the noise
standard deviations) is the mechanisms' own code (:meth:`~dpledger.mechanisms.SampledStep.release`)
run on the host in a ``tf.numpy_function``. It does not need the sums themselves, only their
float64 norms, shapes and dtypes: :class:`SummaryBackend` is an
:class:`~dpledger.mechanisms.ArrayBackend` over such :class:`SumSummary` values, whose noise draw
is a :class:`NoiseOrder` that the graph then carries out
(:mod:`~dpledger.adapters.tensorflow.dp_step`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["NoiseOrder", "SumSummary", "SummaryBackend"]


class SumSummary:
    """What the release needs of a clipped sum: its float64 norm, its shape, its dtype's eps."""

    __slots__ = ("eps", "norm", "shape", "tiny")

    def __init__(self, *, norm: float, shape: tuple[int, ...], eps: float, tiny: float) -> None:
        self.norm, self.shape, self.eps, self.tiny = norm, shape, eps, tiny


class NoiseOrder:
    """The release's request: add N(0, stddev² I) to this sum (carried out in the graph)."""

    __slots__ = ("stddev", "summary")

    def __init__(self, summary: SumSummary, stddev: float) -> None:
        self.summary, self.stddev = summary, float(stddev)


class SummaryBackend:
    """An :class:`~dpledger.mechanisms.ArrayBackend` over :class:`SumSummary` values.

    It lets the mechanisms' release validate, sensitivity-check and record a step whose sums
    stay on the device: the noise draw is returned as a :class:`NoiseOrder`, which the graph
    executes with :class:`TensorFlowBackend`.
    """

    name = "tensorflow-host"

    def shape(self, x: Any) -> tuple[int, ...]:
        return x.shape

    def float_info(self, x: Any) -> tuple[float, float]:
        return x.eps, x.tiny

    def record_norms(self, x: Any) -> np.ndarray:
        raise NotImplementedError("the host release has no records")  # pragma: no cover

    def norm(self, x: Any) -> float:
        return x.norm

    def weighted_sum(self, x: Any, factors: np.ndarray) -> Any:
        raise NotImplementedError("the host release has no records")  # pragma: no cover

    def scale_records(self, x: Any, factors: np.ndarray) -> Any:
        raise NotImplementedError("the host release has no records")  # pragma: no cover

    def scale(self, x: Any, factor: float) -> Any:
        raise NotImplementedError("averaging happens in the graph")  # pragma: no cover

    def add_gaussian_noise(self, x: Any, *, stddev: float, generator: Any) -> Any:
        return NoiseOrder(x, stddev)

    def to_host(self, x: Any) -> np.ndarray:
        raise NotImplementedError("the host release has no arrays")  # pragma: no cover

    def from_host(self, values: np.ndarray, *, like: Any | None) -> Any:
        raise NotImplementedError("the host release has no arrays")  # pragma: no cover
