"""The ledger's column store: its events in memory, in flat columns, and the views over them.

:class:`LedgerColumns` holds what a :class:`~dpledger.ledger.ledger.PrivacyLedger` has recorded
or loaded: one entry per event in four flat arrays (no object per event), the distinct labels,
population sizes and extended sampling events they refer to, and the run-length view that
accountants need, maintained while events are added so that replay never rescans them. It does
no file I/O and no validation: the ledger checks every value before it gets here, and the file's
records arrive here already verified (:mod:`dpledger.ledger.journal`).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from typing import Any

from dpledger.errors import LedgerStateError
from dpledger.ledger.correlated import CorrelatedReleaseEvent, StreamStepEvent
from dpledger.ledger.events import SamplingEvent, SamplingScheme, SumQueryEvent
from dpledger.ledger.steps import LedgerStep, RunCompressor, StepRun

__all__ = ["LedgerColumns"]

# Event kinds in the flat storage.
_POISSON_SAMPLE = 0
_QUERY = 1
_FULL_SAMPLE = 2
_EXTENDED_SAMPLE = 3  # any other sampling event; its event is in specs[c[i]]
_CORRELATED = 4  # a correlated-noise release; its event is in correlated[c[i]]
_STREAM_STEP = 5  # step int(a[i]) of the stream of release c[i]


class LedgerColumns:
    """The events of a ledger in flat columns, with the compressed (run-length) view.

    Event ``i`` is ``kind[i]`` with the values ``a[i]`` (q, or S), ``b[i]`` (0.0, or σ̃) and
    ``c[i]`` (a population-size id, an extended-event id, or a label id, -1 for no label).

    Args:
        keep_events: keep the columns. With False only the compressed view and the distinct
            labels, population sizes and extended events are kept, so memory does not grow with
            the number of events; :meth:`events` and :meth:`steps` then raise.

    Attributes:
        compressor: the run-length view, fed while events are added.
        num_events: events added (sampling, sum-query, correlated release, stream step).
        stream_progress: for each correlated-noise release, the stream steps added (its steps
            0 .. progress - 1 were taken).
    """

    def __init__(self, *, keep_events: bool = True) -> None:
        self.keep_events = keep_events
        self.kind = bytearray()  # _POISSON_SAMPLE, _QUERY, _FULL_SAMPLE or _EXTENDED_SAMPLE
        self.a = array("d")  # q, or S
        self.b = array("d")  # 0.0, or σ̃
        self.c = array("i")  # population-size id, extended-event id, or label id (-1: no label)
        self.labels: list[str] = []
        self.label_ids: dict[str, int] = {}
        self.pops: list[int | None] = []
        self.pop_ids: dict[int | None, int] = {}
        self.specs: list[SamplingEvent] = []
        self.spec_ids: dict[SamplingEvent, int] = {}
        self.correlated: list[CorrelatedReleaseEvent] = []
        self.stream_progress: list[int] = []
        self.notes: list[dict[str, Any]] = []  # the metadata of the note lines, in order
        self.num_events = 0
        self.compressor = RunCompressor()

    # ------------------------------------------------------------------ adding
    def _new_label(self, label: str) -> int:
        lid = len(self.labels)
        self.labels.append(label)
        self.label_ids[label] = lid
        return lid

    def _new_population(self, n: int | None) -> int:
        pid = len(self.pops)
        self.pops.append(n)
        self.pop_ids[n] = pid
        return pid

    def add_sample(
        self, q: float, n: int | None, scheme: str, event: SamplingEvent | None = None
    ) -> None:
        """Add a sampling event (opens a step): q, n and ``"poisson"`` or ``"full"``, or, for
        any other scheme or unit, ``event`` (whose q, n and scheme the other arguments repeat).
        """
        pid = self.pop_ids.get(n)
        if pid is None:
            pid = self._new_population(n)
        if event is not None:
            self._add_extended(event)
            return
        if self.keep_events:
            self.kind.append(_POISSON_SAMPLE if scheme == "poisson" else _FULL_SAMPLE)
            self.a.append(q)
            self.b.append(0.0)
            self.c.append(pid)
        self.compressor.add_sample(q)
        self.num_events += 1

    def add_event(self, event: SamplingEvent) -> None:
        """Add an extended sampling event (any scheme and unit; opens a step)."""
        if event.population_size not in self.pop_ids:
            self._new_population(event.population_size)
        self._add_extended(event)

    def _add_extended(self, event: SamplingEvent) -> None:
        sid = self.spec_ids.get(event)
        if sid is None:
            sid = len(self.specs)
            self.specs.append(event)
            self.spec_ids[event] = sid
        if self.keep_events:
            self.kind.append(_EXTENDED_SAMPLE)
            self.a.append(event.sampling_probability)
            self.b.append(0.0)
            self.c.append(sid)
        self.compressor.add_sample(event.sampling_probability, event)
        self.num_events += 1

    def add_query(self, s: float, sigma: float, label: str | None) -> None:
        """Add a Gaussian sum query (S, σ̃, label) to the open step."""
        if label is None:
            lid = -1
        else:
            lid = self.label_ids.get(label, -1)
            if lid < 0:
                lid = self._new_label(label)
        if self.keep_events:
            self.kind.append(_QUERY)
            self.a.append(s)
            self.b.append(sigma)
            self.c.append(lid)
        self.compressor.add_query(s, sigma)
        self.num_events += 1

    def add_correlated(self, event: CorrelatedReleaseEvent) -> None:
        """Add a correlated-noise release (an event that is no step; it ends the open step)."""
        if self.keep_events:
            self.kind.append(_CORRELATED)
            self.a.append(0.0)
            self.b.append(0.0)
            self.c.append(len(self.correlated))
        self.correlated.append(event)
        self.stream_progress.append(0)
        self.compressor.end_step()
        self.num_events += 1

    def add_stream_step(self, event: StreamStepEvent) -> None:
        """Add a step of a correlated-noise release's stream (no step of the ledger; it ends
        the open step, as the release does). The ledger and the reader checked its order."""
        if self.keep_events:
            self.kind.append(_STREAM_STEP)
            self.a.append(float(event.step))
            self.b.append(0.0)
            self.c.append(event.release)
        self.stream_progress[event.release] += 1
        self.compressor.end_step()
        self.num_events += 1

    def add_marker(self, kind: str, fields: Any) -> None:
        """A session marker: a resume marker ends the step that was open when the previous
        session stopped; a close marker ends the last step. The reader hands correlated-noise
        releases and their stream steps over the same way (``kind`` ``"correlated_release"``
        and ``"stream_step"``)."""
        if kind == "correlated_release":
            self.add_correlated(fields)
            return
        if kind == "stream_step":
            self.add_stream_step(fields)
            return
        if kind == "note":
            self.notes.append(fields["metadata"])
        self.compressor.end_step()

    def end_step(self) -> None:
        """End the open step: no sum query may join it."""
        self.compressor.end_step()

    # ------------------------------------------------------------------ views
    @property
    def num_steps(self) -> int:
        """Number of steps (sampling events)."""
        return self.compressor.num_steps

    @property
    def population_sizes(self) -> tuple[int | None, ...]:
        """The distinct population sizes n, ascending (None last)."""
        return tuple(sorted(self.pops, key=lambda n: (n is None, n or 0)))

    def runs(self) -> tuple[StepRun, ...]:
        """Runs of consecutive steps with identical (q, z_eff)."""
        return self.compressor.runs()

    def _require_events(self) -> None:
        if not self.keep_events:
            raise LedgerStateError(
                "this ledger was loaded with keep_events=False; reload it with keep_events=True "
                "to iterate over its events or steps"
            )

    def events(
        self,
    ) -> Iterator[SamplingEvent | SumQueryEvent | CorrelatedReleaseEvent | StreamStepEvent]:
        """All events (sampling, sum-query, correlated release, stream step), in the order they
        were added."""
        self._require_events()
        labels, pops = self.labels, self.pops
        kinds, a, b, c = self.kind, self.a, self.b, self.c
        full, poisson = SamplingScheme.FULL, SamplingScheme.POISSON
        specs = self.specs
        for i in range(len(kinds)):
            kind = kinds[i]
            if kind == _QUERY:
                lid = c[i]
                yield SumQueryEvent(a[i], b[i], None if lid < 0 else labels[lid])
            elif kind == _EXTENDED_SAMPLE:
                yield specs[c[i]]
            elif kind == _CORRELATED:
                yield self.correlated[c[i]]
            elif kind == _STREAM_STEP:
                yield StreamStepEvent(c[i], int(a[i]))
            else:
                yield SamplingEvent(a[i], pops[c[i]], full if kind == _FULL_SAMPLE else poisson)

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
            elif isinstance(event, SumQueryEvent):
                queries.append(event)
        if current is not None:
            yield LedgerStep(index, current, tuple(queries))
