"""Correlated-noise releases in the ledger: recording, the file line, both readers, ``info``.

References: the event as built from the factorization (its values must come back identical after
a file round trip); the fast and the slow reader paths must agree; the golden file written before
the line kind existed must load unchanged.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import attrs
import pytest

from dpledger import PrivacyLedger
from dpledger.cli import main
from dpledger.errors import InvalidParameterError, LedgerStateError, LedgerVerificationError
from dpledger.ledger import CorrelatedReleaseEvent
from dpledger.ledger import fileformat as ff
from dpledger.mechanisms.correlated import (
    ParticipationSchema,
    optimize_banded_toeplitz,
    tree_factorization,
)
from dpledger.mechanisms.correlated.release import release_event

from .conftest import content_of, rechain, seal

DATA = Path(__file__).parent / "data"


def tree_event() -> CorrelatedReleaseEvent:
    fact = tree_factorization(16, honaker=True)
    schema = ParticipationSchema.min_separation_schema(
        num_steps=16, max_participations=2, min_separation=8
    )
    return release_event(fact, schema, l2_norm_bound=1.0, noise_stddev=3.5, label="model")


def banded_event() -> CorrelatedReleaseEvent:
    fact = optimize_banded_toeplitz(num_steps=40, bands=4)
    schema = ParticipationSchema.cyclic(num_steps=40, period=8)
    return release_event(
        fact, schema, l2_norm_bound=0.5, noise_stddev=1.25, sampling_probability=0.1
    )


def write_mixed(path: Path) -> tuple[CorrelatedReleaseEvent, CorrelatedReleaseEvent]:
    a, b = tree_event(), banded_event()
    with PrivacyLedger(path) as led:
        led.record_sample(sampling_probability=0.01, population_size=1000)
        led.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.1)
        led.record_correlated_release(a)
        led.record_sample(sampling_probability=0.01, population_size=1000)
        led.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.1)
        led.record_correlated_release(b)
    return a, b


class Sink:
    def __init__(self) -> None:
        self.records: list[Any] = []

    def sample(self, *args: Any) -> None:
        self.records.append(("sample", *args))

    def query(self, *args: Any) -> None:
        self.records.append(("sum_query", *args))

    def marker(self, kind: str, fields: Any) -> None:
        self.records.append((kind, fields if kind == "correlated_release" else None))


def read(data: bytes, *, fast: bool) -> tuple[list[Any], int, int]:
    sink = Sink()
    reader = ff.LedgerReader(io.BytesIO(data), path="mem", fast=fast)
    reader.read(on_sample=sink.sample, on_query=sink.query, on_marker=sink.marker)
    return sink.records, reader.num_events, reader.num_steps


def test_round_trip_through_a_file(tmp_path: Path) -> None:
    path = tmp_path / "c.dpl"
    a, b = write_mixed(path)
    loaded = PrivacyLedger.load(path)
    assert loaded.correlated_releases == (a, b)
    assert loaded.correlated_releases[0].strategy_params == a.strategy_params
    assert loaded.correlated_releases[1].strategy_params == b.strategy_params
    assert loaded.num_steps == 2 and loaded.num_events == 6
    assert loaded.closed_cleanly
    assert [type(e).__name__ for e in loaded.events()] == [
        "SamplingEvent",
        "SumQueryEvent",
        "CorrelatedReleaseEvent",
        "SamplingEvent",
        "SumQueryEvent",
        "CorrelatedReleaseEvent",
    ]
    assert all(len(step.queries) == 1 for step in loaded.steps())
    assert loaded.compressed().correlated == (a, b)
    unkept = PrivacyLedger.load(path, keep_events=False)
    assert unkept.correlated_releases == (a, b)
    line = path.read_bytes().splitlines()[3]
    assert (
        line.startswith(b'{"seq":3,"prev":"') and b'"kind":"correlated_release","schema":1,' in line
    )


def test_fast_and_slow_readers_agree(tmp_path: Path) -> None:
    path = tmp_path / "c.dpl"
    write_mixed(path)
    data = path.read_bytes()
    fast, slow = read(data, fast=True), read(data, fast=False)
    assert fast == slow
    assert [r[0] for r in fast[0]].count("correlated_release") == 2


def test_a_query_after_a_release_needs_a_new_sample(tmp_path: Path) -> None:
    led = PrivacyLedger()
    led.record_sample(sampling_probability=0.5, population_size=10)
    led.record_correlated_release(tree_event())
    with pytest.raises(LedgerStateError, match="no open step"):
        led.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0)
    # and in a file: a forged sum query right after the release is refused
    path = tmp_path / "c.dpl"
    write_mixed(path)
    lines = path.read_bytes().splitlines(keepends=True)
    query = content_of(lines[2]).split(b'"kind":', 1)[1]
    forged = b'{"seq":4,"prev":"' + b"0" * 64 + b'","kind":' + query
    lines.insert(4, seal(forged))
    with pytest.raises(LedgerVerificationError, match="no sampling event"):
        _load(tmp_path, rechain(lines, 4))


def _load(tmp_path: Path, lines: list[bytes]) -> PrivacyLedger:
    target = tmp_path / "forged.dpl"
    target.write_bytes(b"".join(lines))
    return PrivacyLedger.load(target)


@pytest.mark.parametrize(
    "old,new,reason",
    [
        (b'"schema":1,', b'"schema":2,', "schema 2 is not supported"),
        (b'"sensitivity_exact":true', b'"sensitivity_exact":1', "sensitivity_exact=1 is invalid"),
        (b'"num_steps":16,', b'"num_steps":16.0,', "not an integer"),
        (b'"noise_stddev":3.5,', b'"noise_stddev":3.50,', "exact layout dpledger writes"),
    ],
)
def test_edited_lines_are_refused(tmp_path: Path, old: bytes, new: bytes, reason: str) -> None:
    path = tmp_path / "c.dpl"
    write_mixed(path)
    lines = path.read_bytes().splitlines(keepends=True)
    assert old in lines[3]
    lines[3] = seal(content_of(lines[3]).replace(old, new))
    with pytest.raises(LedgerVerificationError) as info:
        _load(tmp_path, rechain(lines, 3))
    assert info.value.line_number == 4
    assert reason in str(info.value)


def test_inconsistent_values_are_refused_in_a_file(tmp_path: Path) -> None:
    """A sensitivity below the largest column norm cannot be what a mechanism computed."""
    path = tmp_path / "c.dpl"
    a, _ = write_mixed(path)
    lines = path.read_bytes().splitlines(keepends=True)
    old = b'"sensitivity":' + repr(a.sensitivity).encode()
    lines[3] = seal(content_of(lines[3]).replace(old, b'"sensitivity":0.5'))
    with pytest.raises(LedgerVerificationError, match="correlated release is invalid"):
        _load(tmp_path, rechain(lines, 3))


def test_a_version_1_file_cannot_hold_a_release(tmp_path: Path) -> None:
    path = tmp_path / "old.dpl"
    path.write_bytes((DATA / "example.dpl").read_bytes())
    with (
        PrivacyLedger(path, resume=True) as led,
        pytest.raises(LedgerStateError, match="format-version-1"),
    ):
        led.record_correlated_release(tree_event())
    # a forged version-1 header over a file with a release does not verify
    new = tmp_path / "new.dpl"
    write_mixed(new)
    lines = new.read_bytes().splitlines(keepends=True)
    lines[0] = seal(content_of(lines[0]).replace(b'"format_version":2', b'"format_version":1'))
    with pytest.raises(LedgerVerificationError, match="format-version-1 file"):
        _load(tmp_path, rechain(lines, 0))


def test_the_golden_file_is_unaffected() -> None:
    """Reference: the golden file written before this line kind existed; its runs come back and
    it has no correlated release."""
    golden = PrivacyLedger.load(DATA / "golden.dpl")
    assert golden.correlated_releases == ()
    assert golden.compressed().correlated == ()
    assert golden.header.format_version == 2


def test_event_checks() -> None:
    good = attrs.asdict(tree_event())
    for key, value in [
        ("strategy_hash", "xyz"),
        ("strategy", "Has Spaces"),
        ("participation", "sometimes"),
        ("sampling", "shuffle"),
        ("sampling_probability", 0.5),  # with sampling 'none'
        ("sensitivity", 0.1),
        ("max_participations", 3),
        ("noise_stddev", -1.0),
        ("strategy_params", {"x": float("nan")}),
        ("sensitivity_exact", 1),
    ]:
        with pytest.raises(InvalidParameterError, match=key):
            CorrelatedReleaseEvent(**{**good, key: value})
    with pytest.raises(InvalidParameterError, match="bands"):
        CorrelatedReleaseEvent(
            **{**attrs.asdict(banded_event()), "bands": 9}  # more bands than the period 8
        )
    with pytest.raises(InvalidParameterError, match="event"):
        PrivacyLedger().record_correlated_release("tree")  # type: ignore[arg-type]


def test_release_event_refuses_amplification_it_does_not_hold_for() -> None:
    fact = optimize_banded_toeplitz(num_steps=40, bands=4)
    with pytest.raises(InvalidParameterError, match="bands"):
        release_event(
            fact,
            ParticipationSchema.cyclic(num_steps=40, period=3),
            l2_norm_bound=1.0,
            noise_stddev=1.0,
            sampling_probability=0.1,
        )
    with pytest.raises(InvalidParameterError, match="cyclic"):
        release_event(
            fact,
            ParticipationSchema.min_separation_schema(
                num_steps=40, max_participations=2, min_separation=8
            ),
            l2_norm_bound=1.0,
            noise_stddev=1.0,
            sampling_probability=0.1,
        )
    with pytest.raises(InvalidParameterError, match="strategy"):
        release_event(
            tree_factorization(8),
            ParticipationSchema.cyclic(num_steps=8, period=4),
            l2_norm_bound=1.0,
            noise_stddev=1.0,
            sampling_probability=0.1,
        )
    with pytest.raises(InvalidParameterError, match="schema"):
        release_event(
            fact, ParticipationSchema.single(num_steps=39), l2_norm_bound=1.0, noise_stddev=1.0
        )


def test_info_shows_the_releases(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.dpl"
    a, b = write_mixed(path)
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "correlated    2 correlated-noise release(s)" in out
    assert "model: tree_honaker over T=16 steps" in out
    assert "Poisson q=0.1 within 4 cyclic bands" in out
    assert main(["info", "--json", str(path)]) == 0
    data = json.loads(capsys.readouterr().out)
    got = data["correlated_releases"]
    assert [g["strategy_hash"] for g in got] == [a.strategy_hash, b.strategy_hash]
    assert got[1]["sampling"] == "poisson_within_bands" and got[1]["bands"] == 4


@pytest.mark.slow
def test_epsilon_command_names_the_releases(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.dpl"
    write_mixed(path)
    assert main(["epsilon", str(path), "--delta", "1e-5", "--accountant", "pld"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("2 steps and 2 correlated-noise release(s), δ = 1e-05")
