"""PrivacyLedger: recording, round trips, bad input, resume, the writer lock, crashes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpledger import InvalidParameterError, PrivacyLedger, SamplingEvent
from dpledger._version import __version__
from dpledger.errors import (
    LedgerExistsError,
    LedgerLockedError,
    LedgerStateError,
    LedgerVerificationError,
    NotALedgerError,
)
from dpledger.ledger import LedgerWarning, NeighboringRelation, SamplingScheme, SumQueryEvent

from .conftest import SMALL_EVENTS, lines_of, record, snapshot, write_small

REPO = Path(__file__).resolve().parents[2]


def run_python(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


# ---------------------------------------------------------------------------- round trips
def test_round_trip_of_every_field(tmp_path: Path) -> None:
    path = tmp_path / "run.dpl"
    metadata = {"model": "cnn", "lr": 0.1, "tags": ["a", "é"], "n": None, "big": 2**70}
    written = write_small(path, neighboring="replace_one", metadata=metadata)
    loaded = PrivacyLedger.load(path)
    assert snapshot(loaded) == snapshot(written)
    assert loaded.header.neighboring is NeighboringRelation.REPLACE_ONE
    assert loaded.header.metadata == metadata
    assert loaded.header.library_version == __version__
    assert loaded.header.format_version == 2
    assert loaded.header.created == written.header.created
    assert loaded.closed_cleanly is True
    events = list(loaded.events())
    assert events == [
        SamplingEvent(0.01, 60_000, SamplingScheme.POISSON),
        SumQueryEvent(1.0, 1.1, "dense/kernel"),
        SumQueryEvent(0.5, 0.7, 'bias "b", é\n'),
        SamplingEvent(0.1 + 0.2, None, SamplingScheme.POISSON),
        SumQueryEvent(3.0e-300, 5e-324, None),
        SamplingEvent(1.0, 2**60 + 1, SamplingScheme.FULL),
        SamplingEvent(0.0, 1, SamplingScheme.POISSON),
        SumQueryEvent(1.7976931348623157e308, 0.0, "x"),
    ]
    # Floats come back bit for bit, population sizes beyond 2^53 exactly.
    assert events[3].sampling_probability.hex() == (0.1 + 0.2).hex()
    assert events[4].noise_stddev.hex() == (5e-324).hex()
    assert events[5].population_size == 2**60 + 1
    assert loaded.labels == ("dense/kernel", 'bias "b", é\n', "x")
    assert loaded.population_sizes == (1, 60_000, 2**60 + 1, None)


def test_in_memory_ledger_has_no_file_properties() -> None:
    ledger = PrivacyLedger(metadata={"a": 1})
    record(ledger, SMALL_EVENTS)
    assert ledger.head_hash is None and ledger.closed_cleanly is None and ledger.path is None
    assert ledger.header.metadata == {"a": 1}
    assert ledger.neighboring is NeighboringRelation.ADD_REMOVE
    ledger.flush()  # no-op
    ledger.close()
    assert ledger.closed
    assert "memory" in repr(ledger) and "steps=4" in repr(ledger)


def test_numpy_and_signed_zero_inputs_are_stored_as_python_values(tmp_path: Path) -> None:
    path = tmp_path / "np.dpl"
    with PrivacyLedger(path) as ledger:
        ledger.record_sample(sampling_probability=np.float32(0.25), population_size=np.int64(8))
        ledger.record_sum_query(l2_norm_bound=np.float64(2.0), noise_stddev=np.array(-0.0))
        ledger.record_sample(sampling_probability=-0.0)
    loaded = PrivacyLedger.load(path)
    sample, query, zero = loaded.events()
    assert type(sample.sampling_probability) is float and type(sample.population_size) is int
    assert math.copysign(1.0, query.noise_stddev) == 1.0
    assert math.copysign(1.0, zero.sampling_probability) == 1.0
    assert b"-0.0" not in path.read_bytes()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    steps=st.lists(
        st.tuples(
            st.floats(min_value=0.0, max_value=1.0),
            st.one_of(st.none(), st.integers(min_value=1, max_value=2**64)),
            st.lists(
                st.tuples(
                    st.floats(min_value=5e-324, max_value=1e308),
                    st.floats(min_value=0.0, max_value=1e308),
                    st.one_of(st.none(), st.text(max_size=8)),
                ),
                max_size=3,
            ),
        ),
        max_size=12,
    )
)
def test_random_ledgers_round_trip_exactly(tmp_path_factory, steps) -> None:
    path = tmp_path_factory.mktemp("rt") / "r.dpl"
    with PrivacyLedger(path, buffer_size=3) as ledger:
        for q, n, queries in steps:
            ledger.record_sample(sampling_probability=q, population_size=n)
            for s, sigma, label in queries:
                ledger.record_sum_query(l2_norm_bound=s, noise_stddev=sigma, label=label)
    loaded = PrivacyLedger.load(path)
    assert snapshot(loaded) == snapshot(ledger)
    for a, b in zip(loaded.events(), ledger.events(), strict=True):
        for field in ("sampling_probability", "l2_norm_bound", "noise_stddev"):
            if hasattr(a, field):
                assert getattr(a, field).hex() == getattr(b, field).hex()


# ---------------------------------------------------------------------------- bad input
BAD_SAMPLE_CALLS = [
    ({"sampling_probability": 1.0000001}, "sampling_probability", 1.0000001),
    ({"sampling_probability": -0.5}, "sampling_probability", -0.5),
    ({"sampling_probability": math.nan}, "sampling_probability", math.nan),
    ({"sampling_probability": math.inf}, "sampling_probability", math.inf),
    ({"sampling_probability": None}, "sampling_probability", None),
    ({"sampling_probability": True}, "sampling_probability", True),
    ({"sampling_probability": "0.1"}, "sampling_probability", "0.1"),
    ({"sampling_probability": 0.1, "population_size": 0}, "population_size", 0),
    ({"sampling_probability": 0.1, "population_size": -5}, "population_size", -5),
    ({"sampling_probability": 0.1, "population_size": 100.0}, "population_size", 100.0),
    ({"sampling_probability": 0.1, "population_size": "100"}, "population_size", "100"),
    ({"sampling_probability": 0.1, "scheme": "shuffle"}, "scheme", "shuffle"),
    ({"sampling_probability": 0.1, "scheme": "full"}, "scheme", "full"),
]
BAD_QUERY_CALLS = [
    ({"l2_norm_bound": 0.0, "noise_stddev": 1.0}, "l2_norm_bound", 0.0),
    ({"l2_norm_bound": -1.0, "noise_stddev": 1.0}, "l2_norm_bound", -1.0),
    ({"l2_norm_bound": math.inf, "noise_stddev": 1.0}, "l2_norm_bound", math.inf),
    ({"l2_norm_bound": math.nan, "noise_stddev": 1.0}, "l2_norm_bound", math.nan),
    ({"l2_norm_bound": "1", "noise_stddev": 1.0}, "l2_norm_bound", "1"),
    ({"l2_norm_bound": 1.0, "noise_stddev": -0.1}, "noise_stddev", -0.1),
    ({"l2_norm_bound": 1.0, "noise_stddev": math.inf}, "noise_stddev", math.inf),
    ({"l2_norm_bound": 1.0, "noise_stddev": math.nan}, "noise_stddev", math.nan),
    ({"l2_norm_bound": 1.0, "noise_stddev": False}, "noise_stddev", False),
    ({"l2_norm_bound": 1.0, "noise_stddev": 1.0, "label": 7}, "label", 7),
    ({"l2_norm_bound": 1.0, "noise_stddev": 1.0, "label": b"x"}, "label", b"x"),
]


def _open_ledger(tmp_path: Path) -> PrivacyLedger:
    ledger = PrivacyLedger(tmp_path / "bad.dpl")
    ledger.record_sample(sampling_probability=0.1, population_size=100)
    ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0, label="first")
    ledger.flush()
    return ledger


@pytest.mark.parametrize(("kwargs", "parameter", "value"), BAD_SAMPLE_CALLS)
def test_bad_sample_is_rejected_and_changes_nothing(tmp_path, kwargs, parameter, value) -> None:
    ledger = _open_ledger(tmp_path)
    before, on_disk = snapshot(ledger), ledger.path and Path(ledger.path).read_bytes()
    with pytest.raises(InvalidParameterError) as info:
        ledger.record_sample(**kwargs)
    assert info.value.parameter == parameter
    assert f"{parameter}={value!r}" in str(info.value)
    ledger.flush()
    assert snapshot(ledger) == before
    assert Path(ledger.path).read_bytes() == on_disk
    ledger.close()
    assert PrivacyLedger.load(ledger.path).num_events == 2


@pytest.mark.parametrize(("kwargs", "parameter", "value"), BAD_QUERY_CALLS)
def test_bad_query_is_rejected_and_changes_nothing(tmp_path, kwargs, parameter, value) -> None:
    ledger = _open_ledger(tmp_path)
    before, on_disk = snapshot(ledger), Path(ledger.path).read_bytes()
    with pytest.raises(InvalidParameterError) as info:
        ledger.record_sum_query(**kwargs)
    assert info.value.parameter == parameter
    assert f"{parameter}={value!r}" in str(info.value)
    ledger.flush()
    assert snapshot(ledger) == before
    assert Path(ledger.path).read_bytes() == on_disk
    ledger.close()


def test_extreme_values_are_recorded_not_half_recorded(tmp_path: Path) -> None:
    # (S/σ̃)² overflows a float: the step is not private (z = 0), and nothing raises midway.
    with PrivacyLedger(tmp_path / "x.dpl") as ledger:
        ledger.record_sample(sampling_probability=0.5)
        ledger.record_sum_query(l2_norm_bound=1e300, noise_stddev=1e-300, label="big")
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0)
    assert ledger.runs()[0].noise_multiplier == 0.0
    assert ledger.num_events == 3
    assert PrivacyLedger.load(ledger.path).runs() == ledger.runs()


def test_sum_query_needs_a_sample_first(tmp_path: Path) -> None:
    for ledger in (PrivacyLedger(), PrivacyLedger(tmp_path / "q.dpl")):
        before = snapshot(ledger)
        with pytest.raises(LedgerStateError, match="record_sample"):
            ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0)
        assert snapshot(ledger) == before
        ledger.close()
    assert PrivacyLedger.load(tmp_path / "q.dpl").num_events == 0


def test_closed_and_loaded_ledgers_refuse_records(small_file: Path, tmp_path: Path) -> None:
    ledger = PrivacyLedger(tmp_path / "c.dpl")
    ledger.close()
    ledger.close()  # idempotent
    with pytest.raises(LedgerStateError, match="closed"):
        ledger.record_sample(sampling_probability=0.1)
    before = small_file.read_bytes()
    loaded = PrivacyLedger.load(small_file)
    with pytest.raises(LedgerStateError, match="read-only"):
        loaded.record_sample(sampling_probability=0.1)
    with pytest.raises(LedgerStateError, match="read-only"):
        loaded.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0)
    loaded.close()  # harmless, writes nothing
    assert small_file.read_bytes() == before


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        ({"neighboring": "add_or_remove"}, "neighboring"),
        ({"neighboring": 1}, "neighboring"),
        ({"metadata": [("a", 1)]}, "metadata"),
        ({"metadata": {"a": math.nan}}, "metadata"),
        ({"metadata": {"a": object()}}, "metadata"),
        ({"metadata": {1: "a"}}, "metadata"),
        ({"metadata": {"a": (1, 2)}}, "metadata"),
        ({"buffer_size": 0}, "buffer_size"),
        ({"buffer_size": 2.0}, "buffer_size"),
        ({"buffer_size": True}, "buffer_size"),
        ({"flush_interval": -1.0}, "flush_interval"),
        ({"flush_interval": math.nan}, "flush_interval"),
        ({"flush_interval": "1"}, "flush_interval"),
        ({"fsync": "yes"}, "fsync"),
        ({"resume": 1}, "resume"),
    ],
)
def test_constructor_refuses_bad_arguments_without_creating_a_file(
    tmp_path: Path, kwargs, parameter
) -> None:
    path = tmp_path / "new.dpl"
    with pytest.raises(InvalidParameterError) as info:
        PrivacyLedger(path, **kwargs)
    assert info.value.parameter == parameter
    assert f"{parameter}=" in str(info.value)
    assert not path.exists()
    assert os.listdir(tmp_path) == []


def test_constructor_refuses_bad_paths(tmp_path: Path, small_file: Path) -> None:
    with pytest.raises(InvalidParameterError, match="path=3"):
        PrivacyLedger(3)  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError, match="resume=True"):
        PrivacyLedger(None, resume=True)
    with pytest.raises(NotALedgerError, match="directory"):
        PrivacyLedger(tmp_path)
    with pytest.raises(NotALedgerError, match="directory"):
        PrivacyLedger(tmp_path, resume=True)
    before = small_file.read_bytes()
    with pytest.raises(LedgerExistsError, match="resume=True"):
        PrivacyLedger(small_file)
    assert small_file.read_bytes() == before
    other = tmp_path / "notes.txt"
    other.write_bytes(b"hello\nworld\n")
    with pytest.raises(NotALedgerError, match="not a dpledger ledger"):
        PrivacyLedger(other, resume=True)
    assert other.read_bytes() == b"hello\nworld\n"
    assert not list(tmp_path.glob("notes.txt.*"))
    with pytest.raises(FileNotFoundError):
        PrivacyLedger(tmp_path / "missing-dir" / "x.dpl")


def test_load_refuses_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(NotALedgerError, match="directory"):
        PrivacyLedger.load(tmp_path)
    with pytest.raises(FileNotFoundError):
        PrivacyLedger.load(tmp_path / "missing.dpl")
    for content in (b"\n", b"hello", b'{"format":"other"}\n', b"\x00\x01\x02", b"[1, 2, 3]\n"):
        path = tmp_path / "x.bin"
        path.write_bytes(content)
        with pytest.raises(NotALedgerError):
            PrivacyLedger.load(path)
    with pytest.raises(InvalidParameterError, match="keep_events"):
        PrivacyLedger.load(tmp_path / "x.bin", keep_events="no")  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError, match="path=None"):
        PrivacyLedger.load(None)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- buffering
def test_buffering_and_flush(tmp_path: Path) -> None:
    path = tmp_path / "buf.dpl"
    ledger = PrivacyLedger(path, buffer_size=4, flush_interval=1e9)
    header_only = path.read_bytes()
    assert header_only.count(b"\n") == 1  # the header is written at once
    for _ in range(3):
        ledger.record_sample(sampling_probability=0.1)
    assert path.read_bytes() == header_only  # three events buffered
    ledger.record_sample(sampling_probability=0.1)
    assert len(lines_of(path)) == 5  # the fourth filled the buffer
    ledger.record_sample(sampling_probability=0.1)
    ledger.flush()
    assert len(lines_of(path)) == 6
    ledger.close()
    assert json.loads(lines_of(path)[-1])["kind"] == "close"


def test_flush_interval_zero_writes_every_event(tmp_path: Path) -> None:
    path = tmp_path / "now.dpl"
    ledger = PrivacyLedger(path, flush_interval=0, fsync=True)
    ledger.record_sample(sampling_probability=0.1)
    assert len(lines_of(path)) == 2
    ledger.close()


def test_head_hash_is_the_last_lines_hash(small_file: Path) -> None:
    last = json.loads(lines_of(small_file)[-1])
    assert PrivacyLedger.load(small_file).head_hash == last["hash"]


# ---------------------------------------------------------------------------- resume
def test_resume_continues_the_chain_and_matches_an_uninterrupted_ledger(tmp_path: Path) -> None:
    whole = PrivacyLedger(tmp_path / "whole.dpl")
    record(whole, SMALL_EVENTS)
    record(whole, SMALL_EVENTS)
    whole.close()

    path = tmp_path / "parts.dpl"
    first = PrivacyLedger(path, metadata={"run": 1})
    record(first, SMALL_EVENTS[:5])
    first.close()
    second = PrivacyLedger(path, resume=True, metadata={"restart": 1})
    assert second.num_events == 5 and second.header.metadata == {"run": 1}
    with pytest.raises(LedgerStateError):  # a new session must open its own step
        second.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0)
    record(second, SMALL_EVENTS[5:])
    del second  # not closed: flushed when collected, like a killed process that had flushed
    third = PrivacyLedger(path, resume=True)
    record(third, SMALL_EVENTS)
    third.close()

    loaded = PrivacyLedger.load(path)
    assert list(loaded.events()) == list(whole.events())
    assert loaded.runs() == whole.runs()
    assert loaded.to_dp_event() == whole.to_dp_event()  # so every accountant gives the same ε
    kinds = [json.loads(line)["kind"] for line in lines_of(path)]
    assert kinds.count("resume") == 2 and kinds.count("close") == 2
    resume_lines = [json.loads(line) for line in lines_of(path) if b'"resume"' in line]
    assert resume_lines[0]["metadata"] == {"restart": 1} and "metadata" not in resume_lines[1]
    assert loaded.closed_cleanly


def test_closed_cleanly_follows_the_file(tmp_path: Path) -> None:
    path = tmp_path / "cc.dpl"
    ledger = PrivacyLedger(path)
    assert ledger.closed_cleanly is False
    ledger.close()
    assert ledger.closed_cleanly is True
    resumed = PrivacyLedger(path, resume=True)
    assert resumed.closed_cleanly is False  # its file now ends with a resume marker
    assert PrivacyLedger.load(path).closed_cleanly is False
    resumed.close()
    assert resumed.closed_cleanly is True and PrivacyLedger.load(path).closed_cleanly is True


def test_resume_of_a_missing_file_creates_it(tmp_path: Path) -> None:
    path = tmp_path / "fresh.dpl"
    with PrivacyLedger(path, resume=True, neighboring="replace_one") as ledger:
        ledger.record_sample(sampling_probability=0.5)
    loaded = PrivacyLedger.load(path)
    assert loaded.neighboring is NeighboringRelation.REPLACE_ONE and loaded.num_events == 1


def test_resume_checks_the_relation_and_leaves_the_file_alone(small_file: Path) -> None:
    before = small_file.read_bytes()
    with pytest.raises(InvalidParameterError, match="neighboring='replace_one'"):
        PrivacyLedger(small_file, resume=True, neighboring="replace_one")
    assert small_file.read_bytes() == before
    with PrivacyLedger(small_file, resume=True, neighboring="add_remove") as ledger:
        assert ledger.neighboring is NeighboringRelation.ADD_REMOVE  # and the lock was released


def test_resume_of_an_altered_file_fails_and_releases_the_lock(small_file: Path) -> None:
    lines = lines_of(small_file)
    assert b'"noise_stddev":1.1,' in lines[2]
    lines[2] = lines[2].replace(b'"noise_stddev":1.1,', b'"noise_stddev":9.9,')
    small_file.write_bytes(b"".join(lines))
    with pytest.raises(LedgerVerificationError) as info:
        PrivacyLedger(small_file, resume=True)
    assert info.value.line_number == 3
    import fcntl

    with open(small_file, "rb") as fp:  # nobody holds the lock any more
        fcntl.flock(fp, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_resume_after_a_torn_tail_sets_it_aside(tmp_path: Path) -> None:
    path = tmp_path / "torn.dpl"
    write_small(path, close=False)
    intact = path.read_bytes()
    torn = b'{"seq":9,"prev":"' + json.loads(lines_of(path)[-1])["hash"][:20].encode()
    path.write_bytes(intact + torn)
    with pytest.warns(LedgerWarning, match=r"line 10 is incomplete .*moved to .*torn-"):
        ledger = PrivacyLedger(path, resume=True)
    ledger.record_sample(sampling_probability=0.5)
    ledger.close()
    aside = Path(f"{path}.torn-{len(intact)}")
    assert aside.read_bytes() == torn
    loaded = PrivacyLedger.load(path)
    assert loaded.num_events == len(SMALL_EVENTS) + 1
    assert path.read_bytes().startswith(intact)
    # a second crash at the same offset does not overwrite the first set-aside file
    path.write_bytes(intact + torn)
    with pytest.warns(LedgerWarning):
        PrivacyLedger(path, resume=True).close()
    assert aside.read_bytes() == torn and Path(f"{aside}.1").read_bytes() == torn


def test_resume_after_a_line_missing_only_its_newline(tmp_path: Path) -> None:
    path = tmp_path / "nl.dpl"
    write_small(path, close=False)
    path.write_bytes(path.read_bytes()[:-1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ledger = PrivacyLedger(path, resume=True)
    ledger.record_sample(sampling_probability=0.5)
    ledger.close()
    assert PrivacyLedger.load(path).num_events == len(SMALL_EVENTS) + 1


@pytest.mark.parametrize("content", [b"", b'{"form', b'{"format":"dpledger-ledger","format_v'])
def test_resume_after_an_incomplete_header_starts_over(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "h.dpl"
    path.write_bytes(content)
    with pytest.warns(LedgerWarning, match="header is incomplete"):
        ledger = PrivacyLedger(path, resume=True, metadata={"attempt": 2})
    ledger.record_sample(sampling_probability=0.5)
    ledger.close()
    loaded = PrivacyLedger.load(path)
    assert loaded.header.metadata == {"attempt": 2} and loaded.num_events == 1
    if content:
        assert Path(f"{path}.torn-0").read_bytes() == content


# ---------------------------------------------------------------------------- the lock
def test_a_second_writer_in_the_same_process_is_locked_out(tmp_path: Path) -> None:
    path = tmp_path / "lock.dpl"
    ledger = PrivacyLedger(path)
    ledger.record_sample(sampling_probability=0.1)
    ledger.flush()
    before = path.read_bytes()
    with pytest.raises(LedgerLockedError, match="open for writing by another ledger"):
        PrivacyLedger(path, resume=True)
    assert path.read_bytes() == before
    ledger.record_sample(sampling_probability=0.1)  # the first writer carries on
    ledger.close()
    with PrivacyLedger(path, resume=True) as again:  # free once closed
        again.record_sample(sampling_probability=0.1)
    assert PrivacyLedger.load(path).num_events == 3


def test_a_second_writer_process_is_locked_out(tmp_path: Path) -> None:
    path = tmp_path / "lock.dpl"
    ledger = PrivacyLedger(path)
    ledger.record_sample(sampling_probability=0.1)
    ledger.flush()
    before = path.read_bytes()
    result = run_python(
        """
        import sys
        from dpledger import PrivacyLedger
        from dpledger.errors import LedgerLockedError
        try:
            PrivacyLedger(sys.argv[1], resume=True)
        except LedgerLockedError as exc:
            print("locked:", exc)
        """,
        str(path),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("locked:") and str(path) in result.stdout
    assert path.read_bytes() == before
    ledger.close()


def test_reading_while_a_writer_is_open(tmp_path: Path) -> None:
    path = tmp_path / "live.dpl"
    ledger = PrivacyLedger(path, buffer_size=1)
    record(ledger, SMALL_EVENTS)
    loaded = PrivacyLedger.load(path)  # readers take no lock
    assert loaded.num_events == len(SMALL_EVENTS) and not loaded.closed_cleanly
    ledger.close()


# ---------------------------------------------------------------------------- processes
def test_buffered_events_are_written_at_interpreter_exit(tmp_path: Path) -> None:
    path = tmp_path / "exit.dpl"
    result = run_python(
        """
        import sys
        from dpledger import PrivacyLedger
        ledger = PrivacyLedger(sys.argv[1], buffer_size=10**6, flush_interval=10**6)
        for _ in range(1000):
            ledger.record_sample(sampling_probability=0.01)
            ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0)
        """,
        str(path),
    )
    assert result.returncode == 0, result.stderr
    loaded = PrivacyLedger.load(path)
    assert loaded.num_events == 2000 and loaded.closed_cleanly is False


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_never_writes_the_parents_buffer(tmp_path: Path) -> None:
    path = tmp_path / "fork.dpl"
    result = run_python(
        """
        import os, sys
        from dpledger import PrivacyLedger
        from dpledger.errors import LedgerStateError
        ledger = PrivacyLedger(sys.argv[1], buffer_size=10**6, flush_interval=10**6)
        for _ in range(50):
            ledger.record_sample(sampling_probability=0.01)
        pid = os.fork()
        if pid == 0:
            try:
                ledger.record_sample(sampling_probability=0.5)
            except LedgerStateError as exc:
                print("child refused:", exc, flush=True)
            sys.exit(0)  # a normal exit runs atexit handlers in the child
        os.waitpid(pid, 0)
        ledger.record_sample(sampling_probability=0.02)
        ledger.close()
        """,
        str(path),
    )
    assert result.returncode == 0, result.stderr
    assert "child refused: this ledger was opened by the parent" in result.stdout
    loaded = PrivacyLedger.load(path)
    assert loaded.num_events == 51 and loaded.closed_cleanly


def test_killed_writer_keeps_every_flushed_event(tmp_path: Path) -> None:
    path = tmp_path / "kill.dpl"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    code = textwrap.dedent(
        """
        import sys
        from dpledger import PrivacyLedger
        ledger = PrivacyLedger(sys.argv[1], buffer_size=7, flush_interval=10**6)
        i = 0
        while True:
            ledger.record_sample(sampling_probability=0.01)
            ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0, label="g" * (i % 50))
            i += 1
            if i % 100 == 0:
                ledger.flush()
                print(2 * i, flush=True)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True, env=env
    )
    confirmed = 0
    assert proc.stdout is not None
    for line in proc.stdout:
        confirmed = int(line)
        if confirmed >= 4000:
            break
    proc.kill()
    proc.wait()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LedgerWarning)  # a torn tail is likely, not certain
        loaded = PrivacyLedger.load(path)
    assert loaded.num_events >= confirmed
    assert not loaded.closed_cleanly
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LedgerWarning)
        resumed = PrivacyLedger(path, resume=True)
    resumed.close()
    assert PrivacyLedger.load(path).num_events == loaded.num_events


