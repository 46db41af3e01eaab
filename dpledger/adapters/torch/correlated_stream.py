"""The correlated-noise stream of a :class:`~dpledger.adapters.torch.DPOptimizer`: the tensor
glue of the core :class:`~dpledger.mechanisms.correlated.stream.CorrelatedStream`.

With ``noise=`` a :class:`~dpledger.mechanisms.correlated.CorrelatedNoiseSpec` the optimizer
trains with a matrix mechanism instead of DP-SGD's independent noise
(``docs/correlated-noise.md``, "Training with correlated noise (PyTorch)"). The core stream
records the release on the first step and ``stream_step t`` on every step (after the step's
sensitivity check, before its noisy output), hands out w_t and refuses step T + 1
(:class:`~dpledger.errors.NoiseStreamEndError`) before anything is claimed, released or
recorded. Here: w_t as a tensor on the sums' device, the stream's state as tensors in the
optimizer's checkpoint (so that ``torch.load(weights_only=True)`` reads it), the choice of the
cyclic sampler and the optimizer's set-up.

The override points keep their contracts: ``clip`` still gives the clipped sums and
``release`` the whole release; ``add_noise`` (independent noise) is not called on a stream's
steps, whose noise is the stream's.
"""

from __future__ import annotations

import secrets
from typing import Any

import numpy as np
import torch

from dpledger.errors import InvalidParameterError
from dpledger.ledger import PrivacyLedger
from dpledger.mechanisms.construction_checks import check_ledger
from dpledger.mechanisms.correlated.stream import CorrelatedStream as CoreStream
from dpledger.mechanisms.correlated.stream import check_noise, check_one_group
from dpledger.sampling.cyclic import CyclicScheme

__all__ = ["CorrelatedBatchStream", "CorrelatedNoiseSetup", "check_noise"]


