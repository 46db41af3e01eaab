"""Where a run's noise came from: the noise-provenance record a ledger keeps in a note.

The events of a ledger say that Gaussian noise of standard deviation σ̃ was added at every step.
That is a guarantee only while nobody can know the noise: a caller-given seed, or a generator
state saved next to the weights, hands it to whoever has the seed or the checkpoint. Every
training entry point therefore records, before its first step, a :class:`NoiseProvenance` in a
``note`` line of the ledger (``{"noise_provenance": {...}}``, docs/ledger-format.md): which
generator drew the noise, how it and the batch sampler's generator were seeded (``os_entropy``,
``caller_seed`` or ``caller_generator`` — never the seed itself), whether the secure sampler was
used, where the generator state lives and whether checkpoints carry it. No accountant reads it;
``dpledger info``, ``epsilon`` and ``report`` show it, and flag a caller-given seed, since the
ε of such a run holds only while the seed stays secret (docs/concepts/noise.md).

A ledger written before the record existed holds none: its provenance is "not recorded".
"""

from __future__ import annotations

import logging
from typing import Any

import attrs

from dpledger.errors import InvalidParameterError, LedgerStateError

__all__ = [
    "CHECKPOINT_STATES",
    "PROVENANCE_KEY",
    "SEEDINGS",
    "NoiseProvenance",
    "note_noise_provenance",
    "provenance_findings",
    "provenance_of",
    "provenance_text",
    "seeding_of",
]

_log = logging.getLogger(__name__)

PROVENANCE_KEY = "noise_provenance"
"""The note metadata key under which a noise-provenance record is stored."""

SEEDINGS = ("os_entropy", "caller_seed", "caller_generator")
"""How a generator was seeded: from the operating system's entropy by dpledger, from a seed the
caller gave (anyone who knows it can regenerate the draws), or a generator the caller built
(dpledger cannot tell how it was seeded)."""

CHECKPOINT_STATES = ("excluded", "included")
"""Whether the run's checkpoints carry the generator states (``included`` only by an explicit
opt-in for bit-for-bit resumes)."""

_SCHEMA = 1


