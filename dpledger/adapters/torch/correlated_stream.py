"""The correlated-noise stream of a :class:`~dpledger.adapters.torch.DPOptimizer`.

With ``noise=`` a :class:`~dpledger.mechanisms.correlated.CorrelatedNoiseSpec` the optimizer
trains with a matrix mechanism instead of DP-SGD's independent noise
(``docs/correlated-noise.md``, "Training with correlated noise (PyTorch)"):

* on its first step (after that step's sensitivity check, before any noisy output) it records
  the one ``correlated_release`` event of the whole stream: the spec's factorization, the
  participation schema and q of the cyclic sampler that draws the batches
  (:meth:`~dpledger.sampling.CyclicScheme.participation`, never the spec's), S the clip bound
  and σ = z·S;
* each step t records ``stream_step t`` (after the sensitivity check, before its noisy output
  is used) and adds w_t, the stream's noise (float64 from the seeded generator of
  :func:`~dpledger.mechanisms.correlated.noise_for`), to the clipped sum instead of
  independent noise;
* step T + 1 is refused (:class:`~dpledger.errors.NoiseStreamEndError`)
  before anything is claimed, released or recorded.

The override points keep their contracts: ``clip`` still gives the clipped sums and
``release`` the whole release; ``add_noise`` (independent noise) is not called on a stream's
steps, whose noise is the stream's.

:class:`CorrelatedStream` holds the factorization, the event once recorded, the generator and
the step, and its :meth:`~CorrelatedStream.state_dict` (in the optimizer's checkpoint) lets a
resumed run continue the same noise without recording the release again. Loading one whose step
p is behind the ledger's progress q for the release (training went on past the checkpoint) is
refused with :class:`~dpledger.ledger.correlated.NoiseStreamRollbackError`: it would add the
noise of steps p .. q − 1 again to other gradients; a ledger behind the checkpoint (q < p) is
refused too.
"""

from __future__ import annotations

import secrets
from typing import Any

import attrs
import numpy as np
import torch

from dpledger.errors import InvalidParameterError, LedgerStateError, NoiseStreamEndError
from dpledger.ledger import PrivacyLedger
from dpledger.ledger.correlated import (
    CorrelatedReleaseEvent,
    check_new_release_seed,
    check_stream_resume,
)
from dpledger.mechanisms.construction_checks import check_ledger
from dpledger.mechanisms.correlated import CorrelatedNoiseSpec, noise_for
from dpledger.mechanisms.correlated.noise import CorrelatedNoise
from dpledger.mechanisms.correlated.release import release_event
from dpledger.sampling.cyclic import CyclicScheme

__all__ = ["CorrelatedNoiseSetup", "CorrelatedStream", "check_noise"]


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


def check_noise(noise: Any) -> CorrelatedNoiseSpec | None:
    """None for ``"independent"``, the spec for a :class:`CorrelatedNoiseSpec`.

    Raises:
        InvalidParameterError: anything else.
    """
    if isinstance(noise, str) and noise == "independent":
        return None
    if isinstance(noise, CorrelatedNoiseSpec):
        return noise
    raise InvalidParameterError(
        "noise",
        noise,
        "'independent' (DP-SGD) or a dpledger.mechanisms.correlated.CorrelatedNoiseSpec",
    )


