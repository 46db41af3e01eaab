"""The steps of a correlated-noise release's stream in the ledger: recording, order rules, the
file line, both reader paths, ``info``, and that they change no ε.

References: the release already accounts for all T steps of its stream, so ε with and without
the step lines must be identical (same accountant, same ledger otherwise); the fast and the
thorough reader paths must agree; the order rules (a release before its steps, steps 0, 1, 2, …
consecutively and below T) are checked the same way by ``PrivacyLedger`` before anything is
written and by the decoder on forged files.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import pytest

from dpledger import PrivacyLedger
from dpledger.accountants import make_accountant
from dpledger.cli import main
from dpledger.errors import InvalidParameterError, LedgerStateError, LedgerVerificationError
from dpledger.ledger import CorrelatedReleaseEvent
from dpledger.ledger import fileformat as ff
from dpledger.ledger.correlated import StreamStepEvent
from dpledger.mechanisms.correlated import ParticipationSchema, tree_factorization
from dpledger.mechanisms.correlated.release import release_event

from .conftest import content_of, rechain, seal

DATA = Path(__file__).parent / "data"


def tree_event(num_steps: int = 8) -> CorrelatedReleaseEvent:
    fact = tree_factorization(num_steps, honaker=True)
    schema = ParticipationSchema.single(num_steps=num_steps)
    return release_event(fact, schema, l2_norm_bound=1.0, noise_stddev=3.0, label="model")


def write_stream(path: Path, *, steps: int = 3) -> CorrelatedReleaseEvent:
    """A sample and query, a release of T = 8, ``steps`` stream steps, closed."""
    event = tree_event()
    with PrivacyLedger(path) as led:
        led.record_sample(sampling_probability=0.01, population_size=1000)
        led.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.1)
        led.record_correlated_release(event)
        for t in range(steps):
            led.record_stream_step(release=0, step=t)
    return event


def renumber(lines: list[bytes], start: int) -> list[bytes]:
    """Rewrite ``seq`` of every line from index ``start`` on to its index, then rechain."""
    out = list(lines[:start])
    for i, line in enumerate(lines[start:], start=start):
        out.append(seal(re.sub(rb'^\{"seq":\d+,', b'{"seq":%d,' % i, content_of(line))))
    return rechain(out, start)


def load_lines(tmp_path: Path, lines: list[bytes]) -> PrivacyLedger:
    target = tmp_path / "forged.dpl"
    target.write_bytes(b"".join(lines))
    return PrivacyLedger.load(target)


def test_round_trip_across_sessions(tmp_path: Path) -> None:
    """Reference: what was recorded (events in order, progress per release, the close marker's
    counts: stream steps are events, not steps)."""
    path = tmp_path / "s.dpl"
    event = write_stream(path, steps=3)
    with PrivacyLedger(path, resume=True) as led:
        assert led.stream_progress(0) == 3
        led.record_stream_step(release=0, step=3)
        second = tree_event(4)
        led.record_correlated_release(second)
        led.record_stream_step(release=1, step=0)
        led.record_stream_step(release=0, step=4)
    loaded = PrivacyLedger.load(path)
    assert loaded.correlated_releases == (event, second)
    assert (loaded.stream_progress(0), loaded.stream_progress(1)) == (5, 1)
    assert loaded.num_steps == 1 and loaded.num_events == 2 + 1 + 3 + 1 + 1 + 1 + 1
    assert list(loaded.events())[2:] == [
        event,
        *(StreamStepEvent(0, t) for t in range(4)),
        second,
        StreamStepEvent(1, 0),
        StreamStepEvent(0, 4),
    ]
    assert [len(s.queries) for s in loaded.steps()] == [1]
    unkept = PrivacyLedger.load(path, keep_events=False)
    assert (unkept.stream_progress(0), unkept.stream_progress(1)) == (5, 1)
    lines = path.read_bytes().splitlines()
    assert lines[4].endswith(
        b'"kind":"stream_step","schema":1,"release":0,"step":0' + lines[4][-75:]
    )
    closes = [json.loads(line) for line in lines if b'"kind":"close"' in line]
    assert [(c["events"], c["steps"]) for c in closes] == [(6, 1), (10, 1)]


def _read_all(data: bytes, *, fast: bool) -> tuple[list[Any], int, int, str]:
    records: list[Any] = []

    def sample(*args: Any) -> None:
        records.append(("sample", *args))

    def query(*args: Any) -> None:
        records.append(("sum_query", *args))

    def marker(kind: str, fields: Any) -> None:
        records.append((kind, fields))

    reader = ff.LedgerReader(io.BytesIO(data), path="mem", fast=fast)
    reader.read(on_sample=sample, on_query=query, on_marker=marker)
    return records, reader.num_events, reader.num_steps, reader.head_hash


def test_fast_and_thorough_readers_agree(tmp_path: Path) -> None:
    path = tmp_path / "s.dpl"
    write_stream(path, steps=5)
    data = path.read_bytes()
    fast, thorough = _read_all(data, fast=True), _read_all(data, fast=False)
    assert fast == thorough
    steps = [r[1] for r in fast[0] if r[0] == "stream_step"]
    assert steps == [StreamStepEvent(0, t) for t in range(5)]


@pytest.mark.slow
def test_epsilon_is_identical_with_and_without_stream_steps() -> None:
    """Reference: the same ledger without its stream-step lines; every accountant must give the
    identical value (the release accounts for its whole stream)."""
    with_steps, without = PrivacyLedger(), PrivacyLedger()
    for led in (with_steps, without):
        led.record_sample(sampling_probability=0.01, population_size=1000)
        led.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.1)
        led.record_correlated_release(tree_event())
    for t in range(8):
        with_steps.record_stream_step(release=0, step=t)
    assert with_steps.num_events == without.num_events + 8
    assert with_steps.runs() == without.runs()
    assert with_steps.compressed() == without.compressed()
    for name in ("rdp", "pld", "gdp"):
        accountant = make_accountant(name)
        got = accountant.epsilon(with_steps, delta=1e-5).value
        assert got == accountant.epsilon(without, delta=1e-5).value, name


def test_a_query_after_a_stream_step_needs_a_new_sample() -> None:
    led = PrivacyLedger()
    led.record_correlated_release(tree_event())
    led.record_sample(sampling_probability=0.5, population_size=10)
    led.record_stream_step(release=0, step=0)
    with pytest.raises(LedgerStateError, match="no open step"):
        led.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0)


@pytest.mark.parametrize(
    "release,step,error,match",
    [
        (1, 0, InvalidParameterError, "release"),  # no such release
        (0, 3, InvalidParameterError, "step=3.*the next step"),  # a gap (progress is 2)
        (0, 1, InvalidParameterError, "step=1.*the next step"),  # a repeat
        (-1, 0, InvalidParameterError, "release"),
        (0, True, InvalidParameterError, "step"),
        (0, 2.0, InvalidParameterError, "step"),
    ],
)
def test_record_refuses_out_of_order_steps_and_writes_nothing(
    tmp_path: Path, release: Any, step: Any, error: type[Exception], match: str
) -> None:
    path = tmp_path / "s.dpl"
    led = PrivacyLedger(path)
    led.record_correlated_release(tree_event())
    led.record_stream_step(release=0, step=0)
    led.record_stream_step(release=0, step=1)
    led.flush()
    before = path.read_bytes()
    with pytest.raises(error, match=match):
        led.record_stream_step(release=release, step=step)
    assert led.stream_progress(0) == 2 and led.num_events == 3
    led.flush()
    assert path.read_bytes() == before
    led.close()


def test_record_refuses_a_step_past_num_steps_and_without_a_release() -> None:
    led = PrivacyLedger()
    with pytest.raises(InvalidParameterError, match="none is recorded"):
        led.record_stream_step(release=0, step=0)
    led.record_correlated_release(tree_event(2))
    led.record_stream_step(release=0, step=0)
    led.record_stream_step(release=0, step=1)
    with pytest.raises(InvalidParameterError, match="all num_steps=2 steps"):
        led.record_stream_step(release=0, step=2)
    assert led.stream_progress(0) == 2
    with pytest.raises(InvalidParameterError, match="release"):
        led.stream_progress(1)


def test_a_version_1_file_refuses_a_stream_step(tmp_path: Path) -> None:
    path = tmp_path / "old.dpl"
    path.write_bytes((DATA / "example.dpl").read_bytes())
    with (
        PrivacyLedger(path, resume=True) as led,
        pytest.raises(LedgerStateError, match="format-version-1"),
    ):
        led.record_stream_step(release=0, step=0)
    # a forged version-1 header over a file with stream steps does not verify
    new = tmp_path / "new.dpl"
    write_stream(new)
    lines = new.read_bytes().splitlines(keepends=True)
    lines[0] = seal(content_of(lines[0]).replace(b'"format_version":2', b'"format_version":1'))
    with pytest.raises(LedgerVerificationError, match="format-version-1 file"):
        load_lines(tmp_path, rechain(lines, 0))


def _edit(lines: list[bytes], index: int, old: bytes, new: bytes) -> list[bytes]:
    assert old in lines[index]
    out = list(lines)
    out[index] = seal(content_of(lines[index]).replace(old, new))
    return rechain(out, index)


@pytest.mark.parametrize(
    "edit,line_number,reason",
    [
        # lines: 0 header, 1 sample, 2 query, 3 release, 4..6 steps 0..2, 7 close
        (lambda ls: _edit(ls, 5, b'"step":1', b'"step":2'), 6, "expected 1"),  # a gap
        (lambda ls: _edit(ls, 4, b'"step":0', b'"step":1'), 5, "first step must be 0"),
        (lambda ls: _edit(ls, 4, b'"release":0', b'"release":1'), 5, "hold 1 release"),
        (lambda ls: _edit(ls, 4, b'"schema":1', b'"schema":2'), 5, "schema 2 is not supported"),
        (lambda ls: _edit(ls, 4, b'"step":0', b'"step":0.0'), 5, "not an integer"),
        (lambda ls: _edit(ls, 4, b'"step":0', b'"step":-1'), 5, "not an integer >= 0"),
        (lambda ls: _edit(ls, 4, b'"release":0', b'"release":false'), 5, "not an integer"),
        (lambda ls: _edit(ls, 4, b',"step":0', b',"step":0,"x":1'), 5, "expected exactly"),
        (lambda ls: _edit(ls, 4, b'"step":0', b'"step":00'), 5, "not valid JSON"),
        # a repeated step: line 5 (step 0) duplicated after itself
        (lambda ls: renumber([*ls[:5], ls[4], *ls[5:]], 5), 6, "expected 1"),
        # a step before its release: the first step moved above the release
        (lambda ls: renumber([*ls[:3], ls[4], ls[3], *ls[5:]], 3), 4, "hold 0 release"),
    ],
)
def test_the_decoder_enforces_the_order_rules(
    tmp_path: Path, edit: Any, line_number: int, reason: str
) -> None:
    path = tmp_path / "s.dpl"
    write_stream(path)
    lines = path.read_bytes().splitlines(keepends=True)
    with pytest.raises(LedgerVerificationError) as info:
        load_lines(tmp_path, edit(lines))
    assert info.value.line_number == line_number
    assert reason in str(info.value)


def test_the_decoder_refuses_a_step_at_num_steps(tmp_path: Path) -> None:
    path = tmp_path / "s.dpl"
    write_stream(path, steps=8)  # T = 8: steps 0..7, lines 4..11, close at 12
    lines = path.read_bytes().splitlines(keepends=True)
    extra = seal(content_of(lines[11]).replace(b'"step":7', b'"step":8'))
    forged = renumber([*lines[:12], extra], 12)
    with pytest.raises(LedgerVerificationError, match="num_steps=8") as info:
        load_lines(tmp_path, forged)
    assert info.value.line_number == 13


def test_a_file_cut_inside_a_stream_step_loads_its_prefix(tmp_path: Path) -> None:
    path = tmp_path / "s.dpl"
    with PrivacyLedger(path) as led:
        led.record_correlated_release(tree_event())
        led.record_stream_step(release=0, step=0)
        led.record_stream_step(release=0, step=1)
    data = path.read_bytes()
    cut = data.rfind(b'"kind":"stream_step"') + 30  # inside the last stream-step line
    path.write_bytes(data[:cut])
    with pytest.warns(Warning, match="incomplete"):
        loaded = PrivacyLedger.load(path)
    assert loaded.stream_progress(0) == 1
    with pytest.warns(Warning, match="incomplete"), PrivacyLedger(path, resume=True) as led:
        led.record_stream_step(release=0, step=1)
    assert PrivacyLedger.load(path).stream_progress(0) == 2


def test_the_golden_file_is_unaffected() -> None:
    """Reference: the golden file written before stream steps existed loads with no release."""
    golden = PrivacyLedger.load(DATA / "golden.dpl")
    assert golden.correlated_releases == ()
    assert not any(isinstance(e, StreamStepEvent) for e in golden.events())


def test_event_checks() -> None:
    assert StreamStepEvent(2, 5).describe() == "step 5 of correlated-noise release 2"
    for release, step, name in [(-1, 0, "release"), (0, -1, "step"), (0, 1.0, "step")]:
        with pytest.raises(InvalidParameterError, match=name):
            StreamStepEvent(release, step)


def test_info_shows_the_progress(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.dpl"
    write_stream(path, steps=3)
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "3 of 8 steps taken" in out
    assert "events        6" in out
    assert main(["info", "--json", str(path)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["steps_taken"] for r in data["correlated_releases"]] == [3]
