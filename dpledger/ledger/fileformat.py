"""The ledger file format: JSON Lines with a SHA-256 hash chain (see docs/ledger-format.md).

Every line is one JSON object, written in a fixed layout that ends with
``,"hash":"<64 hex digits>"}``. The hash is the SHA-256 of the line's UTF-8 bytes up to (not
including) that ``,"hash":`` suffix, and every line names the previous line's hash in its
``"prev"`` field, so a reader in any language can check the chain without canonical JSON.

Line 1 is the header (``"kind":"header"``, ``"seq":0``, ``"prev"`` = 64 zeros). Then come events
(``"sample"``, ``"sum_query"``) and session markers (``"resume"`` when a writer reopens the file,
``"close"`` when it closes it cleanly), numbered by ``"seq"`` 1, 2, 3, …
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import re
from collections.abc import Iterator
from typing import IO, Any

import attrs

from dpledger.errors import InvalidParameterError, LedgerVerificationError, NotALedgerError
from dpledger.ledger.events import NeighboringRelation

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "GENESIS_HASH",
    "HeaderRecord",
    "LedgerReader",
    "TornTail",
    "encode_header",
    "encode_marker",
    "encode_sample",
    "encode_sum_query",
]

FORMAT_NAME = "dpledger-ledger"
FORMAT_VERSION = 1
GENESIS_HASH = "0" * 64
HEADER_MAGIC = b'{"format":"' + FORMAT_NAME.encode() + b'",'
_HASH_SUFFIX_START = b',"hash":"'
_SUFFIX_LEN = len(_HASH_SUFFIX_START) + 64 + 2  # ,"hash":"<64 hex>"}
_HEX64 = re.compile(rb"[0-9a-f]{64}\Z")
MARKER_KINDS = ("resume", "close")
EVENT_KINDS = ("sample", "sum_query")


def utc_timestamp() -> str:
    """Current UTC time as ISO 8601 with microseconds and a ``Z`` suffix."""
    now = _dt.datetime.now(_dt.timezone.utc)
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _seal(content: str) -> tuple[bytes, str]:
    """Append the hash suffix to a line's content; return (line bytes with newline, hash)."""
    raw = content.encode("utf-8")
    digest = hashlib.sha256(raw).hexdigest()
    return raw + b',"hash":"' + digest.encode("ascii") + b'"}\n', digest


def encode_header(
    *,
    neighboring: NeighboringRelation,
    metadata: dict[str, Any],
    library_version: str,
    created: str,
) -> tuple[bytes, str]:
    """The header line (seq 0)."""
    content = (
        f'{{"format":"{FORMAT_NAME}","format_version":{FORMAT_VERSION},"seq":0,'
        f'"prev":"{GENESIS_HASH}","kind":"header","library_version":{json.dumps(library_version)},'
        f'"created":{json.dumps(created)},"neighboring":"{neighboring.value}",'
        f'"metadata":{dump_metadata(metadata)}'
    )
    return _seal(content)


