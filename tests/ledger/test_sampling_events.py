"""Sampling events of every scheme: validation, the file format (version 2), runs and epochs."""

from __future__ import annotations

import io
import json
from pathlib import Path

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpledger import InvalidParameterError, PrivacyLedger, SamplingEvent
from dpledger.errors import LedgerStateError, LedgerVerificationError, UnsupportedLedgerError
from dpledger.ledger import NeighboringRelation, PrivacyUnit, SamplingScheme, SumQueryEvent
from dpledger.ledger import fileformat as ff
from dpledger.ledger.steps import CompressedLedger, StepRun

from .conftest import content_of, rechain, seal
from .test_fileformat import read_both

DATA = Path(__file__).parent / "data"

N = 60_000
EVERY_KIND = [
    SamplingEvent.poisson(256 / N, N),
    SamplingEvent.poisson(1.0, N),
    SamplingEvent.fixed_size(256, N),
    SamplingEvent.truncated_poisson(256 / N, N, 320),
    SamplingEvent.balls_in_bins(234, N, epoch_start=True),
    SamplingEvent.balls_in_bins(234, N),
    SamplingEvent.shuffle(256, N, epoch_start=True),
    SamplingEvent.shuffle(256, N),
    SamplingEvent.poisson(0.01, 5_000, unit="user"),
]


TRUNC, FIXED = "truncated_poisson", "fixed_size_without_replacement"


def record_all(ledger: PrivacyLedger, events: list[SamplingEvent]) -> None:
    for i, event in enumerate(events):
        ledger.record_sample(event=event)
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.1 + i, label="g")


# ------------------------------------------------------------------ the events themselves
def test_builders_derive_q_and_describe_the_scheme() -> None:
    fixed = SamplingEvent.fixed_size(256, N)
    assert fixed.scheme is SamplingScheme.FIXED_SIZE and fixed.sampling_probability == 256 / N
    assert fixed.average_denominator == 256.0
    bins = SamplingEvent.balls_in_bins(234, N)
    assert bins.sampling_probability == 1 / 234 and bins.batches_per_epoch == 234
    assert bins.average_denominator == N / 234
    shuffled = SamplingEvent.shuffle(256, N)
    assert shuffled.batches_per_epoch == 235  # ⌈60000 / 256⌉: the last batch is smaller
    truncated = SamplingEvent.truncated_poisson(0.01, N, 700)
    assert truncated.average_denominator == 0.01 * N
    assert SamplingEvent.poisson(0.5).average_denominator is None
    user = SamplingEvent.poisson(0.01, 5_000, unit="user")
    assert user.unit is PrivacyUnit.USER and not user.is_classic
    assert "unit=user" in user.describe()
    assert fixed.describe() == "fixed_size_without_replacement(b=256, n=60000)"


@pytest.mark.parametrize(
    ("build", "parameter"),
    [
        (lambda: SamplingEvent(0.5, N, "fixed_size_without_replacement"), "batch_size"),
        (lambda: SamplingEvent(0.5, N, "poisson", batch_size=3), "batch_size"),
        (lambda: SamplingEvent(0.5, N, "poisson", epoch_start=True), "epoch_start"),
        (lambda: SamplingEvent(0.5, None, TRUNC, max_batch_size=3), "population_size"),
        (lambda: SamplingEvent(0.0, N, TRUNC, max_batch_size=3), "sampling_probability"),
        (lambda: SamplingEvent(0.5, N, FIXED, batch_size=256), "sampling_probability"),
        (lambda: SamplingEvent.fixed_size(N + 1, N), "batch_size"),
        (lambda: SamplingEvent.fixed_size(0, N), "batch_size"),
        (lambda: SamplingEvent.balls_in_bins(N + 1, N), "num_batches"),
        (lambda: SamplingEvent.shuffle(256, N, epoch_start=1), "epoch_start"),
        (lambda: SamplingEvent.poisson(0.5, N, unit="household"), "unit"),
        (lambda: SamplingEvent(0.5, N, "sorted"), "scheme"),
        (lambda: SamplingEvent(0.5, N, "full"), "scheme"),
    ],
)
def test_invalid_events_name_the_parameter(build, parameter) -> None:
    with pytest.raises(InvalidParameterError) as info:
        build()
    assert info.value.parameter == parameter


def test_relations_each_scheme_is_analysed_under() -> None:
    assert [r.value for r in SamplingEvent.fixed_size(2, 10).relations] == ["replace_one"]
    assert [r.value for r in SamplingEvent.shuffle(2, 10).relations] == ["replace_one"]
    assert len(SamplingEvent.balls_in_bins(2, 10).relations) == 2
    assert [r.value for r in SamplingEvent.truncated_poisson(0.1, 10, 2).relations] == [
        "add_remove"
    ]


