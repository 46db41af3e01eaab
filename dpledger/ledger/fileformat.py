"""The ledger file format: JSON Lines with a SHA-256 hash chain (see docs/ledger-format.md).

Every line is one JSON object in ASCII, written in one fixed layout that ends with
``,"hash":"<64 hex digits>"}``. The hash is the SHA-256 of the line's bytes up to (not including)
that ``,"hash":`` suffix, and every line names the previous line's hash in its ``"prev"`` field,
so a reader in any language can check the chain without canonical JSON.

Line 1 is the header (``"kind":"header"``, ``"seq":0``, ``"prev"`` = 64 zeros). Then come events
(``"sample"``, ``"sum_query"``) and session markers (``"resume"`` when a writer reopens the file,
``"close"`` when it closes it cleanly), numbered by ``"seq"`` 1, 2, 3, …

The reader accepts exactly what the writer writes: a line must be byte for byte the line the
writer would produce from the values it holds (field order, no spaces, floats in Python's
shortest round-trip ``repr``, no duplicate keys). That leaves no two readings of one verified file.
Lines written by this module's encoders are parsed by one precompiled regular expression (the
fast path); anything else is decoded with :func:`json.loads` and checked field by field, which
either accepts the line with identical values or names what is wrong with it.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import re
from collections.abc import Callable
from typing import IO, Any

import attrs

from dpledger.errors import InvalidParameterError, LedgerVerificationError, NotALedgerError
from dpledger.ledger.events import NeighboringRelation, SamplingEvent

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "GENESIS_HASH",
    "HEADER_MAGIC",
    "MAX_METADATA_DEPTH",
    "SUPPORTED_FORMAT_VERSIONS",
    "LedgerHeader",
    "LedgerReader",
    "TornTail",
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
    "sum_query_body",
    "utc_timestamp",
]

FORMAT_NAME = "dpledger-ledger"
FORMAT_VERSION = 2
"""The version this module writes. Version 2 adds sampling events of the schemes beyond Poisson
and full batch, and of user-level units (the extended ``sample`` line); a version-1 file holds
only the classic ``sample`` line, which version 2 writes unchanged."""
SUPPORTED_FORMAT_VERSIONS = (1, 2)
"""The versions this module reads."""
GENESIS_HASH = "0" * 64
HEADER_MAGIC = b'{"format":"' + FORMAT_NAME.encode() + b'",'
_SUFFIX_START = b',"hash":"'
_SUFFIX_LEN = len(_SUFFIX_START) + 64 + 2  # ,"hash":"<64 hex>"}
_HEX64 = re.compile(rb"[0-9a-f]{64}")
_BLOCK_SIZE = 1 << 20
MAX_METADATA_DEPTH = 64  # nesting levels of metadata, the dict itself included
_SHOWN_CHARS = 80  # how much of a rejected value an error message quotes
_MAX_FAST_DIGITS = 640  # population sizes longer than this are left to the slow path
_CACHE_LIMIT = 4096

_HEADER_FIELDS = (
    "format",
    "format_version",
    "seq",
    "prev",
    "kind",
    "library_version",
    "created",
    "neighboring",
    "metadata",
    "hash",
)
_SAMPLE_FIELDS = (
    "seq",
    "prev",
    "kind",
    "sampling_probability",
    "population_size",
    "scheme",
    "hash",
)
_QUERY_FIELDS = ("seq", "prev", "kind", "l2_norm_bound", "noise_stddev", "label", "hash")
_RESUME_FIELDS = ("seq", "prev", "kind", "time", "library_version", "hash")
_RESUME_FIELDS_META = ("seq", "prev", "kind", "time", "library_version", "metadata", "hash")
_CLOSE_FIELDS = ("seq", "prev", "kind", "time", "events", "steps", "hash")
_SAMPLE_FIELDS_EXT = (
    "seq",
    "prev",
    "kind",
    "sampling_probability",
    "population_size",
    "scheme",
    "batch_size",
    "max_batch_size",
    "num_batches",
    "epoch_start",
    "unit",
    "hash",
)

# How the two event kinds' lines continue after ``"kind":"`` (the fast path of the reader).
_SAMPLE_START = b'sample","sampling_probability":'
_SAMPLE_LEN = len(_SAMPLE_START)
_QUERY_START = b'sum_query","l2_norm_bound":'
_QUERY_LEN = len(_QUERY_START)


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
    """A session-marker line (``resume`` or ``close``) and its hash; fields in the given order."""
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


@attrs.frozen
class TornTail:
    """An incomplete last line, as left by a writer that stopped mid-write.

    Attributes:
        line_number: 1-based number the line would have had.
        offset: byte offset where the incomplete line starts (the length of the valid prefix).
        length: number of bytes in the incomplete line.
    """

    line_number: int
    offset: int
    length: int

    def describe(self) -> str:
        """One sentence for warnings and the CLI."""
        return (
            f"line {self.line_number} is incomplete ({self.length} bytes from offset "
            f"{self.offset}, no final newline): the writer stopped mid-write; it was ignored"
        )


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


class _Unreadable:
    """A JSON value Python cannot hold exactly: an integer beyond the int-string conversion
    limit, or a ``NaN``/``Infinity`` literal. Decoding yields this instead of raising, so that
    the field checks name the field that holds it."""

    def __init__(self, description: str) -> None:
        self.description = description

    def __repr__(self) -> str:
        return self.description


def _parse_int(text: str) -> int | _Unreadable:
    try:
        return int(text)
    except ValueError:  # more digits than sys.get_int_max_str_digits() allows
        return _Unreadable(f"<an integer of {len(text)} digits>")


def _parse_constant(name: str) -> _Unreadable:
    return _Unreadable(f"{name} (not a JSON number)")


def _nested_field(text: str) -> str:
    """`` in "<key>"`` for the first field of a line whose value is an object or an array."""
    match = _NESTED_FIELD.search(text)
    return f' in "{match.group(1)[:_SHOWN_CHARS]}"' if match else ""


_NESTED_FIELD = re.compile(r'"((?:[^"\\]|\\.)*)":[\[{]')


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


def _metadata_problem(value: Any) -> str | None:
    """Why a decoded metadata object cannot be what a writer wrote, or None if it can be."""
    if not isinstance(value, dict):
        return "is not a JSON object"
    if _nesting_depth(value) > MAX_METADATA_DEPTH:
        return f"is nested more than {MAX_METADATA_DEPTH} levels deep"
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, _Unreadable):
            return f"holds {item!r}, which is not a finite JSON number"
        elif isinstance(item, float) and not math.isfinite(item):
            return f"holds the number {item!r} (out of the float range)"
    return None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _canonical_number(cache: dict[bytes, float], text: bytes) -> float | None:
    """The finite float written as ``text`` if ``text`` is its canonical form (repr, no -0.0)."""
    try:
        x = float(text)
    except ValueError:
        return None
    if not math.isfinite(x) or repr(x + 0.0).encode("ascii") != text:
        return None
    if len(cache) >= _CACHE_LIMIT:
        cache.clear()
    cache[text] = x
    return x


_NOT_CANONICAL = object()


def _canonical_label(cache: dict[bytes, Any], text: bytes) -> Any:
    """The label written as the JSON string ``text``, or ``_NOT_CANONICAL``."""
    try:
        label = json.loads(text)
    except (ValueError, RecursionError):  # invalid UTF-8, bad escapes, deep nesting
        return _NOT_CANONICAL
    if not isinstance(label, str) or json.dumps(label).encode("ascii") != text:
        return _NOT_CANONICAL
    if len(cache) >= _CACHE_LIMIT:
        cache.clear()
    cache[text] = label
    return label


def _parse_extended_sample(body: bytes) -> tuple[bool, Any, Any, Any, Any] | None:
    """Parse an extended (version 2) sampling-event body, or None unless it is exactly what
    :func:`sampling_event_body` writes for a valid event."""
    try:
        obj = json.loads(b'{"kind":"' + body + b"}", object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or tuple(obj) != ("kind", *_SAMPLE_FIELDS_EXT[3:-1]):
        return None
    try:
        event = _extended_event(obj)
    except (InvalidParameterError, TypeError):
        return None
    if event.is_classic or sampling_event_body(event).encode("ascii") != body:
        return None
    return (True, event.sampling_probability, event.population_size, event.scheme.value, event)


def _extended_event(obj: dict[str, Any]) -> SamplingEvent:
    """The event an extended sample line's decoded fields describe (raises if invalid)."""
    q = obj["sampling_probability"]
    if not _is_number(q):
        raise InvalidParameterError("sampling_probability", q, "a finite number")
    for key in ("population_size", "batch_size", "max_batch_size", "num_batches"):
        value = obj[key]
        if value is not None and type(value) is not int:
            raise InvalidParameterError(key, value, "null or an integer")
    if type(obj["epoch_start"]) is not bool:
        raise InvalidParameterError("epoch_start", obj["epoch_start"], "true or false")
    if not isinstance(obj["scheme"], str) or not isinstance(obj["unit"], str):
        raise InvalidParameterError("scheme", obj["scheme"], "a string")
    return SamplingEvent(
        float(q),
        obj["population_size"],
        obj["scheme"],
        batch_size=obj["batch_size"],
        max_batch_size=obj["max_batch_size"],
        num_batches=obj["num_batches"],
        epoch_start=obj["epoch_start"],
        unit=obj["unit"],
    )