# ---------------------------------------------------------------------------- write failures
def _failing_write(monkeypatch, *, after_bytes: int):
    """Make os.write write at most ``after_bytes`` bytes in total, then fail like a full disk."""
    real_write = os.write
    budget = [after_bytes]

    def write(fd: int, data) -> int:
        if budget[0] <= 0:
            raise OSError(28, "No space left on device")
        n = real_write(fd, bytes(data[: budget[0]]))
        budget[0] -= n
        return n

    monkeypatch.setattr(os, "write", write)
    return real_write


def test_a_failed_flush_keeps_the_unwritten_bytes_for_the_next(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "full.dpl"
    ledger = PrivacyLedger(path, buffer_size=10**6, flush_interval=10**6)
    record(ledger, SMALL_EVENTS)
    real_write = _failing_write(monkeypatch, after_bytes=300)
    with pytest.raises(OSError, match="No space"):
        ledger.flush()
    assert ledger.num_events == len(SMALL_EVENTS)  # recorded in memory all the same
    with pytest.warns(LedgerWarning, match="incomplete"):
        assert PrivacyLedger.load(path).num_events < len(SMALL_EVENTS)
    monkeypatch.setattr(os, "write", real_write)  # space again
    ledger.close()
    loaded = PrivacyLedger.load(path)
    assert list(loaded.events()) == list(ledger.events()) and loaded.closed_cleanly


def test_a_failed_close_releases_the_file_and_refuses_more_events(
    tmp_path: Path, monkeypatch
) -> None:
    path = tmp_path / "close.dpl"
    ledger = PrivacyLedger(path, buffer_size=10**6, flush_interval=10**6)
    record(ledger, SMALL_EVENTS)
    real_write = _failing_write(monkeypatch, after_bytes=500)
    with pytest.raises(OSError, match="No space"):
        ledger.close()
    monkeypatch.setattr(os, "write", real_write)
    assert ledger.closed
    with pytest.raises(LedgerStateError, match="closed"):
        ledger.record_sample(sampling_probability=0.5)
    with pytest.warns(LedgerWarning, match="incomplete"):
        cut = PrivacyLedger.load(path)  # like a crash: the prefix that reached the disk
    assert not cut.closed_cleanly
    with pytest.warns(LedgerWarning, match="moved to"):
        PrivacyLedger(path, resume=True).close()  # the lock was released