# ------------------------------------------------------------------ the file format
def test_every_kind_round_trips_through_a_file(tmp_path: Path) -> None:
    path = tmp_path / "kinds.dpl"
    with PrivacyLedger(path) as ledger:
        record_all(ledger, EVERY_KIND)
    loaded = PrivacyLedger.load(path)
    assert loaded.header.format_version == ff.FORMAT_VERSION == 2
    samples = [e for e in loaded.events() if isinstance(e, SamplingEvent)]
    assert samples == EVERY_KIND
    assert loaded.runs() == ledger.runs()
    # the classic events keep the version-1 line, byte for byte
    lines = path.read_bytes().splitlines()
    assert b'"batch_size"' not in lines[1] and b'"batch_size"' not in lines[3]
    assert all(b'"batch_size"' in lines[1 + 2 * i] for i in range(2, len(EVERY_KIND)))


def test_fast_and_slow_readers_agree_on_extended_lines(tmp_path: Path) -> None:
    path = tmp_path / "kinds.dpl"
    with PrivacyLedger(path) as ledger:
        record_all(ledger, EVERY_KIND * 2)
    outcome = read_both(path.read_bytes())
    assert outcome[0] == "ok"


def test_an_edited_extended_line_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "kinds.dpl"
    with PrivacyLedger(path) as ledger:
        record_all(ledger, [SamplingEvent.shuffle(256, N)])
    lines = path.read_bytes().splitlines(keepends=True)
    # relabel the shuffle as Poisson, keeping the hash chain intact: the layout check refuses it
    lines[1] = seal(content_of(lines[1]).replace(b'"scheme":"shuffle"', b'"scheme":"poisson"'))
    outcome = read_both(b"".join(rechain(lines, 1)))
    assert outcome[0] == "error"
    assert "invalid" in outcome[1][2] and outcome[1][1] == 2


def test_a_version_1_file_cannot_hold_an_extended_event(tmp_path: Path) -> None:
    old = (DATA / "example.dpl").read_bytes()
    assert b'"format_version":1' in old.splitlines()[0]
    path = tmp_path / "old.dpl"
    path.write_bytes(old)
    with PrivacyLedger(path, resume=True) as ledger:
        with pytest.raises(LedgerStateError, match="format-version-1"):
            ledger.record_sample(event=SamplingEvent.fixed_size(2, 10))
        ledger.record_sample(sampling_probability=0.5, population_size=10)  # classic: fine
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=2.0)
    assert PrivacyLedger.load(path).header.format_version == 1
    # and a forged version-1 file with an extended line does not verify
    extended = PrivacyLedger(tmp_path / "new.dpl")
    record_all(extended, [SamplingEvent.fixed_size(2, 10)])
    extended.close()
    lines = (tmp_path / "new.dpl").read_bytes().splitlines(keepends=True)
    lines[0] = seal(content_of(lines[0]).replace(b'"format_version":2', b'"format_version":1'))
    forged = tmp_path / "forged.dpl"
    forged.write_bytes(b"".join(rechain(lines, 0)))
    with pytest.raises(LedgerVerificationError, match="format-version-1 file"):
        PrivacyLedger.load(forged)


def test_record_sample_takes_q_or_an_event_not_both() -> None:
    ledger = PrivacyLedger()
    with pytest.raises(InvalidParameterError) as info:
        ledger.record_sample(sampling_probability=0.1, event=SamplingEvent.fixed_size(2, 10))
    assert info.value.parameter == "sampling_probability"
    with pytest.raises(InvalidParameterError, match="event=SamplingEvent") as info:
        ledger.record_sample(sampling_probability=0.1, scheme="shuffle")
    with pytest.raises(InvalidParameterError) as info:
        ledger.record_sample(event="shuffle")
    assert info.value.parameter == "event"
    assert ledger.num_events == 0
    ledger.record_sample(event=SamplingEvent.poisson(0.25, 8))  # a classic event, as an object
    assert ledger.runs() == (StepRun(0.25, float("inf"), 1),)


# ------------------------------------------------------------------ runs and epochs
def test_runs_never_mix_schemes_with_equal_q_and_z() -> None:
    ledger = PrivacyLedger()
    q = 256 / N
    for event in [SamplingEvent.poisson(q, N)] * 2 + [SamplingEvent.fixed_size(256, N)] * 3:
        ledger.record_sample(event=event)
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.1)
    runs = ledger.compressed().runs
    assert [(r.scheme.value, r.count) for r in runs] == [
        ("poisson", 2),
        ("fixed_size_without_replacement", 3),
    ]
    assert runs[0].sampling_probability == runs[1].sampling_probability
    assert ledger.compressed().schemes == (SamplingScheme.POISSON, SamplingScheme.FIXED_SIZE)
    with pytest.raises(UnsupportedLedgerError, match="fixed_size_without_replacement"):
        ledger.compressed().distinct()
    # the run view and the step view agree
    steps = list(ledger.steps())
    assert [s.sampling.scheme for s in steps] == [runs[0].scheme] * 2 + [runs[1].scheme] * 3


def test_step_run_checks_its_sampling_event() -> None:
    event = SamplingEvent.fixed_size(2, 10)
    assert StepRun(0.2, 1.0, 3, sampling=event).scheme is SamplingScheme.FIXED_SIZE
    with pytest.raises(InvalidParameterError):
        StepRun(0.3, 1.0, 3, sampling=event)  # q differs from the event's
    with pytest.raises(InvalidParameterError):
        StepRun(0.2, 1.0, 3, sampling=SamplingEvent.poisson(0.2))  # classic: use None


