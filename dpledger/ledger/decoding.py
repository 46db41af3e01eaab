"""Decoding ledger lines: each line checked against the file before it, one function per kind.

:func:`decode_line` verifies one complete line the slow, thorough way: its hash suffix, that it
is an ASCII JSON object without duplicate keys, its sequence number and its link to the previous
line, then hands it to the decoder of its record kind (:data:`_DECODERS`: the header, a sampling
event, classic or extended, a sum query, a correlated-noise release or one of its stream's
steps, a resume or a close marker), which checks its fields
and values and re-encodes them. A line is accepted only if that re-encoding gives it back byte
for byte, so there are no two readings of one verified file; otherwise the error names what is
wrong. The reader's fast path (:mod:`dpledger.ledger.reader`) uses this for every line that is
not an ordinary event line.

This module is a little over 500 lines because it holds one decoder per record kind, each with
the checks whose messages name the line, the field and the value that is wrong.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from typing import Any

import attrs

from dpledger.errors import InvalidParameterError, LedgerVerificationError, NotALedgerError
from dpledger.ledger.correlated import CorrelatedReleaseEvent, StreamStepEvent
from dpledger.ledger.encoding import (
    CORRELATED_SCHEMA,
    FORMAT_VERSION,
    GENESIS_HASH,
    HEADER_MAGIC,
    MAX_METADATA_DEPTH,
    STREAM_STEP_SCHEMA,
    SUPPORTED_FORMAT_VERSIONS,
    LedgerHeader,
    _show,
    correlated_release_body,
    encode_event,
    encode_header,
    encode_label,
    encode_marker,
    encode_sample,
    encode_sampling_event,
    encode_sum_query,
    stream_step_body,
)
from dpledger.ledger.events import NeighboringRelation, SamplingEvent
from dpledger.ledger.json_values import (
    _metadata_problem,
    _nested_field,
    _parse_constant,
    _parse_int,
    is_number,
    unique_keys,
)

__all__ = [
    "LineContext",
    "complete_line",
    "decode_line",
    "extended_event",
    "header_prefix",
    "is_number",
    "not_a_ledger",
    "unique_keys",
]

SUFFIX_START = b',"hash":"'
SUFFIX_LEN = len(SUFFIX_START) + 64 + 2  # ,"hash":"<64 hex>"}
_HEX64 = re.compile(rb"[0-9a-f]{64}")

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
_NOTE_FIELDS = ("seq", "prev", "kind", "time", "metadata", "hash")
STREAM_STEP_FIELDS = ("seq", "prev", "kind", "schema", "release", "step", "hash")
CORRELATED_FIELDS = (
    "seq",
    "prev",
    "kind",
    "schema",
    *(a.name for a in attrs.fields(CorrelatedReleaseEvent)),
    "hash",
)
SAMPLE_FIELDS_EXT = (
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


def extended_event(obj: dict[str, Any]) -> SamplingEvent:
    """The event an extended sample line's decoded fields describe (raises if invalid)."""
    q = obj["sampling_probability"]
    if not is_number(q):
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


def complete_line(raw: bytes) -> bool:
    """True if ``raw`` ends with a hash suffix that matches its content."""
    return (
        len(raw) > SUFFIX_LEN
        and raw[-SUFFIX_LEN : -SUFFIX_LEN + 9] == SUFFIX_START
        and raw[-2:] == b'"}'
        and hashlib.sha256(raw[:-SUFFIX_LEN]).hexdigest().encode("ascii") == raw[-66:-2]
    )


def header_prefix(version: int = FORMAT_VERSION) -> bytes:
    """What every header line of a format version starts with, up to the first value that
    varies."""
    return (
        HEADER_MAGIC
        + f'"format_version":{version},"seq":0,"prev":"{GENESIS_HASH}","kind":"header",'
        '"library_version":"'.encode("ascii")
    )


def not_a_ledger(path: str | None) -> NotALedgerError:
    """The error for a file whose first bytes are not a ledger header's."""
    return NotALedgerError(
        f"{path or 'the file'} is not a dpledger ledger (it does not start with "
        f"{HEADER_MAGIC.decode()!r})",
        path=path,
    )