class CorrelatedStream:
    """One correlated-noise release over the optimizer's steps (see the module docstring).

    Args:
        spec: the mechanism asked for.
        scheme: the cyclic scheme of the sampler that draws the batches (checked to match).
        seed: the noise generator's seed.
        fresh_seed: whether ``seed`` was drawn from the operating system's entropy in this
            process; only such a stream may record a release into a ledger that already holds
            one (:func:`~dpledger.ledger.correlated.check_new_release_seed`).

    Raises:
        InvalidParameterError: the scheme draws something else than the spec asks for.
    """

    def __init__(
        self,
        spec: CorrelatedNoiseSpec,
        *,
        scheme: CyclicScheme,
        seed: int,
        fresh_seed: bool = False,
    ) -> None:
        if not spec.matches(scheme):
            raise InvalidParameterError(
                "sampler",
                scheme.describe(),
                f"a CyclicBatchSampler of the spec {spec.describe()} (same period, num_steps "
                "and sampling probability)",
            )
        self.spec = spec
        self.scheme = scheme
        self.seed = int(seed)
        self.fresh_seed = bool(fresh_seed)
        self.factorization = spec.factorization()
        self.event: CorrelatedReleaseEvent | None = None
        self.release: int | None = None  # the release's index in the ledger, once recorded
        self._noise: CorrelatedNoise | None = None
        self.step = 0

    @property
    def num_steps(self) -> int:
        """T."""
        return self.spec.num_steps

    def check_open(self) -> None:
        """Refuse a step past the stream's T steps.

        Raises:
            NoiseStreamEndError: all T steps were taken.
        """
        if self.step >= self.num_steps:
            raise NoiseStreamEndError(
                f"step {self.step + 1} of a correlated-noise stream of num_steps="
                f"{self.num_steps}: the release recorded in the ledger covers {self.num_steps} "
                "steps; nothing was released or recorded for this one"
            )

    def check_values(self, *, l2_norm_bound: float, noise_stddev: float) -> None:
        """Refuse, after the first step, a clip bound or noise scale other than the release's.

        Raises:
            InvalidParameterError: ``l2_norm_bound`` or ``noise_multiplier`` changed
                mid-stream: the recorded release would not describe the step.
        """
        if self.event is None:
            return
        if (l2_norm_bound, noise_stddev) != (self.event.l2_norm_bound, self.event.noise_stddev):
            raise InvalidParameterError(
                "l2_norm_bound / noise_multiplier",
                f"S={l2_norm_bound!r}, sigma={noise_stddev!r}",
                f"the release's S={self.event.l2_norm_bound!r}, "
                f"sigma={self.event.noise_stddev!r}: a correlated-noise stream keeps one "
                "clip bound and noise scale for all its steps; nothing was released",
            )

    def _event(
        self, *, l2_norm_bound: float, noise_stddev: float, label: str | None
    ) -> CorrelatedReleaseEvent:
        schema, q = self.scheme.participation()
        return release_event(
            self.factorization,
            schema,
            l2_norm_bound=l2_norm_bound,
            noise_stddev=noise_stddev,
            sampling_probability=q,
            label=label,
        )

    def record(
        self,
        ledger: PrivacyLedger,
        *,
        l2_norm_bound: float,
        noise_stddev: float,
        dim: int,
        label: str | None,
    ) -> None:
        """Record the release and start the noise generator (first step only), then record
        this step of the stream (``stream_step``), before its noise is used.

        Raises:
            InvalidParameterError: as :meth:`check_values`.
        """
        self.check_values(l2_norm_bound=l2_norm_bound, noise_stddev=noise_stddev)
        if self.event is None:
            check_new_release_seed(len(ledger.correlated_releases), fresh_seed=self.fresh_seed)
            event = self._event(l2_norm_bound=l2_norm_bound, noise_stddev=noise_stddev, label=label)
            noise = noise_for(
                self.factorization, dim=dim, noise_stddev=event.noise_stddev, seed=self.seed
            )
            release = len(ledger.correlated_releases)
            ledger.record_correlated_release(event)
            self.event, self._noise, self.release = event, noise, release
        assert self.release is not None
        ledger.record_stream_step(release=self.release, step=self.step)

    def next_noise(self, like: torch.Tensor) -> torch.Tensor:
        """w_t as a float64 tensor of ``like``'s shape on its device; the stream advances."""
        assert self._noise is not None, "record() first"
        w = self._noise.next()
        self.step += 1
        return torch.from_numpy(np.ascontiguousarray(w)).to(like.device).reshape(like.shape)

    def describe(self) -> str:
        """The spec and the scheme, e.g. for the optimizer's repr."""
        return f"noise={self.spec.describe()}, {self.scheme.describe()}"

    def buffer_floats(self) -> int:
        """The floats the noise generator holds between steps (0 before the first step)."""
        return 0 if self._noise is None else self._noise.buffer_floats()

    def state_dict(self) -> dict[str, Any]:
        """The step, the recorded event's identity and the noise generator's state."""
        return {
            "step": self.step,
            "seed": self.seed,
            "spec": self.spec.describe(),
            "event": None if self.event is None else attrs.asdict(self.event),
            "release": self.release,
            "noise": None if self._noise is None else _to_tensors(self._noise.state_dict()),
            "dim": None if self._noise is None else self._noise.dim,
        }

    def load_state_dict(
        self,
        state: dict[str, Any],
        *,
        ledger: PrivacyLedger | None,
        scheme: CyclicScheme | None = None,
    ) -> None:
        """Continue the stream of a checkpoint; the release is not recorded again.

        The checkpoint's noise seed and generator state take over, and ``scheme`` (the
        checkpoint's cyclic scheme, when given) replaces :attr:`scheme`: a stream set up with a
        seed drawn from OS entropy continues the checkpointed run's noise and batches.

        The checkpoint's step p must be the ledger's progress q for the release: q > p means
        training went on past the checkpoint, and continuing would add the noise of steps
        p .. q − 1 again to other gradients. Everything is checked before anything changes.

        Raises:
            InvalidParameterError: a state of another spec, or a ``scheme`` the spec does not
                draw.
            LedgerStateError: the checkpoint's release is not in ``ledger`` (continue the run's
                own ledger file), or the ledger records fewer of its steps than the checkpoint
                took.
            NoiseStreamRollbackError: the ledger records more of its steps than the checkpoint
                took (resume from the latest checkpoint, or start a new release).
        """
        if state.get("spec") != self.spec.describe():
            raise InvalidParameterError("state['spec']", state.get("spec"), self.spec.describe())
        if scheme is not None and not self.spec.matches(scheme):
            raise InvalidParameterError("scheme", scheme.describe(), self.spec.describe())
        recorded = state.get("event")
        if recorded is None:
            self.event, self._noise, self.step, self.release = None, None, 0, None
            self.seed = int(state["seed"])
            self.fresh_seed = False  # restored: an earlier process may have released with it
            self.scheme = self.scheme if scheme is None else scheme
            return
        event = CorrelatedReleaseEvent(**recorded)
        step = int(state["step"])
        release = state.get("release")
        if ledger is not None:
            release = _release_index(ledger, event, release)
            check_stream_resume(
                release=release, checkpoint_step=step, ledger_step=ledger.stream_progress(release)
            )
        self.seed = int(state["seed"])
        noise = noise_for(
            self.factorization, dim=int(state["dim"]), noise_stddev=event.noise_stddev, seed=0
        )
        noise.load_state_dict(_to_arrays(state["noise"]))
        self.event, self._noise, self.step = event, noise, step
        self.release = None if release is None else int(release)
        self.scheme = self.scheme if scheme is None else scheme