def _to_tensors(value: Any) -> Any:
    """NumPy arrays as (exact, float64) tensors, so that ``torch.load(weights_only=True)``
    reads the checkpoint."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    if isinstance(value, dict):
        return {k: _to_tensors(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_tensors(v) for v in value]
    return value


def _to_arrays(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy().copy()
    if isinstance(value, dict):
        return {k: _to_arrays(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_arrays(v) for v in value]
    return value


class CorrelatedBatchStream(CoreStream):
    """The core stream with its noise as tensors and its state as a torch checkpoint's."""

    def record(
        self,
        ledger: PrivacyLedger,
        *,
        l2_norm_bound: float,
        noise_stddev: float,
        dim: int,
        label: str | None,
    ) -> None:
        """Build the release (first step), then record it and this step before its noise is
        used (:meth:`~CoreStream.start`, :meth:`~CoreStream.record_step`).

        Raises:
            InvalidParameterError: S or σ other than the release's.
        """
        self.start(l2_norm_bound=l2_norm_bound, noise_stddev=noise_stddev, dim=dim, label=label)
        self.record_step(ledger)

    def next_noise(self, like: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """w_t as a float64 tensor of ``like``'s shape on its device; the stream advances."""
        w = super().next_noise()
        return torch.from_numpy(np.ascontiguousarray(w)).to(like.device).reshape(like.shape)

    def state_dict(self) -> dict[str, Any]:
        """:meth:`CoreStream.state_dict` with its arrays as tensors."""
        return dict(_to_tensors(super().state_dict()))

    def load_state_dict(
        self,
        state: dict[str, Any],
        *,
        ledger: PrivacyLedger | None,
        scheme: CyclicScheme | None = None,
    ) -> None:
        """:meth:`CoreStream.load_state_dict` of a checkpoint's (tensor) state."""
        super().load_state_dict(_to_arrays(state), ledger=ledger, scheme=scheme)


def cyclic_sampler_of(
    sampler: Any, sampling_probability: float | None, population_size: int | None
) -> Any:
    """The :class:`~dpledger.adapters.torch.CyclicBatchSampler` of a correlated-noise stream
    (``sampler`` itself, or the batch sampler of a DataLoader).

    Raises:
        InvalidParameterError: no such sampler, or q and n given (they are the sampler's).
    """
    from torch.utils.data import DataLoader

    from dpledger.adapters.torch.batch_samplers import CyclicBatchSampler

    if sampling_probability is not None or population_size is not None:
        raise InvalidParameterError(
            "sampling_probability",
            sampling_probability,
            "None with noise= a CorrelatedNoiseSpec (the cyclic sampler's parameters are used)",
        )
    inner = sampler.batch_sampler if isinstance(sampler, DataLoader) else sampler
    if not isinstance(inner, CyclicBatchSampler):
        shown = type(inner).__name__ if inner is not None else None
        if isinstance(sampler, DataLoader):
            shown = f"a DataLoader with batch_sampler {shown}"
        raise InvalidParameterError(
            "sampler",
            shown,
            "a CyclicBatchSampler of the spec (CyclicBatchSampler.for_spec(spec, "
            "population_size=n, seed=s)) or the DataLoader make_private(..., noise=spec) "
            "returns: the correlated-noise release records the cyclic participation of the "
            "batches, which no other sampler draws",
        )
    return inner


def correlated_ledger(ledger: PrivacyLedger | None) -> PrivacyLedger:
    """``ledger``, or a new in-memory add/remove ledger; it must be open.

    Raises:
        InvalidParameterError: not a ledger.
        LedgerStateError: a closed ledger.
    """
    checked = check_ledger(ledger)
    return PrivacyLedger() if checked is None else checked


class CorrelatedNoiseSetup:
    """The construction of :class:`~dpledger.adapters.torch.DPOptimizer`'s correlated-noise
    stream (a base class of it): the cyclic sampler, the denominator, the ledger, the checks.

    Without correlated noise (``noise="independent"``) nothing here applies and ``_stream``
    stays None.
    """

    _stream: CorrelatedBatchStream | None = None
    _distributed: bool

    def _init_stream(
        self,
        noise: Any,
        sampler: Any,
        sampling_probability: float | None,
        population_size: int | None,
        ledger: PrivacyLedger | None,
        seed: int | None,
    ) -> bool:
        """Set up the stream of ``noise`` when it is a spec; returns whether it is.

        Raises:
            InvalidParameterError: a bad ``noise``, a sampler other than the spec's
                ``CyclicBatchSampler``, ``sampling_probability`` or ``population_size`` given,
                or ``torch.distributed``.
        """
        spec = check_noise(noise)
        self._stream = None
        if spec is None:
            return False
        if self._distributed:
            raise InvalidParameterError(
                "noise",
                spec.describe(),
                "'independent' under torch.distributed: dpledger has no distributed cyclic "
                "sampler, so correlated noise trains in one process only",
            )
        source = cyclic_sampler_of(sampler, sampling_probability, population_size)
        opt: Any = self
        opt._sampler = source
        opt._event = None  # the stream records no sampling events
        scheme = source.cyclic_scheme
        opt._n = scheme.population_size
        opt._denominator = scheme.average_denominator
        opt._q = opt._denominator / opt._n
        opt._user_level = False
        opt._ledger = correlated_ledger(ledger)
        noise_seed = secrets.randbits(62) if seed is None else seed
        self._stream = CorrelatedBatchStream(
            spec, scheme=scheme, seed=noise_seed, fresh_seed=seed is None
        )
        return True

    def _check_stream_queries(self, config: Any) -> None:
        """With a stream, refuse several groups and scales (:func:`check_one_group`)."""
        if self._stream is not None:
            check_one_group(getattr(self, "_queries"), groups=config.groups)  # noqa: B009

    def _describe_sampling(self) -> str:
        """The sampling (or the stream) for the optimizer's repr."""
        opt: Any = self
        if self._stream is not None:
            return self._stream.describe()
        if opt._event.is_classic:
            return f"q={opt._q!r}, n={opt._n}"
        return str(opt._event.describe())