@attrs.frozen
class LineContext:
    """What a line is checked against: the verified lines before it.

    Attributes:
        path: the file, for error messages.
        line_number: 1-based number of the line.
        seq: sequence number of the previous line (-1 before the header).
        prev: hash of the previous line (64 zeros before the header).
        step_open: a sampling event opened a step in the current session.
        closed: the previous line is a close marker.
        num_events: events before the line.
        num_steps: sampling events before the line.
        format_version: the file's format version (from its header).
        releases: T (``num_steps``) of each correlated-noise release before the line, in order.
        stream_progress: the stream steps recorded for each of those releases.
    """

    path: str | None
    line_number: int
    seq: int
    prev: str
    step_open: bool
    closed: bool
    num_events: int
    num_steps: int
    format_version: int
    releases: tuple[int, ...] = ()
    stream_progress: tuple[int, ...] = ()

    def fail(self, reason: str) -> LedgerVerificationError:
        """The error that names this line and what is wrong with it."""
        return LedgerVerificationError(reason, line_number=self.line_number, path=self.path)


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


# ---------------------------------------------------------------------------- one line
def decode_line(raw: bytes, ctx: LineContext) -> tuple[str, Any, bytes]:
    """Check one complete line (without newline) against the lines before it.

    Returns:
        ``(kind, value, hash)`` where value is a :class:`LedgerHeader` for the header, ``(q, n,
        scheme)`` for a classic sampling event (``(q, n, scheme, event)`` for an extended one),
        ``(S, sigma, label)`` for a sum query, the event for a correlated-noise release
        (:class:`CorrelatedReleaseEvent`) or stream step (:class:`StreamStepEvent`), and the
        marker's fields (a dict without seq, prev, kind and hash) for a marker.

    Raises:
        NotALedgerError: line 1 does not start like a ledger header.
        LedgerVerificationError: anything else is wrong with the line; names what.
    """
    if ctx.line_number == 1 and not raw.startswith(HEADER_MAGIC):
        raise not_a_ledger(ctx.path)
    digest = _sealed_digest(raw, ctx)
    obj = _json_object(raw, ctx)
    _check_position(obj, ctx)
    kind = obj.get("kind")
    value, expected = _decoder_for(kind, ctx)(obj, ctx)
    if expected[:-1] != raw:
        raise ctx.fail(
            "is not in the exact layout dpledger writes (field order, spacing or number "
            "format differ): the line was rewritten"
        )
    # every decoder matched ``kind`` against a string
    return ("header" if ctx.line_number == 1 else str(kind)), value, digest


def _sealed_digest(raw: bytes, ctx: LineContext) -> bytes:
    """The line's hash, once its suffix is well formed and the hash matches its content."""
    if not (
        len(raw) > SUFFIX_LEN
        and raw[-SUFFIX_LEN : -SUFFIX_LEN + 9] == SUFFIX_START
        and raw[-2:] == b'"}'
        and _HEX64.fullmatch(raw[-66:-2])
    ):
        raise ctx.fail('does not end with the suffix ,"hash":"<64 lowercase hex digits>"}')
    digest = raw[-66:-2]
    if hashlib.sha256(raw[:-SUFFIX_LEN]).hexdigest().encode("ascii") != digest:
        raise ctx.fail("its hash does not match its content (the line was edited)")
    return digest


def _json_object(raw: bytes, ctx: LineContext) -> dict[str, Any]:
    """The line as a JSON object (ASCII, no duplicate keys; unreadable numbers kept as such)."""
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise ctx.fail("contains bytes that are not ASCII (dpledger writes ASCII only)") from None
    try:
        obj = json.loads(
            text,
            object_pairs_hook=unique_keys,
            parse_int=_parse_int,
            parse_constant=_parse_constant,
        )
    except ValueError as exc:
        raise ctx.fail(f"is not valid JSON ({exc})") from None
    except RecursionError:
        raise ctx.fail(
            f"nests JSON values too deeply to decode{_nested_field(text)} (a writer nests "
            f"metadata at most {MAX_METADATA_DEPTH} levels deep)"
        ) from None
    if not isinstance(obj, dict):
        raise ctx.fail("is not a JSON object")
    return obj


