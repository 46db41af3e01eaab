"""Encoding ledger lines: the one layout every line of a ledger file is written in.

Every line is one JSON object in ASCII whose fields come in a fixed order, with no spaces and
floats in Python's shortest round-trip ``repr``, ending with ``,"hash":"<64 hex digits>"}``: the
SHA-256 of the line's bytes before that suffix (docs/ledger-format.md). The encoders here are
the only writers of that layout; the reader accepts a line only if re-encoding its values
gives it back byte for byte (:mod:`dpledger.ledger.decoding`).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
from typing import Any

import attrs

from dpledger.errors import InvalidParameterError
from dpledger.ledger.correlated import CorrelatedReleaseEvent, StreamStepEvent
from dpledger.ledger.events import NeighboringRelation, SamplingEvent

__all__ = [
    "CORRELATED_SCHEMA",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "GENESIS_HASH",
    "HEADER_MAGIC",
    "MAX_METADATA_DEPTH",
    "STREAM_STEP_SCHEMA",
    "SUPPORTED_FORMAT_VERSIONS",
    "LedgerHeader",
    "correlated_release_body",
    "dump_metadata",
    "encode_event",
    "encode_header",
    "encode_label",
    "encode_marker",
    "encode_sample",
    "encode_sampling_event",
    "encode_sum_query",
    "line_hash",
    "sample_body",
    "sampling_event_body",
    "stream_step_body",
    "sum_query_body",
    "utc_timestamp",
]

FORMAT_NAME = "dpledger-ledger"
FORMAT_VERSION = 2
"""The version this module writes. Version 2 adds sampling events of the schemes beyond Poisson
and full batch, and of user-level units (the extended ``sample`` line); a version-1 file holds
only the classic ``sample`` line, which version 2 writes unchanged. A version-2 file may also
hold ``correlated_release`` and ``stream_step`` lines, which carry their own record schema
versions (:data:`CORRELATED_SCHEMA`, :data:`STREAM_STEP_SCHEMA`): a reader that does not know
the kind refuses the file, so it can never misread one."""
SUPPORTED_FORMAT_VERSIONS = (1, 2)
"""The versions this module reads."""
CORRELATED_SCHEMA = 1
"""The schema version of the ``correlated_release`` line this module writes and reads."""
STREAM_STEP_SCHEMA = 1
"""The schema version of the ``stream_step`` line this module writes and reads."""
GENESIS_HASH = "0" * 64
HEADER_MAGIC = b'{"format":"' + FORMAT_NAME.encode() + b'",'
MAX_METADATA_DEPTH = 64  # nesting levels of metadata, the dict itself included
_SHOWN_CHARS = 80  # how much of a rejected value an error message quotes


def utc_timestamp() -> str:
    """Current UTC time as ISO 8601 with microseconds and a ``Z`` suffix."""
    now = _dt.datetime.now(_dt.timezone.utc)
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def line_hash(content: bytes) -> str:
    """The hash of a line: SHA-256 (lowercase hex) of its bytes before ``,"hash":``."""
    return hashlib.sha256(content).hexdigest()


def _seal(content: str) -> tuple[bytes, str]:
    """Append the hash suffix to a line's content; return (line bytes with newline, hash)."""
    raw = content.encode("ascii")
    digest = hashlib.sha256(raw).hexdigest()
    return raw + b',"hash":"' + digest.encode("ascii") + b'"}\n', digest


