"""The privacy ledger: an append-only record of sampling and sum-query events.

Mechanisms append a sampling event when they draw a sample and one sum-query event per Gaussian
sum query they compute on it, with the clip bound and noise they actually used. Accountants replay
the ledger afterwards (McMahan & Andrew, section 5). A ledger lives in memory or is backed by a
file in the format of :mod:`dpledger.ledger.fileformat` (docs/ledger-format.md).

:class:`PrivacyLedger` checks what it is given and appends it to its two parts: the column store
(:mod:`dpledger.ledger.store`), which keeps the events in flat arrays (no object per event) with
the run-length view that accountants need, maintained while recording so that replay never
rescans the events; and, for a ledger with a file, the journal (:mod:`dpledger.ledger.journal`),
which writes every event as a line of the file's hash chain.

This module is over 500 lines because it is one class, :class:`PrivacyLedger`, the single
object users record into and read from: most of its lines are the public methods' docstrings and
argument checks (every kind of line it records, notes and write-ahead flushing included); what it
stores and writes is in those two modules.
"""

from __future__ import annotations

import json
import math
import os
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from dpledger._version import __version__
from dpledger.errors import (
    InvalidParameterError,
    LedgerStateError,
    NotALedgerError,
)
from dpledger.ledger import fileformat as ff
from dpledger.ledger.correlated import CorrelatedReleaseEvent, StreamStepEvent
from dpledger.ledger.events import (
    NeighboringRelation,
    SamplingEvent,
    SamplingScheme,
    SumQueryEvent,
    full_scheme_expectation,
)
from dpledger.ledger.fileformat import LedgerHeader
from dpledger.ledger.intent import intent_of
from dpledger.ledger.journal import LedgerJournal, LedgerWarning
from dpledger.ledger.steps import CompressedLedger, LedgerStep, StepRun
from dpledger.ledger.store import LedgerColumns
from dpledger.validation import (
    check_bool,
    check_non_negative_finite,
    check_optional_str,
    check_positive_finite,
    check_positive_int,
    check_probability,
)

if TYPE_CHECKING:
    import dp_accounting

__all__ = ["LedgerHeader", "LedgerWarning", "PrivacyLedger"]


def _population_size(value: Any) -> int:
    try:
        return check_positive_int("population_size", value)
    except InvalidParameterError:
        raise InvalidParameterError(
            "population_size", value, "an integer >= 1, or None if unknown"
        ) from None


def _fork_notice(ledger: PrivacyLedger) -> Callable[[], None]:
    """What a journal calls in a forked child: the ledger refuses to append from then on."""
    ref = weakref.ref(ledger)

    def notice() -> None:
        owner = ref()
        if owner is not None:
            owner._forked = True
            owner._closed = True
            owner._writable = False

    return notice


