"""The correlated-noise release event: one matrix-mechanism release over a whole stream.

A correlated-noise mechanism (tree aggregation, BandMF, BLT: ``docs/correlated-noise.md``) does
not add independent noise at every step, so its steps are not the ledger's independent Gaussian
steps. It is one release, B·(C·X + Z), of the T-step stream X of clipped gradient sums, and the
ledger records it as such, once, before its first noisy output (a ``correlated_release`` line,
``docs/ledger-format.md``): what the strategy was (kind, parameters, the SHA-256 of C), how
records participated (the schema, and Poisson sampling within cyclic bands when it was used for
amplification), the clip bound S, the noise standard deviation σ, and the sensitivity of C under
that schema per unit clip as the mechanism computed it from C.

Accounting (``dpledger/accountants/correlated.py``):

* without amplification, the release is one Gaussian mechanism with sensitivity
  Δ = sens(C)·S and noise σ: μ = Δ/σ (Choquette-Choo et al. 2023, "Multi-Epoch Matrix
  Factorization Mechanisms", section 2);
* with Poisson sampling (rate q) within b cyclic bands of a C with at most b bands, the
  participations of one record touch disjoint row blocks of C, and the release is k
  compositions of the Poisson-subsampled Gaussian with sensitivity max_j ‖C_j‖·S and noise σ
  (Choquette-Choo et al. 2023, "Amplified Banded Matrix Factorization", section 4; for
  dp-accounting a ``MixtureOfGaussiansDpEvent`` with sensitivities (0, ‖C_j‖) and
  probabilities (1 − q, q), Choquette-Choo et al. 2024, "Privacy Amplification for Matrix
  Mechanisms").
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import attrs

from dpledger.errors import InvalidParameterError, LedgerStateError, UnsupportedLedgerError
from dpledger.validation import (
    check_bool,
    check_non_negative_finite,
    check_optional_str,
    check_positive_finite,
    check_positive_int,
    check_probability,
)

__all__ = [
    "PARTICIPATION_KINDS",
    "SAMPLING_KINDS",
    "CorrelatedReleaseEvent",
    "NoiseSeedReuseError",
    "NoiseStreamRollbackError",
    "ReleaseMismatchError",
    "StreamStepEvent",
    "check_new_release_seed",
    "check_stream_resume",
]

PARTICIPATION_KINDS = ("single", "min_separation", "cyclic")
"""The participation schemas (:mod:`dpledger.sampling.participation`)."""

SAMPLING_KINDS = ("none", "poisson_within_bands")
"""``none``: every record participates in every step of its pattern (no amplification);
``poisson_within_bands``: the records are split into ``min_separation`` fixed groups visited
cyclically, and within its group's steps a record is included with probability q."""

_HEX64 = re.compile(r"[0-9a-f]{64}")
_KIND = re.compile(r"[a-z][a-z0-9_]{0,63}")
_RELATIVE_SLACK = 1e-12


def _params(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidParameterError("strategy_params", value, "a dict of JSON values")
    try:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError):
        raise InvalidParameterError(
            "strategy_params", value, "JSON values (finite numbers, strings, lists, dicts)"
        ) from None
    loaded: dict[str, Any] = json.loads(text)
    return loaded


def _kind(value: Any) -> str:
    if not isinstance(value, str) or not _KIND.fullmatch(value):
        raise InvalidParameterError("strategy", value, "a lower-case name like 'banded_toeplitz'")
    return str(value)


def _hash(value: Any) -> str:
    if not isinstance(value, str) or not _HEX64.fullmatch(value):
        raise InvalidParameterError("strategy_hash", value, "64 lower-case hexadecimal digits")
    return str(value)