def _check_position(obj: dict[str, Any], ctx: LineContext) -> None:
    """The header's format version, the sequence number and the link to the previous line."""
    if ctx.line_number == 1:
        version = obj.get("format_version")
        if type(version) is not int or version not in SUPPORTED_FORMAT_VERSIONS:
            raise ctx.fail(
                f"format_version {_show(version)} is not supported (this reader knows "
                f"versions {', '.join(map(str, SUPPORTED_FORMAT_VERSIONS))})"
            )
    got_seq = obj.get("seq")
    if type(got_seq) is not int or got_seq != ctx.seq + 1:
        raise ctx.fail(
            f"sequence number {_show(got_seq)}, expected {ctx.seq + 1} "
            "(a line was deleted, inserted, duplicated or moved)"
        )
    if obj.get("prev") != ctx.prev:
        raise ctx.fail(
            "does not chain to the previous line's hash "
            "(a line before it was changed, deleted, inserted or moved)"
        )


_Decoder = Callable[[dict[str, Any], LineContext], tuple[Any, bytes]]


def _decoder_for(kind: Any, ctx: LineContext) -> _Decoder:
    """The decoder for a line of ``kind`` at this place in the file (or the error)."""
    if ctx.line_number == 1:
        return _decode_header
    if kind == "header":
        raise ctx.fail("a second header")
    if ctx.closed and kind != "resume":
        raise ctx.fail(
            f"a {_show(kind)} record after the close marker (only a resume marker may follow it)"
        )
    decoder = _DECODERS.get(kind) if isinstance(kind, str) else None
    if decoder is None:
        raise ctx.fail(f"unknown record kind {_show(kind)}")
    return decoder


# ---------------------------------------------------------------------------- per kind
# Each decoder checks a decoded line's fields and values and returns (value, the line the
# writer would write for that value), for decode_line to compare with the line read.
def _decode_header(obj: dict[str, Any], ctx: LineContext) -> tuple[LedgerHeader, bytes]:
    if obj.get("kind") != "header":
        raise ctx.fail(f"the first line has kind {_show(obj.get('kind'))}, not 'header'")
    _check_fields(obj, _HEADER_FIELDS, ctx.fail)
    relation = obj["neighboring"]
    if not isinstance(relation, str) or relation not in ("add_remove", "replace_one"):
        raise ctx.fail(
            f"the header's neighboring {_show(relation)} is not 'add_remove' or 'replace_one'"
        )
    for key in ("library_version", "created"):
        if not isinstance(obj[key], str):
            raise ctx.fail(f"the header's {key} {_show(obj[key])} is not a string")
    problem = _metadata_problem(obj["metadata"])
    if problem is not None:
        raise ctx.fail(f"the header's metadata {problem}")
    header = LedgerHeader(
        neighboring=NeighboringRelation(relation),
        metadata=obj["metadata"],
        created=obj["created"],
        library_version=obj["library_version"],
        format_version=obj["format_version"],
    )
    expected, _ = encode_header(
        neighboring=header.neighboring,
        metadata=header.metadata,
        library_version=header.library_version,
        created=header.created,
        format_version=header.format_version,
    )
    return header, expected


def _decode_sample(obj: dict[str, Any], ctx: LineContext) -> tuple[tuple[Any, ...], bytes]:
    if tuple(obj) == SAMPLE_FIELDS_EXT:
        return _decode_extended_sample(obj, ctx)
    _check_fields(obj, _SAMPLE_FIELDS, ctx.fail)
    q = obj["sampling_probability"]
    n = obj["population_size"]
    scheme = obj["scheme"]
    if not (is_number(q) and 0.0 <= q <= 1.0):
        raise ctx.fail(f"sampling_probability {_show(q)} is not a number in [0, 1]")
    if n is not None and (type(n) is not int or n < 1):
        raise ctx.fail(f"population_size {_show(n)} is neither null nor an integer >= 1")
    if not isinstance(scheme, str) or scheme not in ("poisson", "full"):
        raise ctx.fail(f"scheme {_show(scheme)} is not 'poisson' or 'full'")
    if scheme == "full" and q != 1.0:
        raise ctx.fail(f"scheme 'full' needs sampling_probability 1.0, not {q!r}")
    expected, _ = encode_sample(ctx.seq + 1, ctx.prev, float(q), n, scheme)
    return (float(q), n, scheme), expected


