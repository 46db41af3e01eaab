"""The mechanisms' :class:`~dpledger.mechanisms.ArrayBackend` on PyTorch tensors.

Every operation keeps its input's device and dtype: norms, weighted sums and scaling run where the
tensors live (a GPU stays a GPU), and only per-record vectors of length B (norms, clip factors)
cross to the host, as the protocol prescribes.

Precision, as the protocol requires (:mod:`dpledger.mechanisms.backend`):

* norms are accumulated in float64 (``torch.linalg.vector_norm(..., dtype=torch.float64)``); a
  row whose float64 sum of squares overflows although its elements are finite is recomputed as
  m·‖x/m‖ with m = max|x_j|;
* factors are converted to the tensor's dtype and a converted factor below that dtype's smallest
  normal number counts as 0;
* noise is drawn in float64 *on the tensor's device* from a ``torch.Generator`` that lives on that
  device (never drawn on the CPU and copied), multiplied by the float64 σ̃, added to the float64
  value of the sum, and the result is rounded once to the tensor's dtype. A standard deviation of
  exactly 0 draws nothing (the generator's state is left as it was).

Batched operations (:mod:`dpledger.mechanisms.backend`): :meth:`TorchBackend.norms` computes the
float64 norms of several tensors on their device and reads them back in one copy (one host
synchronisation for a whole release); :meth:`TorchBackend.add_gaussian_noise_many` draws the
standard normals of every tensor in one call over a flat float64 buffer on the device, scales and
adds them with fused multi-tensor operations and rounds once to the tensors' dtype;
:meth:`TorchBackend.scale_many` scales several tensors in one fused operation.

Randomness: ``torch.Generator`` is not a cryptographically secure generator; seed it from OS
entropy (``generator.seed()``) in deployment and with a fixed seed only for tests and
reproducible experiments.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from dpledger.errors import InvalidParameterError
from dpledger.mechanisms.backend import Array

__all__ = ["TorchBackend", "TorchSecureNoise", "check_generator_device", "noise_source"]


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cpu":
        return True
    ia = a.index if a.index is not None else torch.get_device_module(a.type).current_device()
    ib = b.index if b.index is not None else torch.get_device_module(b.type).current_device()
    return ia == ib


def check_generator_device(generator: Any, device: torch.device, *, parameter: str) -> None:
    """Raise unless ``generator`` is a ``torch.Generator`` on ``device``.

    Noise is drawn on the device of the tensors it is added to; a generator on another device
    would force a draw elsewhere and a copy.
    """
    if not isinstance(generator, torch.Generator):
        raise InvalidParameterError(
            parameter, generator, f"a torch.Generator on {device} (torch.Generator(device=...))"
        )
    if not _same_device(generator.device, device):
        raise InvalidParameterError(
            parameter,
            f"a torch.Generator on {generator.device}",
            f"a generator on the tensors' device {device} (torch.Generator(device='{device}'))",
        )


def _overrides(backend: Any, name: str) -> bool:
    """Whether a subclass replaced the one-array operation ``name``: its batched version then
    calls it array by array, so that the subclass's behaviour is kept."""
    return getattr(type(backend), name) is not getattr(TorchBackend, name)