def _choice(name: str, value: Any, options: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in options:
        raise InvalidParameterError(name, value, f"one of {', '.join(map(repr, options))}")
    return str(value)


def _participation(value: Any) -> str:
    return _choice("participation", value, PARTICIPATION_KINDS)


def _sampling(value: Any) -> str:
    return _choice("sampling", value, SAMPLING_KINDS)


def _optional_bands(value: Any) -> int | None:
    return None if value is None else check_positive_int("bands", value)


@attrs.frozen
class CorrelatedReleaseEvent:
    """One correlated-noise (matrix-mechanism) release of a T-step stream.

    Build it with :func:`dpledger.mechanisms.correlated.release.release_event`, which computes the
    hash and the sensitivity from C itself; this class checks that the values are consistent.

    Attributes:
        strategy: the strategy's kind (``"tree"``, ``"tree_honaker"``, ``"banded_toeplitz"``,
            ``"blt"``, …).
        strategy_params: the parameters that determine C (JSON values).
        strategy_hash: SHA-256 of C (:func:`dpledger.mechanisms.correlated.strategies.matrix_hash`).
        num_steps: T.
        participation: ``"single"``, ``"min_separation"`` or ``"cyclic"``.
        max_participations: k, the most steps one record contributes to.
        min_separation: b, the least distance between two participations (the period for
            ``cyclic``).
        sampling: ``"none"`` or ``"poisson_within_bands"`` (:data:`SAMPLING_KINDS`).
        sampling_probability: q; 1.0 for ``"none"``.
        bands: the number of bands of C (at most ``min_separation``) for
            ``"poisson_within_bands"``; None otherwise.
        l2_norm_bound: S > 0, the clip bound of every record's contribution at every step.
        noise_stddev: σ ≥ 0, the standard deviation of every entry of Z.
        sensitivity: sens(C) per unit clip under the participation schema, > 0.
        sensitivity_exact: whether ``sensitivity`` is the maximum or an upper bound of it.
        max_column_norm: max_j ‖C_j‖, the sensitivity of one participation per unit clip.
        label: what was released (informational).

    Raises:
        InvalidParameterError: a value out of range or values that contradict each other.
    """

    strategy: str = attrs.field(converter=_kind)
    strategy_params: dict[str, Any] = attrs.field(converter=_params, hash=False)
    strategy_hash: str = attrs.field(converter=_hash)
    num_steps: int = attrs.field(converter=lambda v: check_positive_int("num_steps", v))
    participation: str = attrs.field(converter=_participation)
    max_participations: int = attrs.field(
        converter=lambda v: check_positive_int("max_participations", v)
    )
    min_separation: int = attrs.field(converter=lambda v: check_positive_int("min_separation", v))
    sampling: str = attrs.field(converter=_sampling)
    sampling_probability: float = attrs.field(
        converter=lambda v: check_probability("sampling_probability", v)
    )
    bands: int | None = attrs.field(converter=_optional_bands)
    l2_norm_bound: float = attrs.field(
        converter=lambda v: check_positive_finite("l2_norm_bound", v)
    )
    noise_stddev: float = attrs.field(
        converter=lambda v: check_non_negative_finite("noise_stddev", v)
    )
    sensitivity: float = attrs.field(converter=lambda v: check_positive_finite("sensitivity", v))
    sensitivity_exact: bool = attrs.field(converter=lambda v: check_bool("sensitivity_exact", v))
    max_column_norm: float = attrs.field(
        converter=lambda v: check_positive_finite("max_column_norm", v)
    )
    label: str | None = attrs.field(
        default=None, converter=lambda v: check_optional_str("label", v)
    )

    def __attrs_post_init__(self) -> None:
        t, k, b = self.num_steps, self.max_participations, self.min_separation
        if b > t or (k - 1) * b >= t:
            raise InvalidParameterError(
                "max_participations", k, f"(k - 1) * min_separation < num_steps={t}, b <= T"
            )
        if self.participation == "single" and (k, b) != (1, 1):
            raise InvalidParameterError(
                "participation", "single", "max_participations=1 and min_separation=1"
            )
        if self.participation == "cyclic" and k != -(-t // b):
            raise InvalidParameterError("max_participations", k, f"ceil(T / b) = {-(-t // b)}")
        col, sens = self.max_column_norm, self.sensitivity
        if not (col <= sens * (1 + _RELATIVE_SLACK) and sens <= k * col * (1 + _RELATIVE_SLACK)):
            raise InvalidParameterError(
                "sensitivity", sens, f"between max_column_norm={col} and k * max_column_norm"
            )
        if self.sampling == "none":
            if self.sampling_probability != 1.0 or self.bands is not None:
                raise InvalidParameterError(
                    "sampling_probability",
                    self.sampling_probability,
                    "1.0 and bands=None when sampling='none'",
                )
        else:
            if self.participation != "cyclic":
                raise InvalidParameterError(
                    "participation", self.participation, "'cyclic' for poisson_within_bands"
                )
            if self.bands is None or self.bands > b:
                raise InvalidParameterError(
                    "bands", self.bands, f"the bands of C, at most min_separation={b}"
                )

    @property
    def amplified(self) -> bool:
        """True for Poisson sampling within cyclic bands."""
        return self.sampling == "poisson_within_bands"

    @property
    def gaussian_mu(self) -> float:
        """μ = sens(C)·S / σ of the unamplified release (∞ for σ = 0)."""
        delta = self.sensitivity * self.l2_norm_bound
        return math.inf if self.noise_stddev == 0.0 else delta / self.noise_stddev

    def describe(self) -> str:
        """One line for ``dpledger info``."""
        amp = (
            f", Poisson q={self.sampling_probability:.6g} within {self.bands} cyclic bands"
            if self.amplified
            else ""
        )
        return (
            f"{self.strategy} over T={self.num_steps} steps, {self.participation} participation "
            f"(k={self.max_participations}, separation {self.min_separation}){amp}, "
            f"S={self.l2_norm_bound:.6g}, σ={self.noise_stddev:.6g}, "
            f"sens(C)={self.sensitivity:.6g}{'' if self.sensitivity_exact else ' (bound)'}, "
            f"C sha256 {self.strategy_hash[:12]}…"
        )


def _index(name: str, value: Any) -> int:
    if type(value) is not int or value < 0:
        raise InvalidParameterError(name, value, "an integer >= 0")
    return int(value)


def _release_index(value: Any) -> int:
    return _index("release", value)


def _step_index(value: Any) -> int:
    return _index("step", value)


@attrs.frozen
class StreamStepEvent:
    """Step t of a correlated-noise release's stream was taken: its noise w_t was used.

    A release (:class:`CorrelatedReleaseEvent`) already accounts for all T steps of its stream,
    so a stream step changes no ε. It records how far the stream went: the noise of step t is a
    deterministic function of the generator's state, and a run resumed from an older checkpoint
    would add w_t again to other gradients, which reveals their difference without noise. The
    ledger therefore keeps each release's steps in order (0, 1, 2, …, never repeated, fewer
    than T), and the adapters refuse to resume a stream behind its recorded progress
    (``docs/correlated-noise.md``).

    Attributes:
        release: 0-based index of the release in the ledger (its ``correlated_release`` lines
            in file order).
        step: 0-based index t of the step in the release's stream.
    """

    release: int = attrs.field(converter=_release_index)
    step: int = attrs.field(converter=_step_index)

    def describe(self) -> str:
        """One line, e.g. for logs."""
        return f"step {self.step} of correlated-noise release {self.release}"


class NoiseStreamRollbackError(LedgerStateError):
    """A checkpoint of a correlated-noise stream is behind the stream's progress in the ledger.

    The noise w_t of step t is a deterministic function of the stream's generator state. The
    ledger records every step of the stream (:class:`StreamStepEvent`); a checkpoint taken at
    step p when the ledger already records steps 0 .. q − 1 with q > p would add w_p .. w_{q−1}
    again to other gradients, and two outputs with the same noise reveal the difference of their
    gradients without noise. Loading it is refused before anything is recorded: resume from the
    checkpoint taken at step q, or start a new release (a new stream with its own seed), which
    the ledger accounts separately. Both adapters raise it (and re-export it from their
    ``errors`` modules).

    Attributes:
        release: the release's index in the ledger.
        checkpoint_step: p, the stream step the checkpoint continues at.
        ledger_step: q, the stream steps the ledger records for the release.
    """

    def __init__(
        self, message: str, *, release: int, checkpoint_step: int, ledger_step: int
    ) -> None:
        self.release = release
        self.checkpoint_step = checkpoint_step
        self.ledger_step = ledger_step
        super().__init__(message)


def check_stream_resume(*, release: int, checkpoint_step: int, ledger_step: int) -> None:
    """Refuse to continue a stream at a step other than the ledger's progress.

    Args:
        release: the release's index in the ledger.
        checkpoint_step: p, the step the checkpoint continues at.
        ledger_step: q, the steps the ledger records for the release
            (:meth:`~dpledger.ledger.PrivacyLedger.stream_progress`).

    Raises:
        NoiseStreamRollbackError: q > p: the noise of steps p .. q − 1 was already used.
        LedgerStateError: q < p: the ledger records fewer steps than the checkpoint took, so it
            is not the ledger the stream recorded into.
    """
    p, q = checkpoint_step, ledger_step
    if q > p:
        raise NoiseStreamRollbackError(
            f"the checkpoint continues correlated-noise release {release} at step {p}, but the "
            f"ledger records that steps {p}..{q - 1} of its stream were already taken: their "
            "noise was already used, and adding it again to other gradients would reveal the "
            f"difference of the gradients without noise. Resume from the checkpoint taken at "
            f"step {q}, or start a new release (a new stream with its own seed), which the "
            "ledger accounts separately; nothing was recorded",
            release=release,
            checkpoint_step=p,
            ledger_step=q,
        )
    if q < p:
        raise LedgerStateError(
            f"the checkpoint continues correlated-noise release {release} at step {p}, but the "
            f"ledger records only {q} steps of its stream: it is not the ledger the stream "
            "recorded into (continue the run's own file with PrivacyLedger(path, resume=True)); "
            "nothing was recorded"
        )


class NoiseSeedReuseError(LedgerStateError):
    """A new correlated-noise release whose noise could repeat an earlier release's.

    A stream's noise is a deterministic function of its seed. Two releases of one ledger with
    the same seed would add the same noise to different gradients, revealing their difference
    without noise, while the ledger accounts them as independent mechanisms. The ledger does
    not record seeds, so a ledger that already holds a release takes another only from a
    stream whose seed was drawn afresh from the operating system's entropy in this process
    (``seed=None``, the default), never from an explicit seed or a seed restored from a
    checkpoint. Both adapters raise it (and re-export it from their ``errors`` modules).
    """


def check_new_release_seed(ledger_releases: int, *, fresh_seed: bool) -> None:
    """Refuse a new release into a ledger that already holds one unless its seed is fresh.

    Args:
        ledger_releases: the correlated-noise releases the ledger already holds.
        fresh_seed: whether the stream's seed was drawn from the operating system's entropy in
            this process (not given by the user, not restored from a checkpoint).

    Raises:
        NoiseSeedReuseError: the ledger holds a release and the seed is not fresh.
    """
    if ledger_releases and not fresh_seed:
        raise NoiseSeedReuseError(
            f"the ledger already holds {ledger_releases} correlated-noise release(s), and this "
            "stream's seed was given (or restored from a checkpoint taken before its first "
            "step): if it is the seed of an earlier release, the same noise would be added to "
            "other gradients, and the ledger, which records no seeds, could not tell. Use "
            "seed=None (fresh noise from the operating system) for a further release in this "
            "ledger, or record the run in a new ledger; nothing was recorded"
        )


class ReleaseMismatchError(UnsupportedLedgerError):
    """A release's recorded sensitivity (or another number derived from C) is not what its
    strategy parameters give.

    The accountants account a release with the sensitivity it records; before they do, it is
    recomputed from the recorded strategy and parameters
    (:func:`dpledger.mechanisms.correlated.verification.verified_release`). A disagreement beyond
    floating-point rounding means the ledger was written by a version with a bug in that number,
    or edited: accounting with it could understate ε, so the release is refused.

    Attributes:
        release: the release's 0-based index in the ledger.
        label: the release's label (None when it has none).
        field: the recorded field that disagrees (``"sensitivity"``, ``"max_column_norm"``,
            ``"bands"`` or ``"strategy_hash"``).
        recorded: the value in the ledger.
        recomputed: the value the strategy parameters give.
    """

    def __init__(
        self, *, release: int, label: str | None, field: str, recorded: Any, recomputed: Any
    ) -> None:
        self.release = release
        self.label = label
        self.field = field
        self.recorded = recorded
        self.recomputed = recomputed
        name = "" if label is None else f" ({label!r})"
        super().__init__(
            f"correlated-noise release {release}{name} records {field}={recorded!r}, but its "
            f"strategy parameters give {field}={recomputed!r}: the ledger was written by a "
            "version with a bug in that number, or edited; accounting with the recorded value "
            "could understate ε, so the release is refused"
        )
