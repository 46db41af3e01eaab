"""The ledger's journal: everything about a ledger's file.

:class:`LedgerJournal` creates a ledger file or opens one to resume it (verifying what it holds
and replaying it into a :class:`~dpledger.ledger.store.LedgerColumns`), holds the single-writer
lock, encodes every event as its line of the hash chain (:mod:`dpledger.ledger.fileformat`),
buffers the lines and writes them (``flush``, ``fsync``), sets a torn final line aside before
appending, writes the resume and close markers, and never lets a forked child or the interpreter's
exit lose or duplicate what a writer recorded. It keeps nothing about the events beyond the
chain's state (sequence number and head hash).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from dpledger._version import __version__
from dpledger.errors import (
    InvalidParameterError,
    LedgerExistsError,
    LedgerLockedError,
    MissingHeaderError,
)
from dpledger.ledger import fileformat as ff
from dpledger.ledger.correlated import CorrelatedReleaseEvent, StreamStepEvent
from dpledger.ledger.events import NeighboringRelation, SamplingEvent
from dpledger.ledger.fileformat import LedgerHeader
from dpledger.ledger.store import LedgerColumns

__all__ = ["LedgerJournal", "LedgerWarning"]

logger = logging.getLogger(__name__)


class LedgerWarning(UserWarning):
    """A ledger file was cut short (a crash) or not closed; what was lost is named."""


_OPEN_JOURNALS: weakref.WeakSet[LedgerJournal] = weakref.WeakSet()


@atexit.register
def _flush_open_journals() -> None:
    """At interpreter exit, write what open ledgers still buffer (no close marker)."""
    for journal in list(_OPEN_JOURNALS):
        try:
            journal.flush()
        except Exception:
            logger.exception("could not flush ledger %s at exit", journal.path)


def _forget_open_journals_in_child() -> None:
    """After ``fork()``: the child must never write the parent's buffered lines or append."""
    for journal in list(_OPEN_JOURNALS):
        journal.detach_after_fork()
    _OPEN_JOURNALS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_open_journals_in_child)


def _remember(cache: dict[Any, str], key: Any, body: str) -> str:
    if len(cache) >= 1024:
        cache.clear()
    cache[key] = body
    return body


def _default_header() -> LedgerHeader:
    """The header of a file whose own header is incomplete (it records nothing)."""
    return LedgerHeader(
        neighboring=NeighboringRelation.ADD_REMOVE, metadata={}, created="", library_version=""
    )


