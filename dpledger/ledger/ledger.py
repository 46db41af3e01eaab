"""The privacy ledger: an append-only record of sampling and sum-query events.

Mechanisms append a sampling event when they draw a sample and one sum-query event per Gaussian
sum query they compute on it, with the clip bound and noise they actually used. Accountants replay
the ledger afterwards (McMahan & Andrew, section 5). A ledger lives in memory or is backed by a
file in the format of :mod:`dpledger.ledger.fileformat`.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
import time
import warnings
import weakref
from array import array
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import attrs

from dpledger._version import __version__
from dpledger.errors import (
    InvalidParameterError,
    LedgerExistsError,
    LedgerLockedError,
    LedgerStateError,
    NotALedgerError,
)
from dpledger.ledger import fileformat as ff
from dpledger.ledger.events import (
    NeighboringRelation,
    SamplingEvent,
    SamplingScheme,
    SumQueryEvent,
)
from dpledger.ledger.steps import CompressedLedger, LedgerStep, RunCompressor, StepRun

if TYPE_CHECKING:
    import dp_accounting

__all__ = ["LedgerHeader", "LedgerWarning", "PrivacyLedger"]

logger = logging.getLogger(__name__)

_SAMPLE = 0
_QUERY = 1
_SCHEMES = (SamplingScheme.POISSON, SamplingScheme.FULL)
_SCHEME_CODE = {SamplingScheme.POISSON: 0, SamplingScheme.FULL: 1}
_NO_N = -1.0  # stored population size when it is unknown


class LedgerWarning(UserWarning):
    """A ledger file was cut short (a crash) or not closed; what was lost is named."""


@attrs.frozen
class LedgerHeader:
    """What a ledger says about itself.

    Attributes:
        neighboring: the neighboring relation the ledger's guarantee is stated for.
        metadata: user metadata given when the ledger was created (JSON values).
        created: creation time, ISO 8601 UTC.
        library_version: the dpledger version that created the ledger.
        format_version: the file-format version (1).
    """

    neighboring: NeighboringRelation
    metadata: dict[str, Any]
    created: str
    library_version: str
    format_version: int = ff.FORMAT_VERSION


_OPEN_LEDGERS: weakref.WeakSet[PrivacyLedger] = weakref.WeakSet()


@atexit.register
def _flush_open_ledgers() -> None:  # pragma: no cover - runs at interpreter exit
    for ledger in list(_OPEN_LEDGERS):
        try:
            ledger.flush()
        except Exception:
            logger.exception("could not flush ledger %s at exit", ledger.path)


def _check_probability_fast(value: Any) -> float:
    # The hot path of record_sample: plain floats in [0, 1] pass without further conversion.
    if type(value) is float and 0.0 <= value <= 1.0:
        return value
    from dpledger.validation import check_probability

    return check_probability("sampling_probability", value)


class PrivacyLedger:
    """An append-only ledger of sampling and sum-query events, in memory or backed by a file.

    Example:
        >>> ledger = PrivacyLedger()                                   # in memory
        >>> ledger.record_sample(sampling_probability=0.01, population_size=60_000)
        >>> ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.1, label="dense/kernel")
        >>> ledger.num_steps, ledger.runs()[0].noise_multiplier
        (1, 1.1)

    With a path, every event is also appended to that file (buffered; see :meth:`flush`)::

        with PrivacyLedger("run.dpl", neighboring="add_remove", metadata={"model": "cnn"}) as led:
            ...
        ledger = PrivacyLedger.load("run.dpl")

    Args:
        path: file to create, or None for an in-memory ledger. A path that exists is an error
            unless ``resume=True``.
        neighboring: ``"add_remove"`` (default for a new ledger) or ``"replace_one"``. On resume
            it defaults to, and must equal, the file's relation.
        metadata: JSON-serialisable dict stored in the header (on resume: in the resume marker).
        resume: continue the existing file at ``path`` (the hash chain continues; a torn final
            line from a crash is moved aside to ``<path>.torn-<offset>``). Creates the file if it
            does not exist.
        buffer_size: events held in memory before they are written to the file.
        flush_interval: seconds after which an append writes the buffer even if it is not full.
        fsync: also ``os.fsync`` on every flush (durable against power loss, slower).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        neighboring: NeighboringRelation | str | None = None,
        metadata: dict[str, Any] | None = None,
        resume: bool = False,
        buffer_size: int = 1024,
        flush_interval: float = 1.0,
        fsync: bool = False,
    ) -> None:
        relation = None if neighboring is None else NeighboringRelation.parse(neighboring)
        meta = {} if metadata is None else metadata
        meta_json = ff.dump_metadata(meta)
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
            raise InvalidParameterError("buffer_size", buffer_size, "an integer >= 1")
        if (
            isinstance(flush_interval, bool)
            or not isinstance(flush_interval, (int, float))
            or not flush_interval >= 0
        ):
            raise InvalidParameterError("flush_interval", flush_interval, "a number >= 0")
        self._init_storage()
        self.path: str | None = None if path is None else os.fspath(path)
        self._buffer_size = buffer_size
        self._flush_interval = float(flush_interval)
        self._fsync = bool(fsync)
        self._fd: int | None = None
        self._buffer: list[bytes] = []
        self._last_flush = time.monotonic()
        self._read_only = False
        self._closed = False
        self._seq = 0
        self._head = ff.GENESIS_HASH

        if self.path is None:
            self.header = LedgerHeader(
                neighboring=relation or NeighboringRelation.ADD_REMOVE,
                metadata=json.loads(meta_json),
                created=ff.utc_timestamp(),
                library_version=__version__,
            )
            return
        if os.path.isdir(self.path):
            raise NotALedgerError(f"path {self.path!r} is a directory, not a file", path=self.path)
        if os.path.exists(self.path):
            if not resume:
                raise LedgerExistsError(
                    f"{self.path!r} already exists; pass resume=True to append to it, "
                    "or choose a new path",
                    path=self.path,
                )
            self._open_existing(relation, meta if metadata is not None else None)
        else:
            self._create(relation or NeighboringRelation.ADD_REMOVE, meta_json)
        _OPEN_LEDGERS.add(self)

    # ------------------------------------------------------------------ storage
    def _init_storage(self) -> None:
        self._kind = bytearray()  # _SAMPLE or _QUERY per event
        self._a = array("d")  # q, or S
        self._b = array("d")  # n (or _NO_N), or σ̃
        self._c = array("i")  # scheme code, or label id (-1: no label)
        self._labels: list[str] = []
        self._label_ids: dict[str, int] = {}
        self._label_json: list[str] = []
        self._keep_events = True
        self._num_events = 0
        self._compressor = RunCompressor()
        self._populations: set[int | None] = set()

    def _label_id(self, label: str | None) -> int:
        if label is None:
            return -1
        lid = self._label_ids.get(label)
        if lid is None:
            if not isinstance(label, str):
                raise InvalidParameterError("label", label, "a string or None")
            lid = len(self._labels)
            self._labels.append(label)
            self._label_ids[label] = lid
            self._label_json.append(json.dumps(label))
        return lid

    # ------------------------------------------------------------------ files
    def _lock(self, fd: int) -> None:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows
            import msvcrt

            try:
                msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
            except OSError:
                os.close(fd)
                raise LedgerLockedError(
                    f"{self.path!r} is open for writing by another process", path=self.path
                ) from None
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise LedgerLockedError(
                f"{self.path!r} is open for writing by another ledger (this or another process); "
                "close that one first",
                path=self.path,
            ) from None

    def _create(self, relation: NeighboringRelation, meta_json: str) -> None:
        assert self.path is not None
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        except FileExistsError:
            raise LedgerExistsError(
                f"{self.path!r} already exists; pass resume=True to append to it", path=self.path
            ) from None
        self._lock(fd)
        self._fd = fd
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
        self._head = digest
        self._buffer.append(line)
        self.flush()  # the header is written at once, so a new file is a ledger from the start

    def _open_existing(
        self, relation: NeighboringRelation | None, metadata: dict[str, Any] | None
    ) -> None:
        assert self.path is not None
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND)
        self._lock(fd)
        try:
            with open(self.path, "rb") as fp:
                reader = ff.LedgerReader(fp, path=self.path)
                self._replay(reader)
            if reader.header_torn or reader.header is None:
                raise NotALedgerError(
                    f"{self.path!r} has no complete header (its writer stopped before writing "
                    "it); nothing can be resumed: move it aside and start a new ledger",
                    path=self.path,
                )
            if relation is not None and relation is not reader.header.neighboring:
                raise InvalidParameterError(
                    "neighboring",
                    relation.value,
                    f"the relation of the existing ledger, {reader.header.neighboring.value!r}",
                )
            if reader.torn_tail is not None:
                self._set_aside_torn_tail(fd, reader.torn_tail)
            if reader.missing_newline:
                os.write(fd, b"\n")
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._seq = reader.last_seq
        self._head = reader.head_hash
        fields: dict[str, Any] = {"time": ff.utc_timestamp(), "library_version": __version__}
        if metadata is not None:
            fields["metadata"] = json.loads(ff.dump_metadata(metadata))
        self._append_marker("resume", fields)
        self._compressor.end_step()  # a resumed run opens a new step before any query
        self.flush()

    def _set_aside_torn_tail(self, fd: int, torn: ff.TornTail) -> None:
        assert self.path is not None
        with open(self.path, "rb") as fp:
            fp.seek(torn.offset)
            tail = fp.read()
        aside = f"{self.path}.torn-{torn.offset}"
        with open(aside, "wb") as out:
            out.write(tail)
        os.ftruncate(fd, torn.offset)
        warnings.warn(
            f"{self.path}: {torn.describe()}; its {len(tail)} bytes were moved to {aside} "
            "before appending",
            LedgerWarning,
            stacklevel=4,
        )

    def _replay(self, reader: ff.LedgerReader) -> None:
        """Rebuild the in-memory state from a verified file's records."""
        rec_q = self._append_sample
        rec_s = self._append_query
        for kind, obj in reader:
            if kind == "sample":
                rec_q(obj["sampling_probability"], obj["population_size"], obj["scheme"])
            elif kind == "sum_query":
                rec_s(obj["l2_norm_bound"], obj["noise_stddev"], obj["label"])
            else:  # a resume marker ends the step that was open; close markers need nothing
                self._compressor.end_step()
        if reader.header is not None:
            self.header = LedgerHeader(
                neighboring=reader.header.neighboring,
                metadata=reader.header.metadata,
                created=reader.header.created,
                library_version=reader.header.library_version,
                format_version=reader.header.format_version,
            )
        else:
            self.header = LedgerHeader(
                neighboring=NeighboringRelation.ADD_REMOVE,
                metadata={},
                created="",
                library_version="",
            )
        self._closed_cleanly = reader.last_kind == "close"

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, keep_events: bool = True) -> PrivacyLedger:
        """Load and verify a ledger file, read-only.

        A file cut short by a crash loads as its longest valid prefix with a
        :class:`LedgerWarning` that names what was cut; a file that was altered raises
        :class:`~dpledger.errors.LedgerVerificationError` naming the first bad line.

        Args:
            path: the ledger file.
            keep_events: keep every event in memory (needed for :meth:`steps` and
                :meth:`events`). With False only the compressed view is kept, so memory is
                bounded by the number of distinct runs, not by the number of events.
        """
        spath = os.fspath(path)
        if os.path.isdir(spath):
            raise NotALedgerError(f"path {spath!r} is a directory, not a file", path=spath)
        self = cls.__new__(cls)
        self._init_storage()
        self._keep_events = bool(keep_events)
        self.path = spath
        self._fd = None
        self._buffer = []
        self._read_only = True
        self._closed = False
        with open(spath, "rb") as fp:
            reader = ff.LedgerReader(fp, path=spath)
            self._replay(reader)
        self._seq = reader.last_seq
        self._head = reader.head_hash
        self.torn_tail: ff.TornTail | None = reader.torn_tail
        self.header_torn = reader.header_torn
        if reader.header_torn:
            warnings.warn(
                f"{spath}: the header is incomplete (the writer stopped before finishing it); "
                "loaded as an empty ledger",
                LedgerWarning,
                stacklevel=2,
            )
        elif reader.torn_tail is not None:
            warnings.warn(
                f"{spath}: {reader.torn_tail.describe()}; loaded the {self._num_events} events "
                "before it",
                LedgerWarning,
                stacklevel=2,
            )
        return self

    # ------------------------------------------------------------------ recording
    def _check_writable(self) -> None:
        if self._read_only:
            raise LedgerStateError(
                "this ledger was loaded read-only; open it with "
                "PrivacyLedger(path, resume=True) to append"
            )
        if self._closed:
            raise LedgerStateError("this ledger is closed; no further events can be recorded")

    def record_sample(
        self,
        *,
        sampling_probability: float,
        population_size: int | None = None,
        scheme: SamplingScheme | str | None = None,
    ) -> None:
        """Record that a sample was drawn; this opens a new step.

        Args:
            sampling_probability: q in [0, 1], the probability with which each record was
                included (of the sampler actually used).
            population_size: n, the number of records sampled from (None if unknown).
            scheme: ``"poisson"`` (default for q < 1) or ``"full"`` (default for q = 1).
        """
        self._check_writable()
        q = _check_probability_fast(sampling_probability)
        if population_size is None or (type(population_size) is int and population_size >= 1):
            n = population_size
        else:
            n = SamplingEvent(q, population_size).population_size  # validates and converts
        if scheme is None:
            sch = SamplingScheme.FULL if q == 1.0 else SamplingScheme.POISSON
        else:
            sch = SamplingEvent(q, n, scheme).scheme  # validates the scheme against q
        self._append_sample(q, n, sch.value)
        if self._fd is not None:
            self._seq += 1
            line, self._head = ff.encode_sample(self._seq, self._head, q, n, sch.value)
            self._enqueue(line)

    def record_sum_query(
        self, *, l2_norm_bound: float, noise_stddev: float, label: str | None = None
    ) -> None:
        """Record a Gaussian sum query on the current step's sample.

        Args:
            l2_norm_bound: S > 0, the L2 norm every record's contribution was clipped to.
            noise_stddev: σ̃ ≥ 0, the standard deviation of the noise added to each coordinate
                of the sum. σ̃ = 0 is recorded, and makes the step non-private (ε = ∞).
            label: optional name of what was queried.
        """
        self._check_writable()
        if type(l2_norm_bound) is float and 0.0 < l2_norm_bound < math.inf:
            s = l2_norm_bound
        else:
            s = SumQueryEvent(l2_norm_bound, 1.0).l2_norm_bound  # validates
        if type(noise_stddev) is float and 0.0 <= noise_stddev < math.inf:
            sigma = noise_stddev
        else:
            sigma = SumQueryEvent(1.0, noise_stddev).noise_stddev  # validates
        if label is not None and not isinstance(label, str):
            raise InvalidParameterError("label", label, "a string or None")
        if not self._compressor.step_open:
            raise LedgerStateError(
                "record_sum_query called with no open step: record a sampling event first "
                "(record_sample) — every sum query must belong to a sample"
            )
        lid = self._append_query(s, sigma, label)
        if self._fd is not None:
            self._seq += 1
            label_json = "null" if lid < 0 else self._label_json[lid]
            line, self._head = ff.encode_sum_query(self._seq, self._head, s, sigma, label_json)
            self._enqueue(line)

    def _append_sample(self, q: float, n: int | None, scheme: str) -> None:
        if self._keep_events:
            self._kind.append(_SAMPLE)
            self._a.append(q)
            self._b.append(_NO_N if n is None else float(n))
            self._c.append(0 if scheme == "poisson" else 1)
        if n not in self._populations:
            self._populations.add(n)
        self._compressor.add_sample(q)
        self._num_events += 1

    def _append_query(self, s: float, sigma: float, label: str | None) -> int:
        lid = self._label_id(label)
        if self._keep_events:
            self._kind.append(_QUERY)
            self._a.append(s)
            self._b.append(sigma)
            self._c.append(lid)
        self._compressor.add_query(s, sigma)
        self._num_events += 1
        return lid

    def _enqueue(self, line: bytes) -> None:
        self._buffer.append(line)
        if (
            len(self._buffer) >= self._buffer_size
            or time.monotonic() - self._last_flush >= self._flush_interval
        ):
            self.flush()

    def _append_marker(self, kind: str, fields: dict[str, Any]) -> None:
        self._seq += 1
        line, self._head = ff.encode_marker(self._seq, self._head, kind, fields)
        self._buffer.append(line)

    def flush(self) -> None:
        """Write buffered events to the file (and ``fsync`` if the ledger was opened so).

        Every event recorded before a flush survives a crash of the process after it. No-op for
        an in-memory ledger.
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
            self._buffer.append(bytes(view))  # keep exactly what was not written (disk full, …)
            raise
        if self._fsync:
            os.fsync(self._fd)

    def close(self) -> None:
        """Finish the ledger: write a close marker, flush, release the file. Idempotent.

        The ledger stays readable (steps, runs, accounting) after closing.
        """
        if self._closed or self._read_only:
            self._closed = True
            return
        self._compressor.end_step()
        if self._fd is not None:
            self._append_marker(
                "close",
                {
                    "time": ff.utc_timestamp(),
                    "events": self._num_events,
                    "steps": self._compressor.num_steps,
                },
            )
            try:
                self.flush()
                os.fsync(self._fd)
            finally:
                os.close(self._fd)
                self._fd = None
                _OPEN_LEDGERS.discard(self)
        self._closed = True

    def __enter__(self) -> PrivacyLedger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - depends on garbage collection timing
        fd = getattr(self, "_fd", None)
        if fd is None:
            return
        try:
            self.flush()
        except Exception:
            logger.exception("could not flush ledger %s when it was garbage-collected", self.path)
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
            self._fd = None

    # ------------------------------------------------------------------ reading
    @property
    def neighboring(self) -> NeighboringRelation:
        """The ledger's neighboring relation."""
        return self.header.neighboring

    @property
    def num_events(self) -> int:
        """Number of sampling and sum-query events recorded."""
        return self._num_events

    @property
    def num_steps(self) -> int:
        """Number of steps (sampling events)."""
        return self._compressor.num_steps

    @property
    def labels(self) -> tuple[str, ...]:
        """The distinct sum-query labels, in order of first use."""
        return tuple(self._labels)

    @property
    def population_sizes(self) -> tuple[int | None, ...]:
        """The distinct population sizes n of the sampling events (None: unknown)."""
        return tuple(sorted(self._populations, key=lambda n: (n is None, n or 0)))

    @property
    def head_hash(self) -> str | None:
        """Hash of the last line written or buffered for a file-backed ledger, else None.

        Publishing this value anchors the ledger: any later change to the file, including
        deleting its last lines, makes the file's head differ.
        """
        return None if self.path is None else self._head

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has been called."""
        return self._closed

    @property
    def closed_cleanly(self) -> bool | None:
        """For a loaded ledger: whether the file ends with a close marker."""
        return getattr(self, "_closed_cleanly", None)

    def runs(self) -> tuple[StepRun, ...]:
        """Runs of consecutive steps with identical (q, z_eff), maintained while recording."""
        return self._compressor.runs()

    def compressed(self) -> CompressedLedger:
        """The ledger as accountants see it: relation plus runs (see :class:`CompressedLedger`)."""
        return CompressedLedger(neighboring=self.neighboring, runs=self.runs())

    def _require_events(self) -> None:
        if not self._keep_events:
            raise LedgerStateError(
                "this ledger was loaded with keep_events=False; reload it with keep_events=True "
                "to iterate over its events or steps"
            )

    def events(self) -> Iterator[SamplingEvent | SumQueryEvent]:
        """All sampling and sum-query events, in the order they were recorded."""
        self._require_events()
        labels = self._labels
        for i in range(len(self._kind)):
            if self._kind[i] == _SAMPLE:
                b = self._b[i]
                yield SamplingEvent(
                    self._a[i], None if b == _NO_N else int(b), _SCHEMES[self._c[i]]
                )
            else:
                lid = self._c[i]
                yield SumQueryEvent(self._a[i], self._b[i], None if lid < 0 else labels[lid])

    def steps(self) -> Iterator[LedgerStep]:
        """The steps in order, each with its sampling event and its sum queries."""
        current: SamplingEvent | None = None
        queries: list[SumQueryEvent] = []
        index = 0
        for event in self.events():
            if isinstance(event, SamplingEvent):
                if current is not None:
                    yield LedgerStep(index, current, tuple(queries))
                    index += 1
                current, queries = event, []
            else:
                queries.append(event)
        if current is not None:
            yield LedgerStep(index, current, tuple(queries))

    def to_dp_event(self) -> dp_accounting.DpEvent:
        """The equivalent ``dp_accounting`` event, for any dp-accounting accountant.

        Each run of identical steps becomes ``SelfComposedDpEvent(PoissonSampledDpEvent(q,
        GaussianDpEvent(z_eff)), count)`` (a bare Gaussian when q = 1), composed in order. The
        neighboring relation is not part of a DpEvent: construct the dp-accounting accountant
        with the ledger's relation (:attr:`neighboring`).
        """
        from dpledger.ledger.dp_event import compressed_to_dp_event

        return compressed_to_dp_event(self.compressed())

    def __repr__(self) -> str:
        where = "memory" if self.path is None else repr(self.path)
        return (
            f"PrivacyLedger({where}, neighboring={self.neighboring.value!r}, "
            f"steps={self.num_steps}, events={self.num_events})"
        )