def _parse_event_body(
    body: bytes, numbers: dict[bytes, float], labels: dict[bytes, Any]
) -> tuple[Any, ...] | None:
    """Parse the part of an event line between ``"kind":"`` and ``,"hash":``.

    Returns ``(True, q, n, scheme)`` for a classic sampling event, ``(True, q, n, scheme,
    event)`` for an extended one, ``(False, S, sigma, label)`` for a sum query, or None unless
    the body is exactly what the encoders write for valid values.
    """
    if body[:_SAMPLE_LEN] == _SAMPLE_START:
        parts = body[_SAMPLE_LEN:].split(b",")
        if len(parts) != 3:
            return _parse_extended_sample(body) if len(parts) == 8 else None
        q_t, n_t, sch_t = parts
        q = numbers.get(q_t)
        if q is None:
            q = _canonical_number(numbers, q_t)
        if q is None or not 0.0 <= q <= 1.0 or n_t[:18] != b'"population_size":':
            return None
        n_t = n_t[18:]
        if n_t == b"null":
            n = None
        elif n_t.isdigit() and n_t[:1] != b"0" and len(n_t) <= _MAX_FAST_DIGITS:
            n = int(n_t)
        else:
            return None
        if sch_t == b'"scheme":"poisson"':
            return (True, q, n, "poisson")
        if sch_t == b'"scheme":"full"' and q == 1.0:
            return (True, q, n, "full")
        return None
    if body[:_QUERY_LEN] == _QUERY_START:
        parts = body[_QUERY_LEN:].split(b",", 2)
        if len(parts) != 3 or parts[1][:15] != b'"noise_stddev":' or parts[2][:8] != b'"label":':
            return None
        s_t, sig_t, lab_t = parts[0], parts[1][15:], parts[2][8:]
        s = numbers.get(s_t)
        if s is None:
            s = _canonical_number(numbers, s_t)
        sigma = numbers.get(sig_t)
        if sigma is None:
            sigma = _canonical_number(numbers, sig_t)
        if s is None or not s > 0.0 or sigma is None or not sigma >= 0.0:
            return None
        if lab_t == b"null":
            return (False, s, sigma, None)
        label = labels.get(lab_t, _NOT_CANONICAL)
        if label is _NOT_CANONICAL:
            label = _canonical_label(labels, lab_t)
            if label is _NOT_CANONICAL:
                return None
        return (False, s, sigma, label)
    return None


