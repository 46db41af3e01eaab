"""Reading a ledger file: every line verified in one pass, with a fast path for event lines.

:class:`LedgerReader` reads a file in blocks and checks each line against the lines before it.
An ordinary event line (a sampling event or a sum query exactly as the encoders write it) is
recognised by its fixed start (sequence number and previous hash), its hash and a parse of its
body that is cached, because bodies repeat from step to step; every other line (the header,
markers, anything unusual) is decoded and checked field by field by
:func:`~dpledger.ledger.decoding.decode_line`, which either accepts it with identical values or
names what is wrong. A final line without newline is used if it is complete, and reported as a
torn tail (:class:`TornTail`) if it is the beginning of the line the writer would have written.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from typing import IO, Any

import attrs

from dpledger.errors import InvalidParameterError, LedgerVerificationError
from dpledger.ledger.decoding import (
    SAMPLE_FIELDS_EXT,
    SUFFIX_START,
    LineContext,
    complete_line,
    decode_line,
    extended_event,
    header_prefix,
    not_a_ledger,
    unique_keys,
)
from dpledger.ledger.encoding import (
    FORMAT_VERSION,
    GENESIS_HASH,
    HEADER_MAGIC,
    LedgerHeader,
    sampling_event_body,
)

__all__ = ["LedgerReader", "TornTail"]

_BLOCK_SIZE = 1 << 20
_MAX_FAST_DIGITS = 640  # population sizes longer than this are left to the slow path
_CACHE_LIMIT = 4096

# How the two event kinds' lines continue after ``"kind":"`` (the fast path of the reader).
_SAMPLE_START = b'sample","sampling_probability":'
_SAMPLE_LEN = len(_SAMPLE_START)
_QUERY_START = b'sum_query","l2_norm_bound":'
_QUERY_LEN = len(_QUERY_START)


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


# ---------------------------------------------------------------------------- event bodies, fast
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
        obj = json.loads(b'{"kind":"' + body + b"}", object_pairs_hook=unique_keys)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or tuple(obj) != ("kind", *SAMPLE_FIELDS_EXT[3:-1]):
        return None
    try:
        event = extended_event(obj)
    except (InvalidParameterError, TypeError):
        return None
    if event.is_classic or sampling_event_body(event).encode("ascii") != body:
        return None
    return (True, event.sampling_probability, event.population_size, event.scheme.value, event)


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


def _noop(*_args: Any) -> None:
    return None


_Callbacks = tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]


class LedgerReader:
    """Reads and verifies a ledger file, calling back for every record.

    :meth:`read` goes through the file once, in blocks, and checks every line as it comes: its
    hash, its sequence number, its link to the previous line, its values, the order rules
    (a sum query needs a sampling event in the same session; a stream step belongs to a release
    before it and continues its steps 0, 1, 2, … below its T; after a close marker only a
    resume marker may follow) and its layout. Correlated-noise lines (a release, a stream step)
    always take the thorough path of :func:`~dpledger.ledger.decoding.decode_line`. The first
    line that fails raises :class:`~dpledger.errors.LedgerVerificationError` naming it; a file
    whose first line is not a dpledger header raises :class:`~dpledger.errors.NotALedgerError`.

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
        num_events: events (sampling, sum-query, correlated-noise) in the verified prefix.
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
        self._line_number = 0
        # T of each correlated-noise release, and the stream steps recorded for it so far.
        self._release_steps: list[int] = []
        self._stream_progress: list[int] = []
        # Parses of event bodies and of their numbers and labels, by their bytes.
        self._numbers: dict[bytes, float] = {}
        self._labels: dict[bytes, Any] = {}
        self._bodies: dict[bytes, tuple[Any, ...]] = {}

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
        callbacks: _Callbacks = (on_sample, on_query, on_marker)
        pending = b""
        first_block = True
        while True:
            block = self._fp.read(_BLOCK_SIZE)
            if not block:
                break
            if first_block:
                first_block = False
                if not HEADER_MAGIC.startswith(block[: len(HEADER_MAGIC)]):
                    raise not_a_ledger(self.path)
            if pending:
                block = pending + block
            lines = block.split(b"\n")
            pending = lines.pop()
            self._read_lines(lines, callbacks)
        if pending:
            self._line_number += 1
            self._read_last(pending, self._line_number, self.valid_length, callbacks)
        elif self._line_number == 0:
            self.header_torn = True  # an empty file: the writer died before its header
        return self

    def _state(self) -> tuple[bytes, int, bool, bool, int, int, str | None, bool]:
        """The verified prefix's state, as :meth:`_read_lines` keeps it in local variables."""
        return (
            self.head_hash.encode("ascii"),
            self.last_seq,
            self._step_open,
            self.last_kind == "close",
            self.num_events,
            self.num_steps,
            self.last_kind,
            self.header is not None and self.header.format_version >= 2,
        )

    def _read_lines(self, lines: list[bytes], callbacks: _Callbacks) -> None:
        """Verify and replay complete lines (the hot loop: its state lives in locals)."""
        on_sample, on_query, _ = callbacks
        fast = self._fast
        sha256 = hashlib.sha256
        numbers, labels, bodies = self._numbers, self._labels, self._bodies
        head, seq, step_open, closed, num_events, num_steps, last_kind, extended_ok = self._state()
        line_number = self._line_number
        offset = self.valid_length
        for raw in lines:
            line_number += 1
            # Fast path: an event line exactly as encode_sample / encode_sum_query write
            # it. Its start is fixed by the state (seq and prev), its end by its hash; the
            # body between them repeats from step to step, so its parse is cached.
            if fast and not closed:
                start = b'{"seq":%d,"prev":"%s","kind":"' % (seq + 1, head)
                if (
                    raw.startswith(start)
                    and raw[-75:-66] == SUFFIX_START
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
            self._store(head, seq, last_kind, step_open, num_events, num_steps, offset)
            self._apply(*self._decode(raw, line_number), callbacks)
            head, seq, step_open, closed, num_events, num_steps, last_kind, extended_ok = (
                self._state()
            )
            offset += len(raw) + 1
        self._line_number = line_number
        self._store(head, seq, last_kind, step_open, num_events, num_steps, offset)

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

    def _read_last(self, raw: bytes, line_number: int, offset: int, callbacks: _Callbacks) -> None:
        """A final line without newline: used if it verifies, else maybe a torn tail."""
        if line_number == 1 and len(raw) < len(HEADER_MAGIC):
            # A prefix of the magic (the first block check refused anything else).
            self.torn_tail = TornTail(line_number=1, offset=0, length=len(raw))
            self.header_torn = True
            return
        try:
            record = self._decode(raw, line_number)
        except LedgerVerificationError:
            if complete_line(raw):
                raise  # a whole line that is wrong: not a crash
            self._check_torn(raw, line_number)
            self.torn_tail = TornTail(line_number=line_number, offset=offset, length=len(raw))
            self.header_torn = line_number == 1
            return
        self._apply(*record, callbacks)
        self.valid_length = offset + len(raw)
        self.missing_newline = True

    def _check_torn(self, raw: bytes, line_number: int) -> None:
        """Raise unless an incomplete last line is the beginning of the line due next."""
        if line_number == 1:
            expected = header_prefix()
            older = header_prefix(1)
            if raw[: min(len(raw), len(older))] == older[: len(raw)]:
                expected = older  # a version-1 writer's torn header
        else:
            expected = b'{"seq":%d,"prev":"%s","kind":"' % (
                self.last_seq + 1,
                self.head_hash.encode("ascii"),
            )
        k = min(len(raw), len(expected))
        if raw[:k] != expected[:k]:
            raise LedgerVerificationError(
                "incomplete last line that is not the beginning of the next line "
                f"(expected it to start with {expected.decode('ascii')!r})",
                line_number=line_number,
                path=self.path,
            ) from None

    # ---------------------------------------------------------------- one line, slowly
    def _decode(self, raw: bytes, line_number: int) -> tuple[str, Any, bytes]:
        """Check one complete line (without newline) against the verified prefix before it."""
        header = self.header
        return decode_line(
            raw,
            LineContext(
                path=self.path,
                line_number=line_number,
                seq=self.last_seq,
                prev=self.head_hash,
                step_open=self._step_open,
                closed=self.last_kind == "close",
                num_events=self.num_events,
                num_steps=self.num_steps,
                format_version=FORMAT_VERSION if header is None else header.format_version,
                releases=tuple(self._release_steps),
                stream_progress=tuple(self._stream_progress),
            ),
        )

    def _apply(self, kind: str, value: Any, digest: bytes, callbacks: _Callbacks) -> None:
        """Replay a decoded line and fold it into the verified prefix's state."""
        on_sample, on_query, on_marker = callbacks
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
        elif kind == "correlated_release":
            # an event that is no step: it ends the open step, as a marker does
            on_marker(kind, value)
            self._step_open = False
            self.num_events += 1
            self._release_steps.append(value.num_steps)
            self._stream_progress.append(0)
        elif kind == "stream_step":
            # a step of a release's stream: an event that is no step of the ledger's either
            on_marker(kind, value)
            self._step_open = False
            self.num_events += 1
            self._stream_progress[value.release] += 1
        else:
            on_marker(kind, value)
            self._step_open = False
        self.last_kind = kind
        self.last_seq += 1
        self.head_hash = digest.decode("ascii")