class TorchBackend:
    """:class:`~dpledger.mechanisms.ArrayBackend` for ``torch.Tensor``; generators are
    ``torch.Generator`` objects on the tensors' device.

    Integer and boolean tensors are computed in ``torch.get_default_dtype()``. Tensors are never
    modified in place.
    """

    name = "torch"

    @staticmethod
    def _tensor(x: Array) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise InvalidParameterError("x", type(x).__name__, "a torch.Tensor")
        if x.is_complex():
            raise InvalidParameterError("x", x.dtype, "a real tensor")
        if not x.is_floating_point():
            return x.to(torch.get_default_dtype())
        return x

    def shape(self, x: Array) -> tuple[int, ...]:
        """See :meth:`~dpledger.mechanisms.ArrayBackend.shape`."""
        return tuple(int(s) for s in self._tensor(x).shape)

    def float_info(self, x: Array) -> tuple[float, float]:
        """See :meth:`~dpledger.mechanisms.ArrayBackend.float_info`."""
        info = torch.finfo(self._tensor(x).dtype)
        return float(info.eps), float(info.tiny)

    @staticmethod
    def _rows_norms(rows: torch.Tensor) -> torch.Tensor:
        """Float64 norms of the rows of a 2-D tensor, overflow-safe; stays on the device."""
        if rows.shape[1] == 0:
            return torch.zeros(rows.shape[0], dtype=torch.float64, device=rows.device)
        out = torch.linalg.vector_norm(rows, dim=1, dtype=torch.float64)
        bad = ~torch.isfinite(out)
        if bool(bad.any()):
            for i in bad.nonzero().view(-1).tolist():
                row = rows[i].to(torch.float64)
                m = row.abs().max()  # NaN if an element is NaN, inf if one is inf
                if not bool(torch.isfinite(m)):
                    out[i] = m
                    continue
                out[i] = m * torch.linalg.vector_norm(row / m)
        return out

    def record_norms(self, x: Array) -> np.ndarray:
        """See :meth:`~dpledger.mechanisms.ArrayBackend.record_norms`."""
        t = self._tensor(x)
        if t.dim() == 0:
            raise InvalidParameterError(
                "x", "a 0-d tensor", "a tensor with the records on its leading axis"
            )
        rows = t.detach().reshape(t.shape[0], math.prod(t.shape[1:]))
        return self._rows_norms(rows).cpu().numpy()

    def norm(self, x: Array) -> float:
        """See :meth:`~dpledger.mechanisms.ArrayBackend.norm`."""
        t = self._tensor(x).detach()
        value = float(torch.linalg.vector_norm(t, dtype=torch.float64))
        if math.isfinite(value):
            return value
        return float(self._rows_norms(t.reshape(1, -1))[0])  # overflow-safe (or NaN, inf)

    @staticmethod
    def _factors(t: torch.Tensor, factors: np.ndarray) -> torch.Tensor:
        f = torch.as_tensor(np.asarray(factors, dtype=np.float64)).to(t.dtype)
        f = torch.where(f < torch.finfo(t.dtype).tiny, torch.zeros_like(f), f)
        return f.to(t.device)

    def weighted_sum(self, x: Array, factors: np.ndarray) -> Array:
        """See :meth:`~dpledger.mechanisms.ArrayBackend.weighted_sum`."""
        t = self._tensor(x).detach()
        f = self._factors(t, factors)
        if t.shape[0] == 0:
            return t.new_zeros(t.shape[1:])
        return torch.tensordot(f, t, dims=1)

    def scale_records(self, x: Array, factors: np.ndarray) -> Array:
        """See :meth:`~dpledger.mechanisms.ArrayBackend.scale_records`."""
        t = self._tensor(x).detach()
        f = self._factors(t, factors)
        return t * f.reshape((t.shape[0],) + (1,) * (t.dim() - 1))

    def scale(self, x: Array, factor: float) -> Array:
        """See :meth:`~dpledger.mechanisms.ArrayBackend.scale`."""
        return self._tensor(x).detach() * float(factor)

    def add_gaussian_noise(self, x: Array, *, stddev: float, generator: Any) -> Array:
        """See :meth:`~dpledger.mechanisms.ArrayBackend.add_gaussian_noise`.

        ``generator`` must be a ``torch.Generator`` on ``x``'s device.
        """
        t = self._tensor(x).detach()
        check_generator_device(generator, t.device, parameter="generator")
        if stddev == 0.0:
            return t.clone()
        noise = torch.randn(t.shape, generator=generator, dtype=torch.float64, device=t.device)
        noise.mul_(float(stddev)).add_(t)
        return noise if t.dtype == torch.float64 else noise.to(t.dtype)

    def norms(self, xs: list[Array]) -> np.ndarray:
        """The float64 norms of ``xs`` (as :meth:`norm`), read back to the host in one copy."""
        ts = [self._tensor(x).detach() for x in xs]
        if not ts:
            return np.zeros(0, dtype=np.float64)
        if len({t.device for t in ts}) != 1 or _overrides(self, "norm"):
            return np.array([self.norm(t) for t in ts], dtype=np.float64)
        stacked = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float64) for t in ts])
        out = stacked.cpu().numpy().copy()
        for j in np.flatnonzero(~np.isfinite(out)):  # overflow-safe again (or NaN, inf)
            out[j] = self.norm(ts[j])
        return out

    def add_gaussian_noise_many(
        self, xs: list[Array], *, stddevs: list[float], generator: Any
    ) -> list[Array]:
        """x_j + N(0, stddevs[j]² I) for every tensor, as :meth:`add_gaussian_noise`, with the
        standard normals of all tensors of positive standard deviation drawn in one call over
        their concatenation (in the order given)."""
        ts = [self._tensor(x).detach() for x in xs]
        if len(ts) != len(stddevs):
            raise InvalidParameterError(
                "stddevs", f"{len(stddevs)} values", f"one per tensor ({len(ts)})"
            )
        noisy = [j for j, sd in enumerate(stddevs) if float(sd) != 0.0]
        devices = {ts[j].device for j in noisy}
        if len(devices) > 1 or _overrides(self, "add_gaussian_noise"):
            return [
                self.add_gaussian_noise(t, stddev=sd, generator=generator)
                for t, sd in zip(ts, stddevs, strict=True)
            ]
        for t in ts:
            check_generator_device(generator, t.device, parameter="generator")
        out: list[torch.Tensor | None] = [None] * len(ts)
        for j, t in enumerate(ts):
            if float(stddevs[j]) == 0.0:
                out[j] = t.clone()
        if noisy:
            chosen = [ts[j] for j in noisy]
            sizes = [t.numel() for t in chosen]
            flat = torch.randn(
                sum(sizes), generator=generator, dtype=torch.float64, device=chosen[0].device
            )
            pieces = list(flat.split(sizes))
            torch._foreach_mul_(pieces, [float(stddevs[j]) for j in noisy])
            torch._foreach_add_(pieces, [t.reshape(-1) for t in chosen])  # float64 addition
            dtypes = {t.dtype for t in chosen}
            if len(dtypes) == 1 and torch.float64 not in dtypes:
                pieces = list(flat.to(chosen[0].dtype).split(sizes))  # one rounding for all
            for j, t, piece in zip(noisy, chosen, pieces, strict=True):
                out[j] = piece.view(t.shape).to(t.dtype)
        return [t for t in out if t is not None]

    def scale_many(self, xs: list[Array], factor: float) -> list[Array]:
        """c·x for every tensor (one fused operation where the tensors allow)."""
        ts = [self._tensor(x).detach() for x in xs]
        if _overrides(self, "scale"):
            return [self.scale(t, factor) for t in ts]
        if not ts:
            return []
        return list(torch._foreach_mul(ts, float(factor)))

    def to_host(self, x: Array) -> np.ndarray:
        """See :meth:`~dpledger.mechanisms.ArrayBackend.to_host`."""
        if isinstance(x, torch.Tensor):
            return x.detach().to(device="cpu", dtype=torch.float64).numpy().copy()
        return np.array(x, dtype=np.float64)

    def from_host(self, values: np.ndarray, *, like: Array | None) -> Array:
        """See :meth:`~dpledger.mechanisms.ArrayBackend.from_host`."""
        if like is None:
            return torch.as_tensor(np.asarray(values), dtype=torch.get_default_dtype())
        t = self._tensor(like)
        return torch.as_tensor(np.asarray(values, dtype=np.float64)).to(
            device=t.device, dtype=t.dtype
        )

    def __repr__(self) -> str:
        return "TorchBackend()"