def _complete_line(raw: bytes) -> bool:
    """True if ``raw`` ends with a hash suffix that matches its content."""
    return (
        len(raw) > _SUFFIX_LEN
        and raw[-_SUFFIX_LEN : -_SUFFIX_LEN + 9] == _SUFFIX_START
        and raw[-2:] == b'"}'
        and hashlib.sha256(raw[:-_SUFFIX_LEN]).hexdigest().encode("ascii") == raw[-66:-2]
    )


def _noop(*_args: Any) -> None:
    return None


class LedgerReader:
    """Reads and verifies a ledger file, calling back for every record.

    :meth:`read` goes through the file once, in blocks, and checks every line as it comes: its
    hash, its sequence number, its link to the previous line, its values, the order rules
    (a sum query needs a sampling event in the same session; after a close marker only a resume
    marker may follow) and its layout. The first line that fails raises
    :class:`~dpledger.errors.LedgerVerificationError` naming it; a file whose first line is not a
    dpledger header raises :class:`~dpledger.errors.NotALedgerError`.

    An incomplete final line (no newline, no matching hash) that is the beginning of the line the
    writer would have written next is a torn tail: it is not used and is reported in
    :attr:`torn_tail`. A final line that lacks only its newline is complete and is used.

    Attributes (after :meth:`read`):
        header: the decoded header, or None when the header itself is incomplete.
        header_torn: True when the file holds no complete header (empty, or cut in line 1).
        torn_tail: the incomplete final line, or None.
        valid_length: byte length of the verified prefix.
        head_hash: hash of the last verified line (64 zeros if none).
        last_seq: sequence number of the last verified line (-1 if none).
        last_kind: kind of the last verified line (None if none).
        missing_newline: the last verified line has no final newline.
        num_events: sampling and sum-query events in the verified prefix.
        num_steps: sampling events in the verified prefix.
    """

    def __init__(self, fp: IO[bytes], *, path: str | None = None, fast: bool = True) -> None:
        self._fp = fp
        self.path = path
        self._fast = fast
        self.header: LedgerHeader | None = None
        self.header_torn = False
        self.torn_tail: TornTail | None = None
        self.valid_length = 0
        self.head_hash = GENESIS_HASH
        self.last_seq = -1
        self.last_kind: str | None = None
        self.missing_newline = False
        self.num_events = 0
        self.num_steps = 0
        self._step_open = False

    @property
    def closed(self) -> bool:
        """True when the verified prefix ends with a close marker."""
        return self.last_kind == "close"

    # ---------------------------------------------------------------- reading
    def read(
        self,
        *,
        on_sample: Callable[[float, int | None, str], Any] = _noop,
        on_query: Callable[[float, float, str | None], Any] = _noop,
        on_marker: Callable[[str, dict[str, Any]], Any] = _noop,
    ) -> LedgerReader:
        """Verify the whole file, calling ``on_sample(q, n, scheme)`` (``on_sample(q, n, scheme,
        event)`` with the :class:`~dpledger.ledger.events.SamplingEvent` for an extended sampling
        event), ``on_query(S, sigma, label)`` and ``on_marker(kind, fields)`` for its records in
        order.
        """
        fp = self._fp
        fast = self._fast
        sha256 = hashlib.sha256
        numbers: dict[bytes, float] = {}
        labels: dict[bytes, Any] = {}
        bodies: dict[bytes, tuple[bool, Any, Any, Any]] = {}
        head = self.head_hash.encode("ascii")
        seq = self.last_seq
        step_open = self._step_open
        closed = self.last_kind == "close"
        num_events = self.num_events
        num_steps = self.num_steps
        line_number = 0
        offset = 0
        pending = b""
        last_kind = self.last_kind
        first_block = True
        extended_ok = self.header is not None and self.header.format_version >= 2
        while True:
            block = fp.read(_BLOCK_SIZE)
            if not block:
                break
            if first_block:
                first_block = False
                if not HEADER_MAGIC.startswith(block[: len(HEADER_MAGIC)]):
                    raise self._not_a_ledger()
            if pending:
                block = pending + block
            lines = block.split(b"\n")
            pending = lines.pop()
            for raw in lines:
                line_number += 1
                # Fast path: an event line exactly as encode_sample / encode_sum_query write
                # it. Its start is fixed by the state (seq and prev), its end by its hash; the
                # body between them repeats from step to step, so its parse is cached.
                if fast and not closed:
                    start = b'{"seq":%d,"prev":"%s","kind":"' % (seq + 1, head)
                    if (
                        raw.startswith(start)
                        and raw[-75:-66] == _SUFFIX_START
                        and raw[-2:] == b'"}'
                        and sha256(raw[:-75]).hexdigest().encode() == raw[-66:-2]
                    ):
                        body = raw[len(start) : -75]
                        rec = bodies.get(body)
                        if rec is None:
                            rec = _parse_event_body(body, numbers, labels)
                            if rec is not None:
                                if len(bodies) >= _CACHE_LIMIT:
                                    bodies.clear()
                                bodies[body] = rec
                        if rec is not None and (len(rec) == 4 or extended_ok):
                            if rec[0]:  # a sampling event
                                on_sample(*rec[1:])
                                step_open = True
                                num_steps += 1
                                num_events += 1
                                last_kind = "sample"
                                head = raw[-66:-2]
                                seq += 1
                                offset += len(raw) + 1
                                continue
                            if step_open:
                                on_query(rec[1], rec[2], rec[3])
                                num_events += 1
                                last_kind = "sum_query"
                                head = raw[-66:-2]
                                seq += 1
                                offset += len(raw) + 1
                                continue
                # Not a well-formed event line: decode it the slow way, which accepts it with
                # the same values or raises naming what is wrong.
                kind, value, digest = self._decode(
                    raw, line_number, seq, head, step_open, closed, num_events, num_steps
                )
                if kind == "sample":
                    on_sample(*value)
                    step_open = True
                    num_steps += 1
                    num_events += 1
                elif kind == "sum_query":
                    on_query(*value)
                    num_events += 1
                elif kind == "header":
                    self.header = value
                    extended_ok = value.format_version >= 2
                else:
                    on_marker(kind, value)
                    step_open = False
                closed = kind == "close"
                last_kind = kind
                head = digest
                seq += 1
                offset += len(raw) + 1
        if pending:
            line_number += 1
            # Fold the state in first: the final line is judged against it.
            self._store(head, seq, last_kind, step_open, num_events, num_steps, offset)
            self._read_last(pending, line_number, offset, on_sample, on_query, on_marker)
            return self
        if line_number == 0:
            self.header_torn = True  # an empty file: the writer died before its header
        self._store(head, seq, last_kind, step_open, num_events, num_steps, offset)
        return self

    def _store(
        self,
        head: bytes,
        seq: int,
        last_kind: str | None,
        step_open: bool,
        num_events: int,
        num_steps: int,
        offset: int,
    ) -> None:
        self.head_hash = head.decode("ascii")
        self.last_seq = seq
        self.last_kind = last_kind
        self._step_open = step_open
        self.num_events = num_events
        self.num_steps = num_steps
        self.valid_length = offset

    def _read_last(
        self,
        raw: bytes,
        line_number: int,
        offset: int,
        on_sample: Callable[..., Any],
        on_query: Callable[..., Any],
        on_marker: Callable[..., Any],
    ) -> None:
        """A final line without newline: used if it verifies, else maybe a torn tail."""
        if line_number == 1 and len(raw) < len(HEADER_MAGIC):
            # A prefix of the magic (the first block check refused anything else).
            self.torn_tail = TornTail(line_number=1, offset=0, length=len(raw))
            self.header_torn = True
            return
        head = self.head_hash.encode("ascii")
        try:
            kind, value, digest = self._decode(
                raw,
                line_number,
                self.last_seq,
                head,
                self._step_open,
                self.last_kind == "close",
                self.num_events,
                self.num_steps,
            )
        except LedgerVerificationError:
            if _complete_line(raw):
                raise  # a whole line that is wrong: not a crash
            if line_number == 1:
                expected = _header_prefix()
                older = _header_prefix(1)
                if raw[: min(len(raw), len(older))] == older[: len(raw)]:
                    expected = older  # a version-1 writer's torn header
            else:
                expected = b'{"seq":%d,"prev":"%s","kind":"' % (self.last_seq + 1, head)
            k = min(len(raw), len(expected))
            if raw[:k] != expected[:k]:
                raise LedgerVerificationError(
                    "incomplete last line that is not the beginning of the next line "
                    f"(expected it to start with {expected.decode('ascii')!r})",
                    line_number=line_number,
                    path=self.path,
                ) from None
            self.torn_tail = TornTail(line_number=line_number, offset=offset, length=len(raw))
            self.header_torn = line_number == 1
            return
        if kind == "sample":
            on_sample(*value)
            self._step_open = True
            self.num_steps += 1
            self.num_events += 1
        elif kind == "sum_query":
            on_query(*value)
            self.num_events += 1
        elif kind == "header":
            self.header = value
        else:
            on_marker(kind, value)
            self._step_open = False
        self.last_kind = kind
        self.last_seq += 1
        self.head_hash = digest.decode("ascii")
        self.valid_length = offset + len(raw)
        self.missing_newline = True

    # ---------------------------------------------------------------- one line, slowly
    def _not_a_ledger(self) -> NotALedgerError:
        return NotALedgerError(
            f"{self.path or 'the file'} is not a dpledger ledger (it does not start with "
            f"{HEADER_MAGIC.decode()!r})",
            path=self.path,
        )

    def _decode(
        self,
        raw: bytes,
        line_number: int,
        seq: int,
        head: bytes,
        step_open: bool,
        closed: bool,
        num_events: int,
        num_steps: int,
    ) -> tuple[str, Any, bytes]:
        """Check one complete line (without newline) against the state before it.

        Returns ``(kind, value, hash)`` where value is a LedgerHeader for the header,
        ``(q, n, scheme)`` for a sample, ``(S, sigma, label)`` for a sum query and the marker's
        fields (a dict without seq, prev, kind and hash) for a marker.
        """

        def fail(reason: str) -> LedgerVerificationError:
            return LedgerVerificationError(reason, line_number=line_number, path=self.path)

        if line_number == 1 and not raw.startswith(HEADER_MAGIC):
            raise self._not_a_ledger()
        if not (
            len(raw) > _SUFFIX_LEN
            and raw[-_SUFFIX_LEN : -_SUFFIX_LEN + 9] == _SUFFIX_START
            and raw[-2:] == b'"}'
            and _HEX64.fullmatch(raw[-66:-2])
        ):
            raise fail('does not end with the suffix ,"hash":"<64 lowercase hex digits>"}')
        digest = raw[-66:-2]
        if hashlib.sha256(raw[:-_SUFFIX_LEN]).hexdigest().encode("ascii") != digest:
            raise fail("its hash does not match its content (the line was edited)")
        try:
            text = raw.decode("ascii")
        except UnicodeDecodeError:
            raise fail("contains bytes that are not ASCII (dpledger writes ASCII only)") from None
        try:
            obj = json.loads(
                text,
                object_pairs_hook=_unique_keys,
                parse_int=_parse_int,
                parse_constant=_parse_constant,
            )
        except ValueError as exc:
            raise fail(f"is not valid JSON ({exc})") from None
        except RecursionError:
            raise fail(
                f"nests JSON values too deeply to decode{_nested_field(text)} (a writer nests "
                f"metadata at most {MAX_METADATA_DEPTH} levels deep)"
            ) from None
        if not isinstance(obj, dict):
            raise fail("is not a JSON object")
        if line_number == 1:
            version = obj.get("format_version")
            if type(version) is not int or version not in SUPPORTED_FORMAT_VERSIONS:
                raise fail(
                    f"format_version {_show(version)} is not supported (this reader knows "
                    f"versions {', '.join(map(str, SUPPORTED_FORMAT_VERSIONS))})"
                )
        got_seq = obj.get("seq")
        if type(got_seq) is not int or got_seq != seq + 1:
            raise fail(
                f"sequence number {_show(got_seq)}, expected {seq + 1} "
                "(a line was deleted, inserted, duplicated or moved)"
            )
        prev = head.decode("ascii")
        if obj.get("prev") != prev:
            raise fail(
                "does not chain to the previous line's hash "
                "(a line before it was changed, deleted, inserted or moved)"
            )
        kind = obj.get("kind")
        value: Any
        if line_number == 1:
            value = self._check_header(obj, fail)
            expected, _ = encode_header(
                neighboring=value.neighboring,
                metadata=value.metadata,
                library_version=value.library_version,
                created=value.created,
                format_version=value.format_version,
            )
        elif kind == "header":
            raise fail("a second header")
        elif closed and kind != "resume":
            raise fail(
                f"a {_show(kind)} record after the close marker "
                "(only a resume marker may follow it)"
            )
        elif kind == "sample" and tuple(obj) == _SAMPLE_FIELDS_EXT:
            version = self.header.format_version if self.header is not None else FORMAT_VERSION
            if version < 2:
                raise fail(
                    "an extended sampling event (a scheme beyond Poisson and full batch, or a "
                    "user-level unit) in a format-version-1 file, which cannot hold one"
                )
            try:
                event = _extended_event(obj)
            except InvalidParameterError as exc:
                raise fail(f"the sampling event is invalid: {exc}") from None
            value = (event.sampling_probability, event.population_size, event.scheme.value, event)
            expected, _ = encode_sampling_event(seq + 1, prev, event)
        elif kind == "sample":
            _check_fields(obj, _SAMPLE_FIELDS, fail)
            q = obj["sampling_probability"]
            n = obj["population_size"]
            scheme = obj["scheme"]
            if not (_is_number(q) and 0.0 <= q <= 1.0):
                raise fail(f"sampling_probability {_show(q)} is not a number in [0, 1]")
            if n is not None and (type(n) is not int or n < 1):
                raise fail(f"population_size {_show(n)} is neither null nor an integer >= 1")
            if not isinstance(scheme, str) or scheme not in ("poisson", "full"):
                raise fail(f"scheme {_show(scheme)} is not 'poisson' or 'full'")
            if scheme == "full" and q != 1.0:
                raise fail(f"scheme 'full' needs sampling_probability 1.0, not {q!r}")
            value = (float(q), n, scheme)
            expected, _ = encode_sample(seq + 1, prev, float(q), n, scheme)
        elif kind == "sum_query":
            _check_fields(obj, _QUERY_FIELDS, fail)
            s = obj["l2_norm_bound"]
            sigma = obj["noise_stddev"]
            label = obj["label"]
            if not (_is_number(s) and s > 0.0):
                raise fail(f"l2_norm_bound {_show(s)} is not a finite number > 0")
            if not (_is_number(sigma) and sigma >= 0.0):
                raise fail(f"noise_stddev {_show(sigma)} is not a finite number >= 0")
            if label is not None and not isinstance(label, str):
                raise fail(f"label {_show(label)} is neither null nor a string")
            if not step_open:
                raise fail("a sum query with no sampling event before it in its session")
            value = (float(s), float(sigma), label)
            expected, _ = encode_sum_query(
                seq + 1, prev, float(s), float(sigma), encode_label(label)
            )
        elif kind == "resume":
            has_meta = "metadata" in obj
            _check_fields(obj, _RESUME_FIELDS_META if has_meta else _RESUME_FIELDS, fail)
            for key in ("time", "library_version"):
                if not isinstance(obj[key], str):
                    raise fail(f"{key} {_show(obj[key])} is not a string")
            problem = _metadata_problem(obj["metadata"]) if has_meta else None
            if problem is not None:
                raise fail(f"the resume marker's metadata {problem}")
            value = {k: obj[k] for k in _RESUME_FIELDS_META[3:-1] if k in obj}
            expected, _ = encode_marker(seq + 1, prev, "resume", value)
        elif kind == "close":
            _check_fields(obj, _CLOSE_FIELDS, fail)
            if not isinstance(obj["time"], str):
                raise fail(f"time {_show(obj['time'])} is not a string")
            if type(obj["events"]) is not int or obj["events"] != num_events:
                raise fail(
                    f"the close marker counts {_show(obj['events'])} events, the lines before it "
                    f"hold {num_events}"
                )
            if type(obj["steps"]) is not int or obj["steps"] != num_steps:
                raise fail(
                    f"the close marker counts {_show(obj['steps'])} steps, the lines before it "
                    f"hold {num_steps}"
                )
            value = {k: obj[k] for k in _CLOSE_FIELDS[3:-1]}
            expected, _ = encode_marker(seq + 1, prev, "close", value)
        else:
            raise fail(f"unknown record kind {_show(kind)}")
        if expected[:-1] != raw:
            raise fail(
                "is not in the exact layout dpledger writes (field order, spacing or number "
                "format differ): the line was rewritten"
            )
        # every branch above that did not raise matched ``kind`` against a string
        return ("header" if line_number == 1 else str(kind)), value, digest

    @staticmethod
    def _check_header(
        obj: dict[str, Any], fail: Callable[[str], LedgerVerificationError]
    ) -> LedgerHeader:
        if obj.get("kind") != "header":
            raise fail(f"the first line has kind {_show(obj.get('kind'))}, not 'header'")
        _check_fields(obj, _HEADER_FIELDS, fail)
        relation = obj["neighboring"]
        if not isinstance(relation, str) or relation not in ("add_remove", "replace_one"):
            raise fail(
                f"the header's neighboring {_show(relation)} is not 'add_remove' or 'replace_one'"
            )
        neighboring = NeighboringRelation(relation)
        for key in ("library_version", "created"):
            if not isinstance(obj[key], str):
                raise fail(f"the header's {key} {_show(obj[key])} is not a string")
        problem = _metadata_problem(obj["metadata"])
        if problem is not None:
            raise fail(f"the header's metadata {problem}")
        return LedgerHeader(
            neighboring=neighboring,
            metadata=obj["metadata"],
            created=obj["created"],
            library_version=obj["library_version"],
            format_version=obj["format_version"],
        )


def _check_fields(
    obj: dict[str, Any],
    fields: tuple[str, ...],
    fail: Callable[[str], LedgerVerificationError],
) -> None:
    if tuple(obj) != fields:
        raise fail(
            f"a {_show(obj.get('kind'))} line has the fields {_show(list(obj))}; "
            f"expected exactly {list(fields)}"
        )


def _header_prefix(version: int = FORMAT_VERSION) -> bytes:
    """What every header line of a format version starts with, up to the first value that
    varies."""
    return (
        HEADER_MAGIC
        + f'"format_version":{version},"seq":0,"prev":"{GENESIS_HASH}","kind":"header",'
        '"library_version":"'.encode("ascii")
    )
