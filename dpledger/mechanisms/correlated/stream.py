"""The bookkeeping of one correlated-noise stream in a training run, written once for every
adapter (``docs/correlated-noise.md``, "Training with correlated noise").

A run with ``noise=`` a :class:`~dpledger.mechanisms.correlated.CorrelatedNoiseSpec` trains
with a matrix mechanism instead of DP-SGD's independent noise. :class:`CorrelatedStream` holds
what that needs beside the tensors:

* the spec's factorization and the :class:`~dpledger.sampling.CyclicScheme` of the sampler
  that draws the batches (checked to draw what the spec asks for);
* the one ``correlated_release`` event of the whole stream: the factorization, the
  participation schema and q of the scheme (:meth:`~dpledger.sampling.CyclicScheme.participation`,
  never the spec's), S the clip bound and σ = z·S; recorded on the stream's first step, after
  that step's sensitivity check and before any noisy output;
* each step t's ``stream_step t``, recorded before its noise w_t is handed out, and w_t
  itself (float64, from the seeded generator of
  :func:`~dpledger.mechanisms.correlated.noise_for`);
* the refusal of step T + 1 (:class:`~dpledger.errors.NoiseStreamEndError`) and of a clip
  bound or noise scale other than the release's, before anything is recorded;
* its state (:meth:`CorrelatedStream.state_dict`, :func:`state_to_json` for a JSON file) and
  the resumption of a saved stream: the saved release is found in the ledger and the saved
  step p must be the ledger's progress q for it. q > p (training went on past the save) is
  refused with :class:`~dpledger.ledger.correlated.NoiseStreamRollbackError`, since continuing
  would add the noise of steps p .. q − 1 again to other gradients; q < p is refused too.

The adapters keep only their tensors (the clipped sum, w_t added on the device) and their
sampler's tie to the step's batch.
"""

from __future__ import annotations

import base64
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from dpledger.errors import InvalidParameterError, NoiseStreamEndError
from dpledger.ledger import PrivacyLedger
from dpledger.ledger.correlated import (
    CorrelatedReleaseEvent,
    check_new_release_seed,
    check_stream_resume,
)
from dpledger.mechanisms.correlated.noise import CorrelatedNoise, noise_for
from dpledger.mechanisms.correlated.release import release_event
from dpledger.mechanisms.correlated.spec import CorrelatedNoiseSpec
from dpledger.mechanisms.sum_query import ScaledGaussianSumQuery
from dpledger.sampling.cyclic import CyclicScheme

__all__ = [
    "CorrelatedStream",
    "check_noise",
    "check_one_group",
    "state_from_json",
    "state_to_json",
]


def check_noise(noise: Any) -> CorrelatedNoiseSpec | None:
    """None for ``noise="independent"`` (DP-SGD), the spec for a :class:`CorrelatedNoiseSpec`.

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


def check_one_group(queries: Any, *, groups: Any = None) -> float:
    """S of the single unscaled group a correlated-noise release needs.

    The release adds one stream's noise to one vector, the clipped sum of every parameter,
    with one clip bound S and one σ = z·S for every coordinate (``groups="all"``).

    Args:
        queries: the run's :class:`~dpledger.mechanisms.gradient_queries.GradientQueries`.
        groups: the ``groups`` setting asked for, shown in the error.

    Raises:
        InvalidParameterError: several groups (``groups``), or joint scaled clipping
            (``scales``).
    """
    members = queries.queries
    if len(members) != 1:
        raise InvalidParameterError(
            "groups",
            f"{len(members)} groups" if groups is None else groups,
            "'all' with noise= a CorrelatedNoiseSpec: one correlated-noise release covers one "
            "clipped vector with one clip bound S and one σ = z·S for every coordinate "
            "(per-layer or per-parameter groups would each need their own stream, which "
            "dpledger does not record)",
        )
    if isinstance(members[0], ScaledGaussianSumQuery):
        raise InvalidParameterError(
            "scales", members[0].label, "None with noise= a CorrelatedNoiseSpec"
        )
    return float(members[0].l2_norm_bound)


def _same_release(a: CorrelatedReleaseEvent, b: CorrelatedReleaseEvent) -> bool:
    return (a.strategy_hash, a.l2_norm_bound, a.noise_stddev, a.sensitivity) == (
        b.strategy_hash,
        b.l2_norm_bound,
        b.noise_stddev,
        b.sensitivity,
    )


def release_index(ledger: PrivacyLedger, event: CorrelatedReleaseEvent, saved: Any) -> int:
    """The index in ``ledger`` of a saved stream's release: the saved index when the release
    there is the saved one, else (a state without an index) the last matching release.

    Raises:
        InvalidParameterError: the ledger holds no such release (``ledger``).
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
    raise InvalidParameterError(
        "ledger",
        ledger,
        "the ledger that holds this model's correlated-noise release (reopen the run's file "
        "with PrivacyLedger(path, resume=True)): the saved stream continues a release that is "
        "not in the ledger given, and a ledger without it would understate epsilon",
    )