def _decode_extended_sample(obj: dict[str, Any], ctx: LineContext) -> tuple[tuple[Any, ...], bytes]:
    if ctx.format_version < 2:
        raise ctx.fail(
            "an extended sampling event (a scheme beyond Poisson and full batch, or a "
            "user-level unit) in a format-version-1 file, which cannot hold one"
        )
    try:
        event = extended_event(obj)
    except InvalidParameterError as exc:
        raise ctx.fail(f"the sampling event is invalid: {exc}") from None
    expected, _ = encode_sampling_event(ctx.seq + 1, ctx.prev, event)
    return (event.sampling_probability, event.population_size, event.scheme.value, event), expected


def _decode_sum_query(obj: dict[str, Any], ctx: LineContext) -> tuple[tuple[Any, ...], bytes]:
    _check_fields(obj, _QUERY_FIELDS, ctx.fail)
    s = obj["l2_norm_bound"]
    sigma = obj["noise_stddev"]
    label = obj["label"]
    if not (is_number(s) and s > 0.0):
        raise ctx.fail(f"l2_norm_bound {_show(s)} is not a finite number > 0")
    if not (is_number(sigma) and sigma >= 0.0):
        raise ctx.fail(f"noise_stddev {_show(sigma)} is not a finite number >= 0")
    if label is not None and not isinstance(label, str):
        raise ctx.fail(f"label {_show(label)} is neither null nor a string")
    if not ctx.step_open:
        raise ctx.fail("a sum query with no sampling event before it in its session")
    expected, _ = encode_sum_query(
        ctx.seq + 1, ctx.prev, float(s), float(sigma), encode_label(label)
    )
    return (float(s), float(sigma), label), expected


def _decode_correlated(obj: dict[str, Any], ctx: LineContext) -> tuple[Any, bytes]:
    if ctx.format_version < 2:
        raise ctx.fail(
            "a correlated_release line in a format-version-1 file, which cannot hold one"
        )
    if obj.get("schema") != CORRELATED_SCHEMA or type(obj.get("schema")) is not int:
        raise ctx.fail(
            f"correlated_release schema {_show(obj.get('schema'))} is not supported (this "
            f"reader knows schema {CORRELATED_SCHEMA})"
        )
    _check_fields(obj, CORRELATED_FIELDS, ctx.fail)
    problem = _metadata_problem(obj["strategy_params"])
    if problem is not None:
        raise ctx.fail(f"strategy_params {problem}")
    values = {k: obj[k] for k in CORRELATED_FIELDS[4:-1]}
    for key in (
        "sampling_probability",
        "l2_norm_bound",
        "noise_stddev",
        "sensitivity",
        "max_column_norm",
    ):
        if not is_number(values[key]) or type(values[key]) is bool:
            raise ctx.fail(f"{key} {_show(values[key])} is not a finite number")
        values[key] = float(values[key])
    for key in ("num_steps", "max_participations", "min_separation"):
        if type(values[key]) is not int:
            raise ctx.fail(f"{key} {_show(values[key])} is not an integer")
    if values["bands"] is not None and type(values["bands"]) is not int:
        raise ctx.fail(f"bands {_show(values['bands'])} is neither null nor an integer")
    try:
        event = CorrelatedReleaseEvent(**values)
    except InvalidParameterError as exc:
        raise ctx.fail(f"the correlated release is invalid: {exc}") from None
    expected, _ = encode_event(ctx.seq + 1, ctx.prev, correlated_release_body(event))
    return event, expected