def _check_seeding(name: str, value: Any, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if value not in SEEDINGS:
        valid = " or ".join(repr(s) for s in SEEDINGS)
        raise InvalidParameterError(name, value, valid + (" or None" if optional else ""))


def _check_text(name: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidParameterError(name, value, "a non-empty string")


@attrs.frozen(kw_only=True)
class NoiseProvenance:
    """The noise source of a run (or a release), as recorded in the ledger.

    Attributes:
        entry_point: what drew the noise, e.g. ``"torch.DPOptimizer"``, ``"keras.DPKerasModel"``,
            ``"numpy.sampled_step"``.
        generator: the generator kind, e.g. ``"torch.Generator(cpu)"``,
            ``"numpy.random.Generator(PCG64)"``, ``"chacha20"``.
        seeding: how the noise generator was seeded: one of :data:`SEEDINGS`.
        sampler_seeding: how the batch sampler's generator was seeded (:data:`SEEDINGS`), or
            None when the batches came from a sampler dpledger does not draw (the caller's own,
            or none).
        secure_sampler: whether the noise came from the secure sampler (a cipher-keyed discrete
            Gaussian, :mod:`dpledger.mechanisms.secure_noise`).
        state_location: where the generator state lives while the run goes on.
        checkpoint: whether checkpoints carry the generator states: one of
            :data:`CHECKPOINT_STATES`.
    """

    entry_point: str
    generator: str
    seeding: str
    sampler_seeding: str | None = None
    secure_sampler: bool = False
    state_location: str = "process memory"
    checkpoint: str = "excluded"

    def __attrs_post_init__(self) -> None:
        _check_text("entry_point", self.entry_point)
        _check_text("generator", self.generator)
        _check_seeding("seeding", self.seeding)
        _check_seeding("sampler_seeding", self.sampler_seeding, optional=True)
        if not isinstance(self.secure_sampler, bool):
            raise InvalidParameterError("secure_sampler", self.secure_sampler, "True or False")
        _check_text("state_location", self.state_location)
        if self.checkpoint not in CHECKPOINT_STATES:
            raise InvalidParameterError("checkpoint", self.checkpoint, "'excluded' or 'included'")

    def to_json(self) -> dict[str, Any]:
        """The record as the JSON object a note holds under :data:`PROVENANCE_KEY`."""
        return {"schema": _SCHEMA, **attrs.asdict(self)}

    @classmethod
    def from_json(cls, value: Any) -> NoiseProvenance | None:
        """The record a note holds, or None if ``value`` is not one this version can read."""
        if not isinstance(value, dict) or value.get("schema") != _SCHEMA:
            return None
        fields = {a.name for a in attrs.fields(cls)}
        try:
            return cls(**{k: v for k, v in value.items() if k in fields})
        except (InvalidParameterError, TypeError):
            return None

    @property
    def caller_seeded(self) -> bool:
        """Whether the noise or the sampler was seeded with a seed the caller gave."""
        return "caller_seed" in (self.seeding, self.sampler_seeding)

    def describe(self) -> str:
        """One line: the generator, its seeding, the sampler's seeding, the secure sampler, the
        state's place and the checkpoints."""
        sampler = "not drawn by dpledger" if self.sampler_seeding is None else self.sampler_seeding
        secure = "secure discrete Gaussian" if self.secure_sampler else "floating-point Gaussian"
        return (
            f"{self.entry_point}: noise {self.generator} seeded by {self.seeding}, "
            f"{secure}; sampler seeded by {sampler}; state in {self.state_location}; "
            f"checkpoints {self.checkpoint} it"
        )


def seeding_of(*, generator: Any, seed: Any) -> str:
    """How an entry point's generator was seeded, from what the caller gave it: a generator
    (``"caller_generator"``), a seed (``"caller_seed"``), or neither (``"os_entropy"``: the entry
    point seeds it from the operating system)."""
    if generator is not None:
        return "caller_generator"
    return "os_entropy" if seed is None else "caller_seed"


def provenance_of(notes: Any) -> tuple[NoiseProvenance, ...]:
    """The noise-provenance records of a ledger's notes (``ledger.notes``), in order; empty
    when the ledger holds none (a file written before the record existed: "not recorded")."""
    found = []
    for note in notes:
        if isinstance(note, dict) and PROVENANCE_KEY in note:
            record = NoiseProvenance.from_json(note[PROVENANCE_KEY])
            if record is not None:
                found.append(record)
    return tuple(found)


def note_noise_provenance(ledger: Any, record: NoiseProvenance) -> None:
    """Record ``record`` in ``ledger`` as a note, unless its last record is the same.

    Entry points call this before their first step (the NumPy mechanisms at every step, so the
    check for a repeat keeps the file to one line per change). A ledger that cannot take a note
    (closed, read-only, format version 1) gets the record logged at WARNING instead.
    """
    if not isinstance(record, NoiseProvenance):
        raise InvalidParameterError("record", record, "a NoiseProvenance")
    if ledger is None:
        return
    known = provenance_of(ledger.notes)
    if known and known[-1] == record:
        return
    try:
        ledger.record_note({PROVENANCE_KEY: record.to_json()})
    except LedgerStateError as exc:
        _log.warning(
            "the noise provenance could not be recorded in the ledger (%s): %s",
            exc,
            record.describe(),
        )


def provenance_text(records: tuple[NoiseProvenance, ...]) -> list[str]:
    """What the CLI prints about the noise's source: one line per distinct record, or
    ``["not recorded"]`` for a ledger without one."""
    if not records:
        return ["not recorded (a ledger written before dpledger recorded it)"]
    lines: list[str] = []
    for record in records:
        line = record.describe()
        if line not in lines:
            lines.append(line)
    return lines


def provenance_findings(records: tuple[NoiseProvenance, ...]) -> list[str]:
    """The warnings a ledger's provenance calls for, one sentence each (empty: none).

    A caller-given seed: the ε holds only while the seed stays secret (whoever has it
    regenerates the noise or the batches). A generator the caller built: dpledger cannot tell
    how it was seeded. Checkpoints that carry the generator state: the ε holds only while those
    checkpoints stay secret.
    """
    out: list[str] = []
    if any(r.caller_seeded for r in records):
        out.append(
            "the noise or the batch sampler was seeded with a seed the caller gave: the ε holds "
            "only while that seed stays secret (anyone who has it can regenerate the noise or "
            "the batches); seed from the operating system (seed=None) for a deployed run"
        )
    if any("caller_generator" in (r.seeding, r.sampler_seeding) for r in records):
        out.append(
            "the noise or the batch sampler used a generator the caller built: dpledger cannot "
            "tell how it was seeded, and the ε holds only while its seed and state stay secret"
        )
    if any(r.secure_sampler for r in records):
        out.append(
            "secure noise (the discrete Gaussian on a grid): every accountant reports an "
            "approximation, not an upper bound. Without subsampling it is zCDP (Canonne, Kamath "
            "& Steinke 2020), but the sampler's approximation term is not yet added; under "
            "subsampling the accountants treat it as the continuous Gaussian with sensitivity "
            "S + γ√d, a dominance docs/concepts/noise.md argues but does not prove"
        )
    if any(r.checkpoint == "included" for r in records):
        out.append(
            "the run's checkpoints carry the noise and sampler generator states (bit-for-bit "
            "resume was asked for): the ε holds only while those checkpoints stay secret"
        )
    return out