class CorrelatedStream:
    """One correlated-noise release over a run's steps (see the module docstring).

    The release event is built by :meth:`start` (from S, σ, the dimension and the label) and
    recorded by the first :meth:`record_step`.

    Args:
        spec: the mechanism asked for.
        scheme: the cyclic scheme of the sampler that draws the batches.
        seed: the noise generator's seed.
        fresh_seed: whether ``seed`` was drawn from the operating system's entropy in this
            process; only such a stream may record a release into a ledger that already holds
            one (:func:`~dpledger.ledger.correlated.check_new_release_seed`).

    Raises:
        InvalidParameterError: the scheme draws something else than the spec asks for
            (``sampler``).
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
                f"a cyclic sampler of the spec {spec.describe()} (same period, num_steps and "
                "sampling probability): CyclicBatchSampler.for_spec or a CyclicDatasetSampler "
                "with the spec's parameters",
            )
        self.spec = spec
        self.scheme = scheme
        self.seed = int(seed)
        self.fresh_seed = bool(fresh_seed)
        self.factorization = spec.factorization()
        self.event: CorrelatedReleaseEvent | None = None  # built by start()
        self.noise: CorrelatedNoise | None = None  # started by start()
        self.recorded = False
        self.release: int | None = None  # the release's index in the ledger, once recorded
        self.step = 0

    @property
    def num_steps(self) -> int:
        """T."""
        return self.spec.num_steps

    def describe(self) -> str:
        """The spec and the scheme, e.g. for an optimizer's repr."""
        return f"noise={self.spec.describe()}, {self.scheme.describe()}"

    def check_open(self) -> None:
        """Refuse a step past the stream's T steps.

        Raises:
            NoiseStreamEndError: all T steps were taken.
        """
        if self.step >= self.num_steps:
            raise NoiseStreamEndError(
                f"step {self.step + 1} of a correlated-noise stream of num_steps="
                f"{self.num_steps}: the release recorded in the ledger covers {self.num_steps} "
                "steps and all were taken; nothing was released or recorded for this one. "
                "Start a new release (its own spec and ledger) to train further"
            )

    def check_values(self, *, l2_norm_bound: float, noise_stddev: float) -> None:
        """Refuse, once the release is built, a clip bound or noise scale other than its own.

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

    def start(
        self, *, l2_norm_bound: float, noise_stddev: float, dim: int, label: str | None
    ) -> CorrelatedReleaseEvent:
        """Build the release event and the noise generator (once; later calls check that S and
        σ are the release's). Nothing is recorded.

        Args:
            l2_norm_bound: S, the clip bound of a record's whole gradient.
            noise_stddev: σ = z·S.
            dim: d, the number of coordinates of a step's sum.
            label: the release's label in the ledger.

        Raises:
            InvalidParameterError: as :meth:`check_values`, or a bad value.
        """
        self.check_values(l2_norm_bound=l2_norm_bound, noise_stddev=noise_stddev)
        if self.event is None:
            participation = self.scheme.participation()
            event = release_event(
                self.factorization,
                participation.schema,
                l2_norm_bound=l2_norm_bound,
                noise_stddev=noise_stddev,
                sampling_probability=participation.sampling_probability,
                label=label,
            )
            self.noise = noise_for(
                self.factorization, dim=dim, noise_stddev=event.noise_stddev, seed=self.seed
            )
            self.event = event
        return self.event

    def record_step(self, ledger: PrivacyLedger) -> int:
        """Record the release (first step only), then this step (``stream_step t``), before
        its noise is handed out; returns t.

        Raises:
            NoiseStreamEndError: all T steps were taken.
            NoiseSeedReuseError: the first step of a stream with a given seed into a ledger
                that already holds a release.
        """
        assert self.event is not None, "start() first"
        self.check_open()
        if not self.recorded:
            release = len(ledger.correlated_releases)
            check_new_release_seed(release, fresh_seed=self.fresh_seed)
            ledger.record_correlated_release(self.event)
            self.recorded, self.release = True, release
        assert self.release is not None
        ledger.record_stream_step(release=self.release, step=self.step)
        return self.step

    def next_noise(self) -> npt.NDArray[np.float64]:
        """w_t, float64 of shape (d,); the stream advances."""
        assert self.noise is not None, "start() first"
        w = self.noise.next()
        self.step += 1
        return w

    def buffer_floats(self) -> int:
        """The floats the noise generator holds between steps (0 before it starts)."""
        return 0 if self.noise is None else self.noise.buffer_floats()

    # ------------------------------------------------------------------ saving and resuming
    def state_dict(self) -> dict[str, Any]:
        """The step, the seed, the recorded event and its index in the ledger, and the noise
        generator's state (NumPy arrays; :func:`state_to_json` for a JSON file)."""
        event = self.event if self.recorded else None
        noise = self.noise if event is not None else None
        return {
            "step": self.step,
            "seed": self.seed,
            "spec": self.spec.describe(),
            "event": None if event is None else attrs.asdict(event),
            "release": self.release,
            "noise": None if noise is None else noise.state_dict(),
            "dim": None if noise is None else noise.dim,
        }

    def load_state_dict(
        self,
        state: dict[str, Any],
        *,
        ledger: PrivacyLedger | None,
        scheme: CyclicScheme | None = None,
    ) -> None:
        """Continue the stream of :meth:`state_dict`; the release is not recorded again.

        The state's noise seed and generator state take over, and ``scheme`` (the saved
        run's cyclic scheme, when given) replaces :attr:`scheme`: a stream set up with a seed
        drawn from OS entropy continues the saved run's noise and batches. With a ``ledger``,
        the saved release is resumed there (:meth:`resume`). Everything is checked before
        anything changes.

        Raises:
            InvalidParameterError: a state of another spec, a ``scheme`` the spec does not
                draw, a ledger without the saved release, or a bad state.
            LedgerStateError: the ledger records fewer of the release's steps than the state
                took.
            NoiseStreamRollbackError: the ledger records more of its steps than the state
                took (resume from the latest save, or start a new release).
        """
        if state.get("spec") != self.spec.describe():
            raise InvalidParameterError("state['spec']", state.get("spec"), self.spec.describe())
        if scheme is not None and not self.spec.matches(scheme):
            raise InvalidParameterError("scheme", scheme.describe(), self.spec.describe())
        scheme = self.scheme if scheme is None else scheme
        seed = int(state["seed"])
        recorded = state.get("event")
        if recorded is None:  # saved before the first step: the stream starts afresh
            noise = self.noise
            if noise is not None:  # already started: start it again with the saved seed
                noise = noise_for(
                    self.factorization, dim=noise.dim, noise_stddev=noise.noise_stddev, seed=seed
                )
            self.noise, self.step, self.recorded, self.release = noise, 0, False, None
            self.seed, self.scheme = seed, scheme
            self.fresh_seed = False  # restored: an earlier process may have released with it
            return
        event = CorrelatedReleaseEvent(**recorded)
        step = int(state["step"])
        release = state.get("release")
        if ledger is not None:
            release = self._resumed_release(ledger, event, release, step)
        noise = noise_for(
            self.factorization, dim=int(state["dim"]), noise_stddev=event.noise_stddev, seed=0
        )
        noise.load_state_dict(state["noise"])
        self.event, self.noise, self.step, self.recorded = event, noise, step, True
        self.release = None if release is None else int(release)
        self.seed, self.scheme = seed, scheme

    @staticmethod
    def _resumed_release(
        ledger: PrivacyLedger, event: CorrelatedReleaseEvent, saved: Any, step: int
    ) -> int:
        release = release_index(ledger, event, saved)
        check_stream_resume(
            release=release, checkpoint_step=step, ledger_step=ledger.stream_progress(release)
        )
        return release

    def resume(self, ledger: PrivacyLedger) -> None:
        """Continue a loaded stream in ``ledger``: the saved release must be there, with
        exactly the stream's steps recorded (nothing to check before the first step).

        Raises:
            InvalidParameterError: the ledger does not hold the release.
            LedgerStateError: the ledger records fewer of the release's steps than the stream
                took.
            NoiseStreamRollbackError: the ledger records more of them.
        """
        if not self.recorded:
            self.release = None
            return
        assert self.event is not None
        self.release = self._resumed_release(ledger, self.event, self.release, self.step)


def _encode(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        data = np.ascontiguousarray(value, dtype="<f8")
        return {
            "__float64__": base64.b64encode(data.tobytes()).decode("ascii"),
            "shape": list(data.shape),
        }
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if "__float64__" in value:
            raw = base64.b64decode(value["__float64__"])
            return np.frombuffer(raw, dtype="<f8").reshape(value["shape"]).astype(np.float64)
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def state_to_json(state: dict[str, Any]) -> dict[str, Any]:
    """A :meth:`CorrelatedStream.state_dict` as JSON values (float64 arrays as exact bytes)."""
    return {str(k): _encode(v) for k, v in state.items()}


def state_from_json(values: dict[str, Any]) -> dict[str, Any]:
    """The state :func:`state_to_json` encoded."""
    return {k: _decode(v) for k, v in values.items()}