def dump_metadata(metadata: dict[str, Any], *, parameter: str = "metadata") -> str:
    """Serialise user metadata as compact JSON, refusing what JSON cannot carry exactly."""
    if not isinstance(metadata, dict):
        raise InvalidParameterError(parameter, metadata, "a dict of JSON-serialisable values")
    try:
        return json.dumps(metadata, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidParameterError(
            parameter, metadata, f"a dict of JSON-serialisable values with string keys ({exc})"
        ) from None


def encode_sample(
    seq: int, prev: str, sampling_probability: float, population_size: int | None, scheme: str
) -> tuple[bytes, str]:
    """A sampling-event line. Floats use repr(), the shortest exact round-trip form."""
    n = "null" if population_size is None else str(population_size)
    return _seal(
        f'{{"seq":{seq},"prev":"{prev}","kind":"sample",'
        f'"sampling_probability":{sampling_probability!r},"population_size":{n},'
        f'"scheme":"{scheme}"'
    )


def encode_sum_query(
    seq: int, prev: str, l2_norm_bound: float, noise_stddev: float, label_json: str
) -> tuple[bytes, str]:
    """A sum-query-event line; ``label_json`` is the label already encoded as JSON (or null)."""
    return _seal(
        f'{{"seq":{seq},"prev":"{prev}","kind":"sum_query",'
        f'"l2_norm_bound":{l2_norm_bound!r},"noise_stddev":{noise_stddev!r},"label":{label_json}'
    )


def encode_marker(seq: int, prev: str, kind: str, fields: dict[str, Any]) -> tuple[bytes, str]:
    """A session-marker line (``resume`` or ``close``)."""
    extra = "".join(
        f",{json.dumps(k)}:{json.dumps(v, sort_keys=True, separators=(',', ':'), allow_nan=False)}"
        for k, v in fields.items()
    )
    return _seal(f'{{"seq":{seq},"prev":"{prev}","kind":"{kind}"{extra}')


@attrs.frozen
class HeaderRecord:
    """The decoded header line of a ledger file."""

    format_version: int
    library_version: str
    created: str
    neighboring: NeighboringRelation
    metadata: dict[str, Any]
    hash: str


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


def _is_finite_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class LedgerReader:
    """Reads and verifies a ledger file line by line.

    Iterating yields ``(kind, obj)`` for every event and marker line after the header, where
    ``obj`` is the decoded JSON object. Verification happens as the lines are read: the first
    line that breaks the format or the chain raises :class:`LedgerVerificationError` naming it.
    An incomplete final line (no newline, does not verify) is a torn tail: it is not yielded and
    is reported in :attr:`torn_tail` after iteration.

    After iteration, :attr:`valid_length` is the byte length of the verified prefix,
    :attr:`head_hash` the hash of its last line, :attr:`last_seq` its sequence number, and
    :attr:`missing_newline` tells whether that last line lacks its newline.
    """

    def __init__(self, fp: IO[bytes], *, path: str | None = None) -> None:
        self._fp = fp
        self.path = path
        self.header: HeaderRecord | None = None
        self.torn_tail: TornTail | None = None
        self.valid_length = 0
        self.head_hash = GENESIS_HASH
        self.last_seq = -1
        self.last_kind: str | None = None
        self.missing_newline = False
        self.header_torn = False

    def _fail(self, line_number: int, reason: str) -> LedgerVerificationError:
        return LedgerVerificationError(reason, line_number=line_number, path=self.path)

    def _check_line(self, raw: bytes, line_number: int) -> dict[str, Any]:
        """Verify one complete line (without newline); return its JSON object."""
        if len(raw) <= _SUFFIX_LEN or raw[-_SUFFIX_LEN : -_SUFFIX_LEN + 9] != _HASH_SUFFIX_START:
            raise self._fail(line_number, 'does not end with the ,"hash":"<64 hex>"} suffix')
        digest = raw[-66:-2]
        if raw[-2:] != b'"}' or not _HEX64.match(digest):
            raise self._fail(line_number, 'does not end with the ,"hash":"<64 hex>"} suffix')
        if hashlib.sha256(raw[:-_SUFFIX_LEN]).hexdigest().encode("ascii") != digest:
            raise self._fail(line_number, "hash does not match the line's content (line edited)")
        try:
            obj = json.loads(raw)
        except (UnicodeDecodeError, ValueError) as exc:
            raise self._fail(line_number, f"not valid JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise self._fail(line_number, "not a JSON object")
        expected_seq = self.last_seq + 1
        if obj.get("seq") != expected_seq or isinstance(obj.get("seq"), bool):
            raise self._fail(
                line_number,
                f"sequence number {obj.get('seq')!r}, expected {expected_seq} "
                "(a line was deleted, inserted, duplicated or moved)",
            )
        if obj.get("prev") != self.head_hash:
            raise self._fail(
                line_number,
                "does not chain to the previous line's hash "
                "(a line before it was changed, deleted, inserted or moved)",
            )
        return obj

    def _check_header(self, obj: dict[str, Any], line_number: int) -> HeaderRecord:
        if obj.get("kind") != "header" or obj.get("format") != FORMAT_NAME:
            raise self._fail(line_number, "the first line is not a dpledger header")
        version = obj.get("format_version")
        if version != FORMAT_VERSION:
            raise self._fail(
                line_number,
                f"format_version {version!r} is not supported (this reader knows {FORMAT_VERSION})",
            )
        try:
            neighboring = NeighboringRelation.parse(obj.get("neighboring"))
        except InvalidParameterError as exc:
            raise self._fail(line_number, str(exc)) from None
        metadata = obj.get("metadata")
        if not isinstance(metadata, dict):
            raise self._fail(line_number, "header metadata is not a JSON object")
        return HeaderRecord(
            format_version=version,
            library_version=str(obj.get("library_version")),
            created=str(obj.get("created")),
            neighboring=neighboring,
            metadata=metadata,
            hash=obj["hash"],
        )

    def _check_event(self, obj: dict[str, Any], line_number: int) -> str:
        kind = obj.get("kind")
        if kind == "sample":
            q = obj.get("sampling_probability")
            n = obj.get("population_size")
            scheme = obj.get("scheme")
            if not (_is_finite_number(q) and 0.0 <= q <= 1.0):
                raise self._fail(line_number, f"sampling_probability {q!r} is not in [0, 1]")
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
                raise self._fail(line_number, f"population_size {n!r} is not null or >= 1")
            if scheme not in ("poisson", "full") or (scheme == "full" and q != 1.0):
                raise self._fail(line_number, f"scheme {scheme!r} is invalid for q = {q!r}")
        elif kind == "sum_query":
            s = obj.get("l2_norm_bound")
            sigma = obj.get("noise_stddev")
            label = obj.get("label")
            if not (_is_finite_number(s) and s > 0):
                raise self._fail(line_number, f"l2_norm_bound {s!r} is not a finite number > 0")
            if not (_is_finite_number(sigma) and sigma >= 0):
                raise self._fail(line_number, f"noise_stddev {sigma!r} is not a finite number >= 0")
            if label is not None and not isinstance(label, str):
                raise self._fail(line_number, f"label {label!r} is not a string or null")
            if self.last_kind in (None, "header", "resume"):
                raise self._fail(line_number, "sum query before any sampling event of its session")
        elif kind in MARKER_KINDS:
            pass
        else:
            raise self._fail(line_number, f"unknown record kind {kind!r}")
        if self.last_kind == "close" and kind != "resume":
            raise self._fail(line_number, f"{kind!r} record after the ledger was closed")
        return kind

    def __iter__(self) -> Iterator[tuple[str, dict[str, Any]]]:
        offset = 0
        line_number = 0
        for chunk in self._fp:
            line_number += 1
            if chunk.endswith(b"\n"):
                yield from self._accept(chunk[:-1], line_number, offset, len(chunk))
                offset += len(chunk)
            else:  # iteration only returns a line without newline at the end of the file
                yield from self._accept_last(chunk, line_number, offset)
        if line_number == 0:
            self.header_torn = True  # empty file: a writer that died before its header

    def _accept(
        self, raw: bytes, line_number: int, offset: int, size: int
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        if line_number == 1 and not raw.startswith(HEADER_MAGIC):
            raise NotALedgerError(
                f"{self.path or 'file'} is not a dpledger ledger (its first line does not start "
                f"with {HEADER_MAGIC.decode()!r})",
                path=self.path,
            )
        obj = self._check_line(raw, line_number)
        if line_number == 1:
            self.header = self._check_header(obj, line_number)
            kind = "header"
        else:
            kind = self._check_event(obj, line_number)
        self.head_hash = obj["hash"]
        self.last_seq = obj["seq"]
        self.last_kind = kind
        self.valid_length = offset + size
        if kind != "header":
            yield kind, obj

    def _accept_last(
        self, raw: bytes, line_number: int, offset: int
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """A final line without newline: kept if it verifies, else reported as a torn tail."""
        if line_number == 1 and HEADER_MAGIC.startswith(raw):
            records: list[tuple[str, dict[str, Any]]] = []
            verified = False
        else:
            try:
                records = list(self._accept(raw, line_number, offset, len(raw)))
                verified = True
            except LedgerVerificationError:
                records, verified = [], False
        if verified:
            self.missing_newline = True
            yield from records
            return
        self.torn_tail = TornTail(line_number=line_number, offset=offset, length=len(raw))
        self.header_torn = line_number == 1


def read_all(path: str | os.PathLike[str]) -> LedgerReader:
    """Verify a whole file (helper for tests and tools); returns the exhausted reader."""
    with open(path, "rb") as fp:
        reader = LedgerReader(fp, path=os.fspath(path))
        for _ in reader:
            pass
    return reader