def _decode_stream_step(obj: dict[str, Any], ctx: LineContext) -> tuple[Any, bytes]:
    if ctx.format_version < 2:
        raise ctx.fail("a stream_step line in a format-version-1 file, which cannot hold one")
    if obj.get("schema") != STREAM_STEP_SCHEMA or type(obj.get("schema")) is not int:
        raise ctx.fail(
            f"stream_step schema {_show(obj.get('schema'))} is not supported (this reader "
            f"knows schema {STREAM_STEP_SCHEMA})"
        )
    _check_fields(obj, STREAM_STEP_FIELDS, ctx.fail)
    release, step = obj["release"], obj["step"]
    for key, value in (("release", release), ("step", step)):
        if type(value) is not int or value < 0:
            raise ctx.fail(f"{key} {_show(value)} is not an integer >= 0")
    if release >= len(ctx.releases):
        raise ctx.fail(
            f"a stream step of correlated-noise release {release}, but the lines before it "
            f"hold {len(ctx.releases)} release(s)"
        )
    taken, num_steps = ctx.stream_progress[release], ctx.releases[release]
    if step != taken:
        raise ctx.fail(
            f"step {step} of release {release}, whose steps so far are 0..{taken - 1}: its "
            f"steps must be 0, 1, 2, ... in order, none repeated or skipped (expected {taken})"
            if taken
            else f"step {step} of release {release}, whose first step must be 0"
        )
    if step >= num_steps:
        raise ctx.fail(
            f"step {step} of release {release}, which has num_steps={num_steps} (steps 0.."
            f"{num_steps - 1})"
        )
    event = StreamStepEvent(release, step)
    expected, _ = encode_event(ctx.seq + 1, ctx.prev, stream_step_body(event))
    return event, expected


def _decode_resume(obj: dict[str, Any], ctx: LineContext) -> tuple[dict[str, Any], bytes]:
    has_meta = "metadata" in obj
    _check_fields(obj, _RESUME_FIELDS_META if has_meta else _RESUME_FIELDS, ctx.fail)
    for key in ("time", "library_version"):
        if not isinstance(obj[key], str):
            raise ctx.fail(f"{key} {_show(obj[key])} is not a string")
    problem = _metadata_problem(obj["metadata"]) if has_meta else None
    if problem is not None:
        raise ctx.fail(f"the resume marker's metadata {problem}")
    fields = {k: obj[k] for k in _RESUME_FIELDS_META[3:-1] if k in obj}
    expected, _ = encode_marker(ctx.seq + 1, ctx.prev, "resume", fields)
    return fields, expected


def _decode_note(obj: dict[str, Any], ctx: LineContext) -> tuple[dict[str, Any], bytes]:
    if ctx.format_version < 2:
        raise ctx.fail("a note in a format-version-1 file (notes need version 2)")
    _check_fields(obj, _NOTE_FIELDS, ctx.fail)
    if not isinstance(obj["time"], str):
        raise ctx.fail(f"time {_show(obj['time'])} is not a string")
    problem = _metadata_problem(obj["metadata"])
    if problem is not None:
        raise ctx.fail(f"the note's metadata {problem}")
    fields = {k: obj[k] for k in _NOTE_FIELDS[3:-1]}
    expected, _ = encode_marker(ctx.seq + 1, ctx.prev, "note", fields)
    return fields, expected


def _decode_close(obj: dict[str, Any], ctx: LineContext) -> tuple[dict[str, Any], bytes]:
    _check_fields(obj, _CLOSE_FIELDS, ctx.fail)
    if not isinstance(obj["time"], str):
        raise ctx.fail(f"time {_show(obj['time'])} is not a string")
    if type(obj["events"]) is not int or obj["events"] != ctx.num_events:
        raise ctx.fail(
            f"the close marker counts {_show(obj['events'])} events, the lines before it "
            f"hold {ctx.num_events}"
        )
    if type(obj["steps"]) is not int or obj["steps"] != ctx.num_steps:
        raise ctx.fail(
            f"the close marker counts {_show(obj['steps'])} steps, the lines before it "
            f"hold {ctx.num_steps}"
        )
    fields = {k: obj[k] for k in _CLOSE_FIELDS[3:-1]}
    expected, _ = encode_marker(ctx.seq + 1, ctx.prev, "close", fields)
    return fields, expected


_DECODERS: dict[str, _Decoder] = {
    "sample": _decode_sample,
    "sum_query": _decode_sum_query,
    "correlated_release": _decode_correlated,
    "stream_step": _decode_stream_step,
    "resume": _decode_resume,
    "note": _decode_note,
    "close": _decode_close,
}
"""The decoder of each record kind after the header (which only line 1 may be)."""