class TorchSecureNoise(TorchBackend):
    """:class:`TorchBackend` whose noise is the secure sampler's
    (:class:`~dpledger.mechanisms.secure_noise.SecureNoiseBackend`: the sum rounded to the grid
    γℤ plus discrete Gaussian noise from a ChaCha20 keystream keyed from the OS).

    The noise is drawn on the host and the noisy sum copied back to the tensor's device and
    dtype (one round trip per tensor; a device-side cipher is future work). The ``generator``
    the mechanisms pass is ignored. :meth:`sensitivity_after_rounding` gives the S + γ√d the
    ledger records.

    Args:
        grid: γ, a power of two (see :class:`~dpledger.mechanisms.secure_noise.SecureNoiseBackend`).
        stream: a :class:`~dpledger.mechanisms.secure_noise.ChaCha20Stream` for tests; None keys
            a new one from the OS.
    """

    name = "torch-secure"

    def __init__(self, *, grid: float = 2.0**-30, stream: Any = None) -> None:
        from dpledger.mechanisms.secure_noise import SecureNoiseBackend

        self._secure = SecureNoiseBackend(grid=grid, stream=stream)

    @property
    def grid(self) -> float:
        """γ."""
        return self._secure.grid

    @property
    def stream(self) -> Any:
        """The keystream."""
        return self._secure.stream

    def sensitivity_after_rounding(self, l2_norm_bound: float, shapes: list[Any]) -> float:
        """S + γ√d (see :class:`~dpledger.mechanisms.secure_noise.SecureNoiseBackend`)."""
        return self._secure.sensitivity_after_rounding(l2_norm_bound, shapes)

    def recorded_bound(self, prepared: Any) -> float:
        """S + γ√d of a prepared release (see
        :meth:`~dpledger.mechanisms.secure_noise.SecureNoiseBackend.recorded_bound`)."""
        return self._secure.recorded_bound(prepared)

    def add_gaussian_noise(self, x: Array, *, stddev: float, generator: Any) -> Array:
        """x on the grid plus discrete Gaussian noise of scale ``stddev``, drawn on the host."""
        t = self._tensor(x).detach()
        host = t.to(device="cpu", dtype=torch.float64).numpy()
        noisy = self._secure.add_gaussian_noise(host, stddev=float(stddev), generator=None)
        return torch.from_numpy(noisy).to(device=t.device, dtype=t.dtype)

    def __repr__(self) -> str:
        return f"TorchSecureNoise(grid={self.grid!r})"


def noise_source(release_backend: Any, secure: bool, correlated: bool) -> TorchBackend:
    """The noise source of an optimizer's ``add_noise``: :class:`TorchBackend`, or with
    ``secure`` :class:`TorchSecureNoise`, whose ``recorded_bound`` (S + γ√d) is given to the
    optimizer's release backend so that its queries record it.

    Raises:
        InvalidParameterError: ``secure`` with correlated noise (not supported yet).
    """
    if not secure:
        return TorchBackend()
    if correlated:
        raise InvalidParameterError(
            "config.secure_noise", True, "False with correlated noise (not supported yet)"
        )
    source = TorchSecureNoise()
    release_backend.recorded_bound = source.recorded_bound
    return source