class LedgerJournal:
    """A ledger's file: the writer's lock, buffer and hash chain, or a verified file's state.

    Build one with :meth:`create`, :meth:`resume` or :meth:`load`, not directly.

    Attributes:
        path: the file.
        header: the file's header (a default one when its header is incomplete).
        seq: sequence number of the last line written or buffered.
        head: hash of the last line written or buffered.
        closed_cleanly: whether the file ends with a close marker (for a writer: has ended).
        torn_tail: the incomplete final line a :meth:`load` found, or None.
        header_torn: a :meth:`load` found no complete header.
    """

    def __init__(
        self,
        path: str,
        *,
        buffer_size: int = 1,
        flush_interval: float = 0.0,
        fsync: bool = False,
        on_fork: Callable[[], object] | None = None,
    ) -> None:
        self.path = path
        self.header: LedgerHeader = _default_header()
        self._buffer_size = buffer_size
        self._flush_interval = flush_interval
        self._fsync = fsync
        self._on_fork = on_fork
        self._fd: int | None = None
        self._buffer: list[bytes] = []
        self._last_flush = time.monotonic()
        self.seq = 0
        self.head = ff.GENESIS_HASH
        self.closed_cleanly = False
        self.torn_tail: ff.TornTail | None = None
        self.header_torn = False
        # Encoded event bodies by value: steps repeat, formatting floats is not free.
        self._sample_bodies: dict[tuple[float, int | None, str], str] = {}
        self._query_bodies: dict[tuple[float, float, str | None], str] = {}
        self._event_bodies: dict[SamplingEvent, str] = {}  # extended sampling events

    # ------------------------------------------------------------------ opening
    @classmethod
    def create(
        cls,
        path: str,
        relation: NeighboringRelation,
        meta_json: str,
        *,
        resume: bool,
        **options: Any,
    ) -> LedgerJournal:
        """Create ``path`` exclusively, lock it and write its header (``options``: see the
        constructor)."""
        self = cls(path, **options)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        except FileExistsError:
            hint = "" if resume else "; pass resume=True to append to it, or choose a new path"
            raise LedgerExistsError(f"{path!r} already exists{hint}", path=path) from None
        try:
            self._lock(fd)
        except BaseException:
            os.close(fd)  # the file stays: whoever holds the lock may be writing its header
            raise
        try:
            self._fd = fd
            self._write_header(relation, meta_json)
        except BaseException:
            self._fd = None
            with contextlib.suppress(OSError):
                os.unlink(path)  # ours alone (created exclusively, still locked)
            os.close(fd)
            raise
        _OPEN_JOURNALS.add(self)
        return self

    @classmethod
    def resume(
        cls,
        path: str,
        relation: NeighboringRelation | None,
        meta_json: str | None,
        store: LedgerColumns,
        **options: Any,
    ) -> LedgerJournal:
        """Open the existing file ``path`` to append: lock it, verify it and replay it into
        ``store``, set a torn final line aside, and start a session with a resume marker."""
        self = cls(path, **options)
        fd = os.open(path, os.O_RDWR | os.O_APPEND)
        try:
            self._lock(fd)
            # Read through the locked descriptor: the file that is verified is the one appended to.
            with os.fdopen(os.dup(fd), "rb") as fp:
                reader = ff.LedgerReader(fp, path=path)
                self._replay(reader, store)
            if reader.header_torn:
                self._restart_torn_header(fd, reader, relation, meta_json)
            else:
                self._continue(fd, reader, relation, meta_json)
        except BaseException:
            self._fd = None
            os.close(fd)
            raise
        _OPEN_JOURNALS.add(self)
        return self

    @classmethod
    def load(cls, path: str, store: LedgerColumns) -> LedgerJournal:
        """Verify the file ``path`` and replay it into ``store``, read-only.

        Raises:
            MissingHeaderError: the file holds no complete header.
        """
        self = cls(path)
        with open(path, "rb") as fp:
            reader = ff.LedgerReader(fp, path=path)
            self._replay(reader, store)
        store.end_step()  # nothing more can be added to the last step
        self.seq = reader.last_seq
        self.head = reader.head_hash
        self.torn_tail = reader.torn_tail
        self.header_torn = reader.header_torn
        if reader.header_torn:
            size = 0 if reader.torn_tail is None else reader.torn_tail.length
            raise MissingHeaderError(
                f"{path} holds no complete ledger header (it has {size} bytes: the file is "
                "empty, or its writer stopped while writing line 1); it records nothing and is "
                "not a ledger that can be read",
                path=path,
            )
        if reader.torn_tail is not None:
            warnings.warn(
                f"{path}: {reader.torn_tail.describe()}; loaded the {store.num_events} events "
                "before it",
                LedgerWarning,
                stacklevel=3,
            )
        return self

    def _lock(self, fd: int) -> None:
        """Take the single-writer lock on ``fd`` (the caller closes ``fd`` if this raises)."""
        if sys.platform == "win32":  # pragma: no cover - not POSIX
            import msvcrt

            try:
                msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
            except OSError:
                raise self._locked_error() from None
            return
        import fcntl

        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise self._locked_error() from None

    def _locked_error(self) -> LedgerLockedError:
        return LedgerLockedError(
            f"{self.path!r} is open for writing by another ledger (in this or another process); "
            "close that one first",
            path=self.path,
        )

    def _write_header(self, relation: NeighboringRelation, meta_json: str) -> None:
        created = ff.utc_timestamp()
        line, digest = ff.encode_header(
            neighboring=relation,
            metadata=json.loads(meta_json),
            library_version=__version__,
            created=created,
        )
        self.header = LedgerHeader(
            neighboring=relation,
            metadata=json.loads(meta_json),
            created=created,
            library_version=__version__,
        )
        self.seq = 0
        self.head = digest
        self._buffer.append(line)
        self.flush()  # the header is written at once, so a new file is a ledger from the start

    def _replay(self, reader: ff.LedgerReader, store: LedgerColumns) -> None:
        """Rebuild ``store`` from a file's verified records."""
        reader.read(
            on_sample=store.add_sample, on_query=store.add_query, on_marker=store.add_marker
        )
        self.header = _default_header() if reader.header is None else reader.header
        self.closed_cleanly = reader.closed

    def _restart_torn_header(
        self,
        fd: int,
        reader: ff.LedgerReader,
        relation: NeighboringRelation | None,
        meta_json: str | None,
    ) -> None:
        """The previous writer died before its header was complete: nothing was recorded."""
        length = 0 if reader.torn_tail is None else reader.torn_tail.length
        where = ""
        if length:
            where = f"; its {length} bytes were moved to {self._set_aside(fd, 0)}"
        os.ftruncate(fd, 0)
        warnings.warn(
            f"{self.path}: the header is incomplete (the writer stopped before finishing it), so "
            f"the file held no events{where}; a new header was written",
            LedgerWarning,
            stacklevel=4,
        )
        self._fd = fd
        self._write_header(relation or NeighboringRelation.ADD_REMOVE, meta_json or "{}")

    def _continue(
        self,
        fd: int,
        reader: ff.LedgerReader,
        relation: NeighboringRelation | None,
        meta_json: str | None,
    ) -> None:
        assert reader.header is not None
        if relation is not None and relation is not reader.header.neighboring:
            raise InvalidParameterError(
                "neighboring",
                relation.value,
                f"the relation of the existing ledger, {reader.header.neighboring.value!r}",
            )
        if reader.torn_tail is not None:
            torn = reader.torn_tail
            aside = self._set_aside(fd, torn.offset)
            os.ftruncate(fd, torn.offset)
            warnings.warn(
                f"{self.path}: {torn.describe()}; its {torn.length} bytes were moved to {aside} "
                "before appending",
                LedgerWarning,
                stacklevel=4,
            )
        if reader.missing_newline:
            os.write(fd, b"\n")
        self._fd = fd
        self.seq = reader.last_seq
        self.head = reader.head_hash
        fields: dict[str, Any] = {"time": ff.utc_timestamp(), "library_version": __version__}
        if meta_json is not None:
            fields["metadata"] = json.loads(meta_json)
        self._append_marker("resume", fields)
        self.closed_cleanly = False  # the file no longer ends with its close marker
        self.flush()

    def _set_aside(self, fd: int, offset: int) -> str:
        """Copy the file's bytes from ``offset`` on to a new ``<path>.torn-<offset>[.k]`` file."""
        with os.fdopen(os.dup(fd), "rb") as fp:
            fp.seek(offset)
            tail = fp.read()
        base = f"{self.path}.torn-{offset}"
        aside, k = base, 0
        while True:
            try:
                with open(aside, "xb") as out:
                    out.write(tail)
                    out.flush()
                    os.fsync(out.fileno())
                return aside
            except FileExistsError:
                k += 1
                aside = f"{base}.{k}"

    # ------------------------------------------------------------------ writing
    @property
    def is_open(self) -> bool:
        """True while the file is held for writing."""
        return self._fd is not None

    def write_sample(self, q: float, n: int | None, scheme: str) -> None:
        """Append a record-level Poisson or full-batch sampling event."""
        key = (q, n, scheme)
        body = self._sample_bodies.get(key)
        if body is None:
            body = _remember(self._sample_bodies, key, ff.sample_body(q, n, scheme))
        self._write_event(body)

    def write_event(self, event: SamplingEvent) -> None:
        """Append a sampling event of any scheme and unit."""
        body = self._event_bodies.get(event)
        if body is None:
            body = _remember(self._event_bodies, event, ff.sampling_event_body(event))
        self._write_event(body)

    def write_correlated(self, event: CorrelatedReleaseEvent) -> None:
        """Append a correlated-noise release (a ``correlated_release`` line)."""
        self._write_event(ff.correlated_release_body(event))

    def write_note(self, metadata: dict[str, Any]) -> None:
        """Append a note (a ``note`` line: the time and JSON metadata) and flush."""
        self._append_marker("note", {"time": ff.utc_timestamp(), "metadata": metadata})
        self.flush()

    def write_stream_step(self, event: StreamStepEvent) -> None:
        """Append a step of a correlated-noise release's stream (a ``stream_step`` line)."""
        self._write_event(ff.stream_step_body(event))

    def write_query(self, s: float, sigma: float, label: str | None) -> None:
        """Append a Gaussian sum query (the hot path: :meth:`_write_event` is inlined)."""
        key = (s, sigma, label)
        body = self._query_bodies.get(key)
        if body is None:
            body = ff.sum_query_body(s, sigma, ff.encode_label(label))
            body = _remember(self._query_bodies, key, body)
        self.seq += 1
        line, self.head = ff.encode_event(self.seq, self.head, body)
        self._buffer.append(line)
        if (
            len(self._buffer) >= self._buffer_size
            or time.monotonic() - self._last_flush >= self._flush_interval
        ):
            self.flush()

    def _write_event(self, body: str) -> None:
        self.seq += 1
        line, self.head = ff.encode_event(self.seq, self.head, body)
        self._buffer.append(line)
        if (
            len(self._buffer) >= self._buffer_size
            or time.monotonic() - self._last_flush >= self._flush_interval
        ):
            self.flush()

    def _append_marker(self, kind: str, fields: dict[str, Any]) -> None:
        self.seq += 1
        line, self.head = ff.encode_marker(self.seq, self.head, kind, fields)
        self._buffer.append(line)

    def flush(self) -> None:
        """Write the buffered lines (and ``fsync`` if the journal was opened so).

        If the write fails the exception propagates and the bytes not written stay buffered
        for the next flush.
        """
        self._last_flush = time.monotonic()
        if self._fd is None or not self._buffer:
            return
        view = memoryview(b"".join(self._buffer))
        self._buffer.clear()
        try:
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
        except BaseException:
            self._buffer.append(bytes(view))  # keep exactly what was not written
            raise
        if self._fsync:
            os.fsync(self._fd)

    def close(self, *, events: int, steps: int) -> None:
        """Write the close marker (with the ledger's event and step counts), flush, fsync and
        release the file; the file is released even if the final write fails."""
        fd = self._fd
        if fd is None:
            return
        self._append_marker("close", {"time": ff.utc_timestamp(), "events": events, "steps": steps})
        try:
            self.flush()
            os.fsync(fd)
            self.closed_cleanly = True
        finally:
            self._fd = None
            self._buffer.clear()
            _OPEN_JOURNALS.discard(self)
            os.close(fd)

    def detach_after_fork(self) -> None:
        """In a forked child: drop the parent's buffer and descriptor; never write again."""
        fd = self._fd
        self._buffer.clear()
        self._fd = None
        if self._on_fork is not None:
            self._on_fork()
        if fd is not None:
            # Closing the child's copy does not release the parent's lock (flock locks belong
            # to the open file description, which the parent still holds).
            with contextlib.suppress(OSError):
                os.close(fd)

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is None:
            return
        try:
            self.flush()
        except Exception:
            logger.exception("could not flush ledger %s when it was garbage-collected", self.path)
        finally:
            self._fd = None
            with contextlib.suppress(OSError):
                os.close(fd)