def shuffle_ledger(epochs: list[int], z: list[float] | None = None) -> CompressedLedger:
    ledger = PrivacyLedger()
    for e, steps in enumerate(epochs):
        for t in range(steps):
            ledger.record_sample(event=SamplingEvent.shuffle(4, 10, epoch_start=t == 0))
            sigma = 1.0 if z is None else z[e]
            ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=sigma - 0.1 * (t == 1))
    return ledger.compressed()


def test_epoch_segments_follow_the_epoch_starts() -> None:
    comp = shuffle_ledger([3, 3, 2])  # ⌈10 / 4⌉ = 3 batches per epoch; the last epoch cut short
    segments = comp.epoch_segments()
    assert [(s.steps, s.epochs) for s in segments] == [(3, 1), (3, 1), (2, 1)]
    assert all(s.noise_multiplier == pytest.approx(0.9) for s in segments)  # the smallest z
    assert segments[0].sampling == SamplingEvent.shuffle(4, 10)
    one_step_epochs = PrivacyLedger()
    for _ in range(4):
        one_step_epochs.record_sample(event=SamplingEvent.balls_in_bins(1, 10, epoch_start=True))
        one_step_epochs.record_sum_query(l2_norm_bound=1.0, noise_stddev=2.0)
    assert len(one_step_epochs.compressed().runs) == 1
    assert [s.epochs for s in one_step_epochs.compressed().epoch_segments()] == [1, 1, 1, 1]


def test_an_epoch_longer_than_its_batches_counts_as_several() -> None:
    comp = shuffle_ledger([7])  # 7 steps after one epoch start, 3 batches per epoch
    assert [s.epochs for s in comp.epoch_segments()] == [3]
    # steps before the first epoch start (a run resumed mid-epoch) form their own epoch
    ledger = PrivacyLedger()
    for start in (False, False, True, False):
        ledger.record_sample(event=SamplingEvent.shuffle(4, 10, epoch_start=start))
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0)
    assert [s.steps for s in ledger.compressed().epoch_segments()] == [2, 2]


def test_events_of_a_loaded_ledger_are_the_recorded_objects(tmp_path: Path) -> None:
    path = tmp_path / "k.dpl"
    with PrivacyLedger(path) as ledger:
        record_all(ledger, EVERY_KIND)
    loaded = PrivacyLedger.load(path, keep_events=False)
    assert loaded.compressed() == ledger.compressed()
    body = json.loads(path.read_bytes().splitlines()[5])
    assert body["scheme"] == "fixed_size_without_replacement" and body["batch_size"] == 256
    assert attrs.asdict(EVERY_KIND[2])["unit"] is PrivacyUnit.RECORD
    assert SumQueryEvent(1.0, 1.1, "g") in list(ledger.events())


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    picks=st.lists(st.integers(min_value=0, max_value=len(EVERY_KIND) - 1), min_size=1, max_size=6),
    mutation=st.tuples(st.integers(min_value=0), st.integers(min_value=0, max_value=255)),
)
def test_mutated_extended_lines_are_read_alike_and_exactly(picks, mutation) -> None:
    """Change one byte of a file of extended events and repair the hash chain: both readers
    make the same of it, and whatever they accept re-encodes to the very same bytes."""
    buf = io.BytesIO()
    line, head = ff.encode_header(
        neighboring=NeighboringRelation.REPLACE_ONE, metadata={}, library_version="t", created="t"
    )
    buf.write(line)
    for seq, i in enumerate(picks, start=1):
        line, head = ff.encode_sampling_event(seq, head, EVERY_KIND[i])
        buf.write(line)
    data = buf.getvalue()
    lines = data.splitlines(keepends=True)
    position, byte = mutation
    position = len(lines[0]) + position % (len(data) - len(lines[0]))
    mutated = bytearray(data)
    if mutated[position] in b"\n" or byte in (ord("\n"), mutated[position]):
        return
    mutated[position] = byte
    mlines = bytes(mutated).splitlines(keepends=True)
    index = next(i for i in range(len(mlines)) if mlines[i] != lines[i])
    if len(mlines[index].rstrip(b"\n")) > 75:
        mlines[index] = seal(content_of(mlines[index]))
        mlines = rechain(mlines, index)
    outcome = read_both(b"".join(mlines))
    if outcome[0] == "ok":
        for seq, rec in enumerate(outcome[1][0], start=1):
            prev = json.loads(mlines[seq])["prev"]
            event = rec[4] or SamplingEvent(float.fromhex(rec[1]), rec[2], rec[3])
            assert ff.encode_sampling_event(seq, prev, event)[0] == mlines[seq]


def test_the_format_document_shows_the_extended_line_as_written() -> None:
    docs = Path(__file__).resolve().parents[2] / "docs" / "ledger-format.md"
    body = '"kind":"' + ff.sampling_event_body(SamplingEvent.shuffle(256, N, epoch_start=True))
    assert f"Example body: `{body}`" in docs.read_text(encoding="utf-8")
