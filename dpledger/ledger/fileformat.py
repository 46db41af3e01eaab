"""The ledger file format: JSON Lines with a SHA-256 hash chain (see docs/ledger-format.md).

Every line is one JSON object in ASCII, written in one fixed layout that ends with
``,"hash":"<64 hex digits>"}``. The hash is the SHA-256 of the line's bytes up to (not including)
that ``,"hash":`` suffix, and every line names the previous line's hash in its ``"prev"`` field,
so a reader in any language can check the chain without canonical JSON.

Line 1 is the header (``"kind":"header"``, ``"seq":0``, ``"prev"`` = 64 zeros). Then come events
(``"sample"``, ``"sum_query"``), notes (``"note"``: metadata such as the run's intent) and session
markers (``"resume"`` when a writer reopens the file, ``"close"`` when it closes it cleanly),
numbered by ``"seq"`` 1, 2, 3, …

The reader accepts exactly what the writer writes: a line must be byte for byte the line the
writer would produce from the values it holds (field order, no spaces, floats in Python's
shortest round-trip ``repr``, no duplicate keys). That leaves no two readings of one verified file.
Event lines as the encoders write them are recognised by their fixed layout, and the parse of
their body is cached (the fast path); anything else is decoded with :func:`json.loads` and
checked field by field, which either accepts the line with identical values or names what is
wrong with it.

The format is implemented in three parts, whose public names this module gathers:
:mod:`dpledger.ledger.encoding` (the writer's layout and the header),
:mod:`dpledger.ledger.decoding` (one line checked the slow way, one function per record kind)
and :mod:`dpledger.ledger.reader` (a whole file verified in one pass, with the fast path).
"""

from __future__ import annotations

from dpledger.ledger.encoding import (
    FORMAT_NAME,
    FORMAT_VERSION,
    GENESIS_HASH,
    HEADER_MAGIC,
    MAX_METADATA_DEPTH,
    STREAM_STEP_SCHEMA,
    SUPPORTED_FORMAT_VERSIONS,
    LedgerHeader,
    correlated_release_body,
    dump_metadata,
    encode_event,
    encode_header,
    encode_label,
    encode_marker,
    encode_sample,
    encode_sampling_event,
    encode_sum_query,
    line_hash,
    sample_body,
    sampling_event_body,
    stream_step_body,
    sum_query_body,
    utc_timestamp,
)
from dpledger.ledger.reader import LedgerReader, TornTail

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "GENESIS_HASH",
    "HEADER_MAGIC",
    "MAX_METADATA_DEPTH",
    "STREAM_STEP_SCHEMA",
    "SUPPORTED_FORMAT_VERSIONS",
    "LedgerHeader",
    "LedgerReader",
    "TornTail",
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