def _same_release(a: CorrelatedReleaseEvent, b: CorrelatedReleaseEvent) -> bool:
    return (a.strategy_hash, a.l2_norm_bound, a.noise_stddev, a.sensitivity) == (
        b.strategy_hash,
        b.l2_norm_bound,
        b.noise_stddev,
        b.sensitivity,
    )


def _release_index(ledger: PrivacyLedger, event: CorrelatedReleaseEvent, saved: Any) -> int:
    """The index in ``ledger`` of a checkpoint's release: the saved index when the release
    there is the checkpoint's, else (a checkpoint without one) the last matching release.

    Raises:
        LedgerStateError: the ledger holds no such release.
    """
    releases = ledger.correlated_releases
    if saved is None:
        matching = [i for i, e in enumerate(releases) if _same_release(e, event)]
        if matching:
            return matching[-1]
    elif (
        type(saved) is int and 0 <= saved < len(releases) and _same_release(releases[saved], event)
    ):
        return saved
    raise LedgerStateError(
        "the checkpoint's correlated-noise release is not in the ledger: continue the "
        "run's own ledger file (PrivacyLedger(path, resume=True)); a ledger without it "
        "would understate epsilon"
    )


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


def check_correlated_queries(queries: Any, config: Any) -> None:
    """Refuse what a correlated-noise stream cannot release: several groups, scaled groups.

    The release adds one stream's noise to one vector, the clipped sum of every parameter,
    with one clip bound S (``groups="all"``).

    Raises:
        InvalidParameterError: ``groups`` with more than one group, or ``scales``.
    """
    if len(queries.queries) != 1:
        raise InvalidParameterError(
            "groups",
            config.groups,
            "'all' with noise= a CorrelatedNoiseSpec: one correlated-noise release covers one "
            "clipped vector (per-layer or per-parameter groups would each need their own "
            "stream, which dpledger does not record)",
        )
    if config.scales:
        raise InvalidParameterError(
            "scales", dict(config.scales), "None with noise= a CorrelatedNoiseSpec"
        )


class CorrelatedNoiseSetup:
    """The construction of :class:`~dpledger.adapters.torch.DPOptimizer`'s correlated-noise
    stream (a base class of it): the cyclic sampler, the denominator, the ledger, the checks.

    Without correlated noise (``noise="independent"``) nothing here applies and ``_stream``
    stays None.
    """

    _stream: CorrelatedStream | None = None
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
        self._stream = CorrelatedStream(
            spec, scheme=scheme, seed=noise_seed, fresh_seed=seed is None
        )
        return True

    def _check_stream_queries(self, config: Any) -> None:
        """With a stream, refuse several groups and scales (:func:`check_correlated_queries`)."""
        if self._stream is not None:
            check_correlated_queries(getattr(self, "_queries"), config)  # noqa: B009

    def _describe_sampling(self) -> str:
        """The sampling (or the stream) for the optimizer's repr."""
        opt: Any = self
        if self._stream is not None:
            return self._stream.describe()
        if opt._event.is_classic:
            return f"q={opt._q!r}, n={opt._n}"
        return str(opt._event.describe())