def _json_text(value: Any) -> str:
    """Compact, key-sorted, ASCII JSON; refuses NaN and infinities."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def dump_metadata(metadata: Any, *, parameter: str = "metadata") -> str:
    """Serialise user metadata as compact JSON, refusing what JSON cannot carry exactly."""
    if not isinstance(metadata, dict):
        raise InvalidParameterError(parameter, metadata, "a dict of JSON-serialisable values")
    if _nesting_depth(metadata) > MAX_METADATA_DEPTH:
        raise InvalidParameterError(
            parameter,
            _Shown(metadata),
            f"a dict nested at most {MAX_METADATA_DEPTH} levels deep (readers refuse deeper ones)",
        )
    try:
        text = _json_text(metadata)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidParameterError(
            parameter, metadata, f"a dict of JSON-serialisable values with string keys ({exc})"
        ) from None
    # What JSON cannot carry exactly (tuples, non-string keys, subclasses of str/int/float) would
    # come back different; refuse it rather than store something else than what was given.
    if json.loads(text) != metadata or _json_text(json.loads(text)) != text:
        raise InvalidParameterError(
            parameter,
            metadata,
            "a dict that survives a JSON round trip unchanged (string keys, no tuples)",
        )
    return text


def encode_label(label: str | None) -> str:
    """A sum-query label as it appears in a line: a JSON string (ASCII escapes) or ``null``."""
    return "null" if label is None else json.dumps(label)


def encode_header(
    *,
    neighboring: NeighboringRelation,
    metadata: dict[str, Any],
    library_version: str,
    created: str,
    format_version: int = FORMAT_VERSION,
) -> tuple[bytes, str]:
    """The header line (seq 0), with its newline, and its hash (``format_version`` other than
    the current one only to re-encode an older file's header when verifying it)."""
    content = (
        f'{{"format":"{FORMAT_NAME}","format_version":{format_version},"seq":0,'
        f'"prev":"{GENESIS_HASH}","kind":"header","library_version":{json.dumps(library_version)},'
        f'"created":{json.dumps(created)},"neighboring":"{neighboring.value}",'
        f'"metadata":{_json_text(metadata)}'
    )
    return _seal(content)


def sample_body(sampling_probability: float, population_size: int | None, scheme: str) -> str:
    """The part of a sampling-event line between ``"kind":"`` and ``,"hash":``.

    Floats use repr(), the shortest exact round trip; -0.0 is written as 0.0.
    """
    n = "null" if population_size is None else str(population_size)
    return (
        f'sample","sampling_probability":{sampling_probability + 0.0!r},'
        f'"population_size":{n},"scheme":"{scheme}"'
    )


def _optional_int(value: int | None) -> str:
    return "null" if value is None else str(value)


def sampling_event_body(event: SamplingEvent) -> str:
    """The body of a sampling-event line for any event (format version 2).

    A record-level Poisson or full-batch event is written exactly as :func:`sample_body` writes
    it (the version-1 line); any other event gets the extended line, which names every field of
    :class:`~dpledger.ledger.events.SamplingEvent` (null where the scheme does not use it).
    """
    if event.is_classic:
        return sample_body(event.sampling_probability, event.population_size, event.scheme.value)
    return (
        sample_body(event.sampling_probability, event.population_size, event.scheme.value)
        + f',"batch_size":{_optional_int(event.batch_size)}'
        f',"max_batch_size":{_optional_int(event.max_batch_size)}'
        f',"num_batches":{_optional_int(event.num_batches)}'
        f',"epoch_start":{"true" if event.epoch_start else "false"}'
        f',"unit":"{event.unit.value}"'
    )


def sum_query_body(l2_norm_bound: float, noise_stddev: float, label_json: str) -> str:
    """The part of a sum-query line between ``"kind":"`` and ``,"hash":``."""
    return (
        f'sum_query","l2_norm_bound":{l2_norm_bound + 0.0!r},'
        f'"noise_stddev":{noise_stddev + 0.0!r},"label":{label_json}'
    )


def _bool(value: bool) -> str:
    return "true" if value else "false"


def correlated_release_body(event: CorrelatedReleaseEvent) -> str:
    """The part of a ``correlated_release`` line between ``"kind":"`` and ``,"hash":``: the
    record schema (:data:`CORRELATED_SCHEMA`), then every field of the event in its attribute
    order, ``strategy_params`` as compact key-sorted JSON."""
    e = event
    return (
        f'correlated_release","schema":{CORRELATED_SCHEMA},"strategy":{json.dumps(e.strategy)},'
        f'"strategy_params":{_json_text(e.strategy_params)},'
        f'"strategy_hash":"{e.strategy_hash}","num_steps":{e.num_steps},'
        f'"participation":"{e.participation}","max_participations":{e.max_participations},'
        f'"min_separation":{e.min_separation},"sampling":"{e.sampling}",'
        f'"sampling_probability":{e.sampling_probability + 0.0!r},'
        f'"bands":{_optional_int(e.bands)},"l2_norm_bound":{e.l2_norm_bound + 0.0!r},'
        f'"noise_stddev":{e.noise_stddev + 0.0!r},"sensitivity":{e.sensitivity + 0.0!r},'
        f'"sensitivity_exact":{_bool(e.sensitivity_exact)},'
        f'"max_column_norm":{e.max_column_norm + 0.0!r},"label":{encode_label(e.label)}'
    )


def stream_step_body(event: StreamStepEvent) -> str:
    """The part of a ``stream_step`` line between ``"kind":"`` and ``,"hash":``: the record
    schema (:data:`STREAM_STEP_SCHEMA`), the release's index and the step's index."""
    return (
        f'stream_step","schema":{STREAM_STEP_SCHEMA},"release":{event.release},"step":{event.step}'
    )


def encode_event(seq: int, prev: str, body: str) -> tuple[bytes, str]:
    """An event line from its sequence number, previous hash and body; and its hash."""
    raw = f'{{"seq":{seq},"prev":"{prev}","kind":"{body}'.encode("ascii")
    digest = hashlib.sha256(raw).hexdigest()
    return raw + b',"hash":"' + digest.encode("ascii") + b'"}\n', digest


def encode_sample(
    seq: int, prev: str, sampling_probability: float, population_size: int | None, scheme: str
) -> tuple[bytes, str]:
    """A sampling-event line and its hash."""
    return encode_event(seq, prev, sample_body(sampling_probability, population_size, scheme))


def encode_sampling_event(seq: int, prev: str, event: SamplingEvent) -> tuple[bytes, str]:
    """A sampling-event line for any event (see :func:`sampling_event_body`) and its hash."""
    return encode_event(seq, prev, sampling_event_body(event))


def encode_sum_query(
    seq: int, prev: str, l2_norm_bound: float, noise_stddev: float, label_json: str
) -> tuple[bytes, str]:
    """A sum-query-event line and its hash; ``label_json`` is :func:`encode_label`'s output."""
    return encode_event(seq, prev, sum_query_body(l2_norm_bound, noise_stddev, label_json))


def encode_marker(seq: int, prev: str, kind: str, fields: dict[str, Any]) -> tuple[bytes, str]:
    """A marker line (``resume``, ``note`` or ``close``) and its hash; fields in the given order."""
    extra = "".join(f",{json.dumps(k)}:{_json_text(v)}" for k, v in fields.items())
    return _seal(f'{{"seq":{seq},"prev":"{prev}","kind":"{kind}"{extra}')


@attrs.frozen
class LedgerHeader:
    """What a ledger says about itself (its header line).

    Attributes:
        neighboring: the neighboring relation the ledger's guarantee is stated for.
        metadata: user metadata given when the ledger was created (JSON values).
        created: creation time, ISO 8601 UTC.
        library_version: the dpledger version that created the ledger.
        format_version: the file-format version (1 or 2; see :data:`FORMAT_VERSION`).
    """

    neighboring: NeighboringRelation
    metadata: dict[str, Any]
    created: str
    library_version: str
    format_version: int = FORMAT_VERSION


class _Shown:
    """A value whose repr is cut to :data:`_SHOWN_CHARS` characters, for error messages."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return _show(self.value)


def _show(value: Any) -> str:
    """``repr(value)``, shortened so that an error message stays one readable line."""
    try:
        text = repr(value)
    except (RecursionError, ValueError):  # deep nesting; an int beyond the str conversion limit
        text = f"<a {type(value).__name__} too large to show>"
    if len(text) > _SHOWN_CHARS:
        text = f"{text[: _SHOWN_CHARS - 25]}… ({len(text)} characters)"
    return text


def _nesting_depth(value: Any, limit: int = MAX_METADATA_DEPTH) -> int:
    """Depth of nested dicts and lists in ``value`` (a scalar is 0), counted up to ``limit + 1``."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if depth > limit:
            return depth
        stack.extend((child, depth + 1) for child in children)
    return deepest