class PrivacyLedger:
    """An append-only ledger of sampling and sum-query events, in memory or backed by a file.

    A *step* is one sampling event (a sample drawn with probability q from n records) followed by
    the Gaussian sum queries (S_g, σ̃_g) computed on that sample. For accounting a step is one
    Gaussian query with noise multiplier z_eff = (Σ_g (S_g/σ̃_g)²)^(-1/2) (McMahan & Andrew,
    Eq. 1) on a Poisson sample with probability q.

    Example:
        >>> ledger = PrivacyLedger()                                   # in memory
        >>> ledger.record_sample(sampling_probability=0.01, population_size=60_000)
        >>> ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.1, label="dense/kernel")
        >>> ledger.num_steps, ledger.runs()[0].noise_multiplier
        (1, 1.1)

    With a path, every event is also appended to that file::

        with PrivacyLedger("run.dpl", neighboring="add_remove", metadata={"model": "cnn"}) as led:
            ...
        ledger = PrivacyLedger.load("run.dpl")

    **Write-ahead.** A step's events reach the file (at least the operating system's buffer)
    before the step changes any parameter, so a crash, even a ``kill -9`` right after a
    weights-only checkpoint, may lose a step that was not applied but never one that was.
    The write-ahead point is :meth:`flush`: every dpledger mechanism calls it once per release,
    after recording the release's events and before returning its noisy output (the Gaussian
    sum queries, grouped or not, and so every PyTorch and TensorFlow step, also on rank 0 of a
    distributed run), and :meth:`record_correlated_release` and :meth:`record_stream_step`,
    which are recorded just before their noise is used, write at once. Events recorded
    directly with :meth:`record_sample` and :meth:`record_sum_query` are held in a buffer
    until that point: code that draws its own noise after recording them must call
    :meth:`flush` before it uses the noisy values.

    Args:
        path: file to create, or None for an in-memory ledger. A path that exists is an error
            unless ``resume=True``.
        neighboring: ``"add_remove"`` (default for a new ledger) or ``"replace_one"``. On resume
            it defaults to, and must equal, the file's relation.
        metadata: JSON-serialisable dict stored in the header (on resume: in the resume marker).
        resume: continue the existing file at ``path``: its lines are verified, the hash chain
            continues after them, and a ``resume`` marker starts the new session. A torn final
            line from a crash is moved aside to ``<path>.torn-<offset>`` first. The file is
            created if it does not exist.
        buffer_size: at most this many events recorded directly (:meth:`record_sample`,
            :meth:`record_sum_query`) are held before they are written, even with no
            write-ahead point in between (bulk recording without noise). It never holds an
            event past a write-ahead point, however few are buffered.
        flush_interval: seconds after which recording an event writes the buffer even if it is
            neither full nor at a write-ahead point (checked when an event is recorded; there is
            no background thread).
        fsync: also ``os.fsync`` on every write, each write-ahead point included (durable
            against power loss, not only a crash of the process; one ``fsync`` per step).

    A ledger is not thread-safe: record from one thread, or guard the calls with a lock.

    Raises:
        InvalidParameterError: a bad argument (named with its value).
        LedgerExistsError: ``path`` exists and ``resume`` is False.
        LedgerLockedError: another ledger (in this or another process) has the file open.
        NotALedgerError: ``path`` is a directory, or an existing file that is not a ledger.
        LedgerVerificationError: on resume, the existing file was altered.
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
        # Everything is checked before anything is opened or written.
        spath = _check_path(path)
        relation = None if neighboring is None else NeighboringRelation.parse(neighboring)
        meta_json = ff.dump_metadata({} if metadata is None else metadata)
        if check_bool("resume", resume) and spath is None:
            raise InvalidParameterError("resume", resume, "False for an in-memory ledger")
        check_bool("fsync", fsync)
        buffer_size = check_positive_int("buffer_size", buffer_size)
        flush_interval = check_non_negative_finite("flush_interval", flush_interval)

        self._store = LedgerColumns()
        self.path: str | None = spath
        self._journal: LedgerJournal | None = None
        self._read_only = False
        self._closed = False
        self._forked = False
        self._writable = True  # not read-only, not closed, not a forked child's copy
        self.torn_tail: ff.TornTail | None = None
        self.header_torn = False

        if spath is None:
            self.header = LedgerHeader(
                neighboring=relation or NeighboringRelation.ADD_REMOVE,
                metadata=json.loads(meta_json),
                created=ff.utc_timestamp(),
                library_version=__version__,
            )
            return
        if os.path.isdir(spath):
            raise NotALedgerError(f"path {spath!r} is a directory, not a file", path=spath)
        options: dict[str, Any] = {
            "buffer_size": buffer_size,
            "flush_interval": flush_interval,
            "fsync": fsync,
            "on_fork": _fork_notice(self),
        }
        if resume and os.path.exists(spath):
            self._journal = LedgerJournal.resume(
                spath, relation, None if metadata is None else meta_json, self._store, **options
            )
            self._store.end_step()  # a resumed run opens a new step before any query
        else:
            self._journal = LedgerJournal.create(
                spath,
                relation or NeighboringRelation.ADD_REMOVE,
                meta_json,
                resume=resume,
                **options,
            )
        self.header = self._journal.header

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, keep_events: bool = True) -> PrivacyLedger:
        """Load and verify a ledger file, read-only.

        A file cut short by a crash loads as its longest valid prefix with a
        :class:`LedgerWarning` that names what was cut; a file that was altered raises
        :class:`~dpledger.errors.LedgerVerificationError` naming the first bad line. Deleting a
        file's last lines cannot be told from a crash by the file alone: compare
        :attr:`head_hash` with a published value, and :attr:`closed_cleanly`.

        Args:
            path: the ledger file.
            keep_events: keep every event in memory (needed for :meth:`steps` and
                :meth:`events`). With False only the compressed view (and the distinct labels
                and population sizes) is kept, so memory does not grow with the number of events.

        Raises:
            NotALedgerError: ``path`` is a directory or not a ledger file.
            MissingHeaderError: the file holds no complete header (it is empty, or its writer
                stopped in line 1): there is nothing to load, not even the neighboring relation.
            LedgerVerificationError: the file was altered; names the first bad line.
            OSError: the file cannot be read (e.g. ``FileNotFoundError``).
        """
        spath = _check_path(path)
        if spath is None:
            raise InvalidParameterError("path", path, "the path of a ledger file")
        check_bool("keep_events", keep_events)
        if os.path.isdir(spath):
            raise NotALedgerError(f"path {spath!r} is a directory, not a file", path=spath)
        self = cls.__new__(cls)
        self._store = LedgerColumns(keep_events=keep_events)
        self.path = spath
        self._read_only = True
        self._closed = False
        self._forked = False
        self._writable = False
        self._journal = journal = LedgerJournal.load(spath, self._store)
        self.header = journal.header
        self.torn_tail = journal.torn_tail
        self.header_torn = journal.header_torn
        return self

    # ------------------------------------------------------------------ recording
    def _not_writable(self) -> LedgerStateError:
        if self._read_only:
            return LedgerStateError(
                "this ledger was loaded read-only; open it with "
                "PrivacyLedger(path, resume=True) to append"
            )
        if self._forked:
            return LedgerStateError(
                "this ledger was opened by the parent of this forked process; only that process "
                "may append to it"
            )
        return LedgerStateError("this ledger is closed; no further events can be recorded")

    def _require_version_2(self, what: str) -> None:
        if self.header.format_version < 2 and self.path is not None:
            raise LedgerStateError(
                f"{self.path} is a format-version-1 ledger, which cannot hold {what}; "
                "record this run in a new ledger file"
            )

    def record_sample(
        self,
        *,
        sampling_probability: float | None = None,
        population_size: int | None = None,
        scheme: SamplingScheme | str | None = None,
        event: SamplingEvent | None = None,
    ) -> None:
        """Record that a sample was drawn; this opens a new step.

        Give either q (with n and the scheme, for a record-level Poisson or full-batch sample)
        or ``event``, a :class:`~dpledger.ledger.events.SamplingEvent` of any scheme and unit
        (``SamplingEvent.fixed_size(b, n)``, ``.truncated_poisson(q, n, m)``,
        ``.balls_in_bins(k, n, epoch_start=...)``, ``.shuffle(b, n, epoch_start=...)``, or a
        user-level ``.poisson(q, n, unit="user")``), which is recorded as it is.

        Args:
            sampling_probability: q in [0, 1], the probability with which each record was
                included, of the sampler actually used (not 1 / number of batches).
            population_size: n ≥ 1, the number of records sampled from (None if unknown).
            scheme: ``"poisson"`` (default for q < 1) or ``"full"`` (default for q = 1; only
                valid with q = 1). Other schemes need their parameters: give ``event``.
            event: the sampling event, instead of the three arguments above.

        Raises:
            InvalidParameterError: a bad value; the ledger is unchanged.
            LedgerStateError: the ledger is closed or read-only, or ``event`` is an extended
                event and the ledger's file is format version 1 (which cannot hold it).
        """
        if not self._writable:
            raise self._not_writable()
        if event is not None or (scheme is not None and scheme not in ("poisson", "full")):
            self._record_event(sampling_probability, population_size, scheme, event)
            return
        q = sampling_probability
        if type(q) is float and 0.0 <= q <= 1.0:
            q += 0.0  # -0.0 becomes 0.0
        else:
            q = check_probability("sampling_probability", q)
        n = population_size
        if n is not None and (type(n) is not int or n < 1):
            n = _population_size(n)
        if scheme is None:
            sch = "full" if q == 1.0 else "poisson"
        else:
            sch = SamplingScheme.parse(scheme).value
            if sch == "full" and q != 1.0:
                raise InvalidParameterError("scheme", scheme, full_scheme_expectation(q))
        self._store.add_sample(q, n, sch)
        journal = self._journal
        if journal is not None:
            journal.write_sample(q, n, sch)

    def _record_event(
        self,
        sampling_probability: float | None,
        population_size: int | None,
        scheme: SamplingScheme | str | None,
        event: SamplingEvent | None,
    ) -> None:
        """record_sample for an event object (any scheme and unit)."""
        if event is None:
            SamplingScheme.parse(scheme)  # a bad name is reported as such
            raise InvalidParameterError(
                "scheme",
                scheme,
                "'poisson' or 'full' with sampling_probability=; for other schemes pass "
                "event=SamplingEvent.fixed_size(...) (or .truncated_poisson, .balls_in_bins, "
                ".shuffle), which carries the scheme's parameters",
            )
        if not isinstance(event, SamplingEvent):
            raise InvalidParameterError("event", event, "a dpledger.ledger.SamplingEvent")
        if sampling_probability is not None or population_size is not None or scheme is not None:
            raise InvalidParameterError(
                "sampling_probability",
                sampling_probability,
                "None when event= is given (the event carries q, n and the scheme)",
            )
        if event.is_classic:
            self.record_sample(
                sampling_probability=event.sampling_probability,
                population_size=event.population_size,
                scheme=event.scheme,
            )
            return
        self._require_version_2(f"a {event.describe()} sampling event")
        self._store.add_event(event)
        if self._journal is not None:
            self._journal.write_event(event)

    def record_sum_query(
        self, *, l2_norm_bound: float, noise_stddev: float, label: str | None = None
    ) -> None:
        """Record a Gaussian sum query on the current step's sample.

        The query clipped every sampled record's contribution to L2 norm ≤ S, summed, and added
        N(0, σ̃²) noise to every coordinate of the sum; it joins the step's z_eff through
        (S/σ̃)² (paper Eq. 1).

        Args:
            l2_norm_bound: S > 0, the L2 norm every record's contribution was clipped to.
            noise_stddev: σ̃ ≥ 0, the standard deviation of the noise added to each coordinate
                of the sum. σ̃ = 0 is recorded, and makes the step non-private (ε = ∞).
            label: optional name of what was queried.

        Raises:
            InvalidParameterError: a bad value; the ledger is unchanged.
            LedgerStateError: no sampling event opened a step (in this session), or the
                ledger is closed or read-only.
        """
        if not self._writable:
            raise self._not_writable()
        s = l2_norm_bound
        if not (type(s) is float and 0.0 < s < math.inf):
            s = check_positive_finite("l2_norm_bound", s)
        sigma = noise_stddev
        if type(sigma) is float and 0.0 <= sigma < math.inf:
            sigma += 0.0  # -0.0 becomes 0.0
        else:
            sigma = check_non_negative_finite("noise_stddev", sigma)
        if label is not None and type(label) is not str:
            label = check_optional_str("label", label)  # a str subclass: its plain text
        store = self._store
        if not store.compressor.step_open:
            raise LedgerStateError(
                "record_sum_query called with no open step: record a sampling event first "
                "(record_sample); every sum query must belong to a sample"
            )
        store.add_query(s, sigma, label)
        journal = self._journal
        if journal is not None:
            journal.write_query(s, sigma, label)

    def record_correlated_release(self, event: CorrelatedReleaseEvent) -> None:
        """Record a correlated-noise (matrix-mechanism) release over a whole stream of steps.

        Record it once, before the first noisy output of the stream is used: it stands for the
        whole release B·(C·X + Z) (``docs/correlated-noise.md``). It is no step: it ends the
        open step, and the stream's steps record no sampling or sum-query events of their own:
        each records one stream step (:meth:`record_stream_step`), which changes no ε. The
        event is written to the file at once (a write-ahead point, like :meth:`flush`).
        Build the event with :func:`dpledger.mechanisms.correlated.release.release_event`, which
        computes C's hash and sensitivity from C itself.

        Raises:
            InvalidParameterError: ``event`` is not a :class:`CorrelatedReleaseEvent`.
            LedgerStateError: the ledger is closed or read-only, or its file is of format
                version 1, which cannot hold the event.
        """
        if not self._writable:
            raise self._not_writable()
        if not isinstance(event, CorrelatedReleaseEvent):
            raise InvalidParameterError("event", event, "a CorrelatedReleaseEvent")
        self._require_version_2("a correlated-noise release")
        self._store.add_correlated(event)
        if self._journal is not None:
            self._journal.write_correlated(event)
            self._journal.flush()  # write-ahead: the release's noise is used next

    def record_note(self, metadata: dict[str, Any]) -> None:
        """Record a note: JSON metadata about the run that no accountant reads.

        A training adapter given a ledger whose header does not hold the run's intent records
        it this way (``{"intent": {...}}``, :mod:`dpledger.ledger.intent`), so that
        ``dpledger info`` shows it. A note is no event and no step: it ends the open step, like
        a resume marker, and is written to the file at once (a ``note`` line,
        docs/ledger-format.md).

        Raises:
            InvalidParameterError: ``metadata`` is not a JSON-serialisable dict.
            LedgerStateError: the ledger is closed or read-only, or its file is of format
                version 1, which cannot hold a note.
        """
        if not self._writable:
            raise self._not_writable()
        value = json.loads(ff.dump_metadata(metadata))
        self._require_version_2("a note")
        self._store.add_marker("note", {"metadata": value})
        if self._journal is not None:
            self._journal.write_note(value)

    @property
    def notes(self) -> tuple[dict[str, Any], ...]:
        """The metadata of the ledger's notes (:meth:`record_note`), in order."""
        return tuple(self._store.notes)

    @property
    def intent(self) -> dict[str, Any] | None:
        """The run's intent: the header's, else the last note's (None: not recorded)."""
        found = intent_of(self.header.metadata)
        for note in self._store.notes:
            found = intent_of(note) or found
        return found

    def record_stream_step(self, *, release: int, step: int) -> None:
        """Record that step ``step`` of a correlated-noise release's stream was taken.

        Record it at every step of the stream, after the step's sensitivity check and before
        its noisy output is used (the first step: the release, then step 0); the event is
        written to the file at once (a write-ahead point, like :meth:`flush`). It changes no ε
        (the release accounts for all T steps of its stream); it keeps how far the stream went,
        so that a run resumed from an older checkpoint, which would add the noise of steps
        already taken to other gradients, can be refused (``docs/correlated-noise.md``). A
        release's steps are 0, 1, 2, … in order, none repeated or skipped, each below its T.

        Args:
            release: 0-based index of the release in :attr:`correlated_releases`.
            step: 0-based index of the step; must equal :meth:`stream_progress` of the release.

        Raises:
            InvalidParameterError: ``release`` is not the index of a recorded release, or
                ``step`` is not its next step (a repeat, a gap, or T or beyond); the ledger is
                unchanged.
            LedgerStateError: the ledger is closed or read-only, or its file is of format
                version 1, which cannot hold the event.
        """
        if not self._writable:
            raise self._not_writable()
        self._require_version_2("a correlated-noise stream step")
        event = StreamStepEvent(release, step)
        store = self._store
        if event.release >= len(store.correlated):
            raise InvalidParameterError(
                "release",
                release,
                f"the index of a recorded correlated-noise release (0 to "
                f"{len(store.correlated) - 1})"
                if store.correlated
                else "the index of a recorded correlated-noise release (none is recorded: "
                "record_correlated_release first)",
            )
        taken = store.stream_progress[event.release]
        num_steps = store.correlated[event.release].num_steps
        if taken >= num_steps:
            raise InvalidParameterError(
                "step",
                step,
                f"nothing: all num_steps={num_steps} steps of release {event.release} were taken",
            )
        if event.step != taken:
            raise InvalidParameterError(
                "step",
                step,
                f"{taken}, the next step of release {event.release} (its steps are recorded "
                "0, 1, 2, ... in order; a repeated step would reuse noise already released)",
            )
        store.add_stream_step(event)
        if self._journal is not None:
            self._journal.write_stream_step(event)
            self._journal.flush()  # write-ahead: the step's noise is used next

    def stream_progress(self, release: int) -> int:
        """The number of steps recorded for a correlated-noise release's stream.

        Its steps 0 .. ``stream_progress(release) - 1`` were taken; the next is that number.

        Args:
            release: 0-based index of the release in :attr:`correlated_releases`.

        Raises:
            InvalidParameterError: no release has that index.
        """
        progress = self._store.stream_progress
        if type(release) is not int or not 0 <= release < len(progress):
            raise InvalidParameterError(
                "release",
                release,
                f"the index of a recorded correlated-noise release ({len(progress)} recorded)",
            )
        return progress[release]

    @property
    def correlated_releases(self) -> tuple[CorrelatedReleaseEvent, ...]:
        """The correlated-noise releases recorded, in order."""
        return tuple(self._store.correlated)

    def flush(self) -> None:
        """Write buffered events to the file (and ``fsync`` if the ledger was opened so).

        The write-ahead point (class docstring): events recorded before it survive a crash after
        it (with ``fsync=True``, a power loss). If the write fails (disk full, …) the exception
        propagates and the unwritten bytes stay buffered for the next flush; the events are in
        memory either way. No-op for an in-memory ledger.
        """
        if self._journal is not None:
            self._journal.flush()

    def close(self) -> None:
        """Finish the ledger: write a close marker, flush, fsync, release the file. Idempotent.

        The ledger stays readable (steps, runs, accounting) after closing. If the final write
        fails the file is still released and the error propagates; the file then ends like one
        whose writer crashed.
        """
        if self._closed or self._read_only:
            self._closed = True
            return
        self._store.end_step()
        self._closed = True
        self._writable = False
        if self._journal is not None:
            self._journal.close(events=self._store.num_events, steps=self._store.num_steps)

    def __enter__(self) -> PrivacyLedger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ reading
    @property
    def neighboring(self) -> NeighboringRelation:
        """The ledger's neighboring relation."""
        return self.header.neighboring

    @property
    def num_events(self) -> int:
        """Number of events recorded (sampling, sum-query, correlated release, stream step)."""
        return self._store.num_events

    @property
    def num_steps(self) -> int:
        """Number of steps (sampling events)."""
        return self._store.num_steps

    @property
    def labels(self) -> tuple[str, ...]:
        """The distinct sum-query labels, in order of first use."""
        return tuple(self._store.labels)

    @property
    def population_sizes(self) -> tuple[int | None, ...]:
        """The distinct population sizes n of the sampling events, ascending (None last)."""
        return self._store.population_sizes

    @property
    def head_hash(self) -> str | None:
        """Hash of the last line written or buffered for a file-backed ledger, else None.

        Publishing this value anchors the ledger: any later change to the file, including
        deleting its last lines, makes the file's head differ.
        """
        return None if self._journal is None else self._journal.head

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has been called."""
        return self._closed

    @property
    def closed_cleanly(self) -> bool | None:
        """Whether the file ends (or, for a writer, has ended) with a close marker.

        None for an in-memory ledger.
        """
        if self._journal is None:
            return None
        return self._journal.closed_cleanly

    def runs(self) -> tuple[StepRun, ...]:
        """Runs of consecutive steps with identical (q, z_eff), maintained while recording."""
        return self._store.runs()

    def compressed(self) -> CompressedLedger:
        """The ledger as accountants see it: relation plus runs (see :class:`CompressedLedger`)."""
        return CompressedLedger(
            neighboring=self.neighboring, runs=self.runs(), correlated=self._store.correlated
        )

    def events(
        self,
    ) -> Iterator[SamplingEvent | SumQueryEvent | CorrelatedReleaseEvent | StreamStepEvent]:
        """All events, in the order recorded."""
        return self._store.events()

    def steps(self) -> Iterator[LedgerStep]:
        """The steps in order, each with its sampling event and its sum queries."""
        return self._store.steps()

    def to_dp_event(self) -> dp_accounting.DpEvent:
        """The equivalent ``dp_accounting`` event, for any dp-accounting accountant.

        Each run of identical steps becomes ``SelfComposedDpEvent(PoissonSampledDpEvent(q,
        GaussianDpEvent(z_eff)), count)`` (a bare Gaussian when q = 1, ``NoOpDpEvent`` when the
        steps release nothing, ``NonPrivateDpEvent`` when z_eff = 0), composed in order. The
        neighboring relation is not part of a DpEvent: construct the dp-accounting accountant
        with the ledger's relation (:attr:`neighboring`).

        Warning:
            For a ``replace_one`` ledger use dp-accounting's PLD accountant: its RDP accountant
            (dp-accounting 0.6) accepts ``REPLACE_ONE`` but treats a ``GaussianDpEvent`` as if
            the relation were add/remove, which understates ε (for 5 full-batch steps at z = 3,
            δ = 1e-5: 3.38 against the correct 7.0). dpledger's own accountants handle the
            relation themselves.

        Raises:
            UnsupportedSamplingError: the ledger has truncated Poisson steps. dp-accounting's
                event for them takes the size of the data set holding the differing record (n
                when it is removed, n + 1 when one is added) and the guarantee is the larger of
                the two, which one event cannot express: use :meth:`to_dp_events` (or the pld
                accountant, which accounts both).
        """
        from dpledger.ledger.dp_event import compressed_to_dp_event

        return compressed_to_dp_event(self.compressed())

    def to_dp_events(self) -> list[dp_accounting.DpEvent]:
        """One ``dp_accounting`` event per neighbouring pair the ledger must be analysed for:
        the ledger's ε(δ) (or δ(ε)) is the largest of theirs.

        One event, :meth:`to_dp_event`'s, unless the ledger has truncated Poisson steps; then
        two: the neighbour with a record removed (``dataset_size = n``), then the one with a
        record added (``dataset_size = n + 1``)
        (:func:`~dpledger.ledger.dp_event.compressed_to_dp_events`).
        """
        from dpledger.ledger.dp_event import compressed_to_dp_events

        return compressed_to_dp_events(self.compressed())

    def __repr__(self) -> str:
        where = "memory" if self.path is None else repr(self.path)
        return (
            f"PrivacyLedger({where}, neighboring={self.neighboring.value!r}, "
            f"steps={self.num_steps}, events={self.num_events})"
        )


def _check_path(path: Any) -> str | None:
    if path is None:
        return None
    try:
        spath = os.fsdecode(os.fspath(path))
    except TypeError:
        raise InvalidParameterError("path", path, "a str or os.PathLike, or None") from None
    if "\x00" in spath:
        raise InvalidParameterError("path", path, "a path without NUL characters")
    return spath
