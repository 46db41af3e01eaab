"""The file format: truncation, tampering, the strict layout, and the fast parsing path."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpledger import PrivacyLedger, SamplingEvent
from dpledger.cli import main
from dpledger.errors import LedgerVerificationError, MissingHeaderError, NotALedgerError
from dpledger.ledger import LedgerWarning, SumQueryEvent
from dpledger.ledger import fileformat as ff
from dpledger.ledger.verify import verify_ledger

from .conftest import SMALL_EVENTS, content_of, rechain, record, seal

DATA = Path(__file__).parent / "data"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "ledger-format.md"


def build_sessions(path: Path) -> bytes:
    """Two sessions: SMALL_EVENTS[:5], close, resume (with metadata), the rest, close."""
    first = PrivacyLedger(path, metadata={"k": "v"})
    record(first, SMALL_EVENTS[:5])
    first.close()
    second = PrivacyLedger(path, resume=True, metadata={"restart": True})
    record(second, SMALL_EVENTS[5:])
    second.close()
    return path.read_bytes()


def expected_events() -> list[SamplingEvent | SumQueryEvent]:
    ledger = PrivacyLedger()
    record(ledger, SMALL_EVENTS)
    return list(ledger.events())


class Sink:
    """Collects what a LedgerReader reports."""

    def __init__(self) -> None:
        self.records: list[tuple[Any, ...]] = []

    def sample(self, q: float, n: int | None, scheme: str, event: Any = None) -> None:
        self.records.append(("sample", q.hex(), n, scheme, event))

    def query(self, s: float, sigma: float, label: str | None) -> None:
        self.records.append(("sum_query", s.hex(), sigma.hex(), label))

    def marker(self, kind: str, fields: dict[str, Any]) -> None:
        self.records.append((kind, json.dumps(fields, sort_keys=True)))


def read_bytes(data: bytes, *, fast: bool) -> tuple[str, Any]:
    """Read ``data``; ("ok", records and state) or ("error", type, line, reason)."""
    sink = Sink()
    reader = ff.LedgerReader(io.BytesIO(data), path="mem", fast=fast)
    try:
        reader.read(on_sample=sink.sample, on_query=sink.query, on_marker=sink.marker)
    except LedgerVerificationError as exc:
        return ("error", (type(exc), exc.line_number, exc.reason))
    except NotALedgerError as exc:
        return ("error", (type(exc), None, str(exc)))
    state = (
        reader.header,
        reader.header_torn,
        reader.torn_tail,
        reader.valid_length,
        reader.head_hash,
        reader.last_seq,
        reader.last_kind,
        reader.missing_newline,
        reader.num_events,
        reader.num_steps,
    )
    return ("ok", (sink.records, state))


def read_both(data: bytes) -> tuple[str, Any]:
    fast, slow = read_bytes(data, fast=True), read_bytes(data, fast=False)
    assert fast == slow
    return fast


def first_bad_line(path: Path) -> int:
    with pytest.raises(LedgerVerificationError) as info:
        PrivacyLedger.load(path)
    return info.value.line_number


def cli_verify(path: Path, capsys, *extra: str) -> tuple[int, str]:
    code = main(["verify", str(path), *extra])
    return code, capsys.readouterr().out


# ---------------------------------------------------------------------------- the example
def test_the_documented_example_verifies_with_a_reader_written_from_the_docs() -> None:
    data = (DATA / "example.dpl").read_bytes()
    # The docs show this file verbatim.
    assert data.decode("ascii") in DOCS.read_text(encoding="utf-8")
    # An independent verifier that follows docs/ledger-format.md and nothing else.
    prev = "0" * 64
    for seq, line in enumerate(data.split(b"\n")[:-1]):
        assert line.endswith(b'"}') and line[-75:-66] == b',"hash":"'
        digest = hashlib.sha256(line[:-75]).hexdigest()
        obj = json.loads(line)
        assert obj["hash"] == digest and obj["prev"] == prev and obj["seq"] == seq
        prev = digest
    assert prev == "03725ba0494212a9e0cb13e53d319ee43d50de7ac40720b9f89161ef2c586a0d"
    assert f"`{prev}`" in DOCS.read_text(encoding="utf-8")
    ledger = PrivacyLedger.load(DATA / "example.dpl")
    assert list(ledger.events()) == [
        SamplingEvent(0.01, 60000),
        SumQueryEvent(1.0, 1.1, "dense/kernel"),
    ]
    assert ledger.header.metadata == {"model": "cnn"} and ledger.closed_cleanly
    assert ledger.head_hash == prev


def test_the_documented_minimal_verifier_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the block writes its own small ledger where it runs
    text = DOCS.read_text(encoding="utf-8")
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    (code,) = [b for b in blocks if "def verify(" in b]  # the minimal verifier's block
    namespace: dict[str, Any] = {}
    exec(code, namespace)
    verify = namespace["verify"]
    head = "03725ba0494212a9e0cb13e53d319ee43d50de7ac40720b9f89161ef2c586a0d"
    assert verify(DATA / "example.dpl") == head
    lines = (DATA / "example.dpl").read_bytes().splitlines(keepends=True)
    for i, tampered in enumerate(
        [
            [lines[0], lines[1].replace(b"0.01", b"0.02"), *lines[2:]],
            [lines[0], lines[2], lines[3]],
            [lines[0], lines[2], lines[1], lines[3]],
        ]
    ):
        path = tmp_path / f"t{i}.dpl"
        path.write_bytes(b"".join(tampered))
        with pytest.raises(ValueError, match="line 2"):
            verify(path)


def test_every_line_is_ascii_and_ends_with_its_hash(tmp_path: Path) -> None:
    data = build_sessions(tmp_path / "s.dpl")
    data.decode("ascii")
    prev = ff.GENESIS_HASH
    for seq, line in enumerate(data.split(b"\n")[:-1]):
        obj = json.loads(line)
        assert obj["seq"] == seq and obj["prev"] == prev
        assert list(obj)[:2] == (["format", "format_version"] if seq == 0 else ["seq", "prev"])
        assert list(obj)[-1] == "hash"
        assert obj["hash"] == ff.line_hash(line[:-75])
        prev = obj["hash"]


# ---------------------------------------------------------------------------- truncation
@pytest.mark.slow
def test_truncation_at_every_byte_offset_loads_a_valid_prefix(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(os, "fsync", lambda _fd: None)  # thousands of closes below
    data = build_sessions(tmp_path / "full.dpl")
    ends = [m.start() for m in re.finditer(b"\n", data)]  # where each line's content ends
    objs = [json.loads(line) for line in data.split(b"\n")[:-1]]
    kinds = [o["kind"] for o in objs]
    events = expected_events()
    path = tmp_path / "cut.dpl"
    for offset in range(len(data) + 1):
        prefix = data[:offset]
        path.unlink(missing_ok=True)  # a new file is much cheaper than truncating one here
        path.write_bytes(prefix)
        complete = sum(1 for end in ends if end <= offset)  # lines whose content is all there
        n_events = sum(1 for k in kinds[:complete] if k in ("sample", "sum_query"))
        if complete == 0:  # no complete header: not a ledger that can be read
            with pytest.raises(MissingHeaderError, match=f"it has {offset} bytes"):
                PrivacyLedger.load(path)
        else:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ledger = PrivacyLedger.load(path)
            ledger_warnings = [w for w in caught if issubclass(w.category, LedgerWarning)]
            at_line_boundary = (
                data[offset - 1 : offset] == b"\n" or data[offset : offset + 1] == b"\n"
            )
            assert bool(ledger_warnings) == (not at_line_boundary), offset
            assert len(caught) == len(ledger_warnings)
            assert list(ledger.events()) == events[:n_events], offset
            assert ledger.head_hash == objs[complete - 1]["hash"]
            assert ledger.closed_cleanly == (kinds[complete - 1] == "close")
            if ledger_warnings:
                assert f"line {complete + 1} is incomplete" in str(ledger_warnings[0].message)
        # ... and a writer can resume from there, continuing the same chain.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LedgerWarning)
            resumed = PrivacyLedger(path, resume=True)
        resumed.record_sample(sampling_probability=0.125)
        resumed.close()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = PrivacyLedger.load(path)
        assert list(again.events()) == [*events[:n_events], SamplingEvent(0.125)], offset
        assert again.closed_cleanly
        assert path.read_bytes().startswith(data[: ends[complete - 1] if complete else 0])
        for aside in tmp_path.glob("cut.dpl.torn-*"):
            aside.unlink()


def test_a_torn_tail_must_be_the_start_of_the_next_line(tmp_path: Path) -> None:
    path = tmp_path / "t.dpl"
    PrivacyLedger(path).close()
    data = path.read_bytes()
    head = json.loads(data.split(b"\n")[-2])["hash"]
    good = f'{{"seq":2,"prev":"{head}","kind":"sam'.encode()
    for torn in (good[:1], good[:10], good):
        path.write_bytes(data + torn)
        with pytest.warns(LedgerWarning, match="line 3 is incomplete"):
            PrivacyLedger.load(path)
    for garbage in (
        b"\x00\x00\x00",
        b"hello",
        b'{"seq":3,',
        f'{{"seq":2,"prev":"{"1" * 64}"'.encode(),
    ):
        path.write_bytes(data + garbage)
        assert first_bad_line(path) == 3


@pytest.mark.parametrize(
    "content", [b"", b"{", b'{"format":"dpledger-ledger","format_version":1,"seq":0,"pr']
)
def test_a_file_without_a_complete_header_is_not_a_ledger(
    tmp_path: Path, capsys, content: bytes
) -> None:
    path = tmp_path / "empty.dpl"
    path.write_bytes(content)
    with pytest.raises(MissingHeaderError, match="no complete ledger header") as info:
        PrivacyLedger.load(path)
    assert isinstance(info.value, NotALedgerError) and info.value.path == str(path)
    assert f"it has {len(content)} bytes" in str(info.value)
    with pytest.raises(MissingHeaderError):
        verify_ledger(path)
    code = main(["verify", str(path)])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert captured.err.startswith("dpledger verify: error: ") and captured.err.count("\n") == 1


# ---------------------------------------------------------------------------- tampering
def _tampered(lines: list[bytes], how: str, k: int) -> tuple[list[bytes], int | None]:
    """Apply one kind of tampering at 1-based line k; return the lines and the first bad line."""
    out = list(lines)
    i = k - 1
    if how == "edit":
        obj = json.loads(out[i])
        field = next(
            (f for f in ("sampling_probability", "noise_stddev", "events", "created") if f in obj),
            "time",
        )
        text = json.dumps(obj[field]).encode()
        new = json.dumps(
            obj[field] + (1 if isinstance(obj[field], int) else 0.5)
            if not isinstance(obj[field], str)
            else obj[field] + "x"
        ).encode()
        needle = f'"{field}":'.encode()
        out[i] = out[i].replace(needle + text, needle + new, 1)
        assert out[i] != lines[i]
        return out, k
    if how == "delete":
        del out[i]
        return out, (None if k == len(lines) else k)
    if how == "duplicate":
        out.insert(i + 1, out[i])
        return out, k + 1
    if how == "insert":  # a copy of line 2 put before line k (before line 2: a duplicate)
        out.insert(i, lines[1])
        return out, (k + 1 if k == 2 else k)
    if how == "swap":
        out[i], out[i + 1] = out[i + 1], out[i]
        return out, k
    if how == "forge_line":  # a new, self-consistent line chained to line k-1, the rest untouched
        prev = json.loads(out[i - 1])["hash"]
        content = f'{{"seq":{k - 1},"prev":"{prev}","kind":"sample","sampling_probability":0.5,'
        content += '"population_size":null,"scheme":"poisson"'
        out.insert(i, seal(content.encode()))
        after_close = json.loads(out[i - 1])["kind"] == "close"
        return out, (k if after_close else k + 1)
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["edit", "delete", "duplicate", "insert", "swap", "forge_line"])
def test_every_kind_of_tampering_is_detected_at_its_line(tmp_path: Path, capsys, how: str) -> None:
    data = build_sessions(tmp_path / "s.dpl")
    lines = data.splitlines(keepends=True)
    last = len(lines) - (1 if how == "swap" else 0)
    for k in range(2, last + 1):
        tampered, bad = _tampered(lines, how, k)
        path = tmp_path / f"{how}-{k}.dpl"
        path.write_bytes(b"".join(tampered))
        if bad is None:  # the last line deleted: indistinguishable from a crash after line k-1
            assert PrivacyLedger.load(path).closed_cleanly is False
            code, out = cli_verify(path, capsys, "--require-closed")
            assert code == 1 and "does not end with a close marker" in out
            head = json.loads(lines[-1])["hash"]
            code, out = cli_verify(path, capsys, "--expect-head", head)
            assert code == 1 and "differs from the expected" in out
            continue
        assert first_bad_line(path) == bad, (how, k)
        code, out = cli_verify(path, capsys)
        assert code == 1, (how, k)
        assert f"line {bad}:" in out
        report = verify_ledger(path)
        assert not report.intact and report.first_bad_line == bad


def test_a_changed_header_is_detected(tmp_path: Path, capsys) -> None:
    data = build_sessions(tmp_path / "s.dpl")
    lines = data.splitlines(keepends=True)
    for old, new in [
        (b'"neighboring":"add_remove"', b'"neighboring":"replace_one"'),
        (b'"metadata":{"k":"v"}', b'"metadata":{"k":"w"}'),
        (b'"library_version":"', b'"library_version":"9'),
    ]:
        path = tmp_path / "h.dpl"
        path.write_bytes(b"".join([lines[0].replace(old, new), *lines[1:]]))
        assert first_bad_line(path) == 1
        assert cli_verify(path, capsys)[0] == 1
        # A forger who also fixes the header's own hash breaks the link of line 2.
        fixed = seal(content_of(lines[0].replace(old, new)))
        path.write_bytes(b"".join([fixed, *lines[1:]]))
        assert first_bad_line(path) == 2


def test_a_fully_rechained_forgery_verifies_only_the_head_hash_catches_it(
    tmp_path: Path, capsys
) -> None:
    # The chain is not a signature: whoever rewrites a line and recomputes every hash after it
    # produces a file that verifies. Publishing the head hash is what anchors a ledger.
    data = build_sessions(tmp_path / "s.dpl")
    lines = data.splitlines(keepends=True)
    head = json.loads(lines[-1])["hash"]
    forged = list(lines)
    forged[2] = forged[2].replace(b'"noise_stddev":1.1,', b'"noise_stddev":11.0,')
    path = tmp_path / "forged.dpl"
    path.write_bytes(b"".join(rechain(forged, 2)))
    assert PrivacyLedger.load(path).runs() != PrivacyLedger.load(tmp_path / "s.dpl").runs()
    assert cli_verify(path, capsys)[0] == 0
    code, out = cli_verify(path, capsys, "--expect-head", head)
    assert code == 1 and "differs from the expected" in out
    assert cli_verify(tmp_path / "s.dpl", capsys, "--expect-head", head)[0] == 0


# ---------------------------------------------------------------------------- strict layout
SAMPLE_LINE = 1  # 0-based index of the first sample line in build_sessions' file
QUERY_LINE = 2


@pytest.mark.parametrize(
    ("index", "old", "new", "reason"),
    [
        (SAMPLE_LINE, b'"seq":1,', b'"seq": 1,', "layout"),
        (SAMPLE_LINE, b"0.01", b"1e-2", "layout"),
        (SAMPLE_LINE, b"0.01", b"0.010", "layout"),
        (SAMPLE_LINE, b"60000", b"60000.0", "population_size"),
        (SAMPLE_LINE, b'"population_size":60000,', b"", "fields"),
        (SAMPLE_LINE, b'"scheme":"poisson"', b'"scheme":"poisson","extra":1', "fields"),
        (SAMPLE_LINE, b'"scheme":"poisson"', b'"scheme":"poisson","scheme":"full"', "duplicate"),
        (SAMPLE_LINE, b'"scheme":"poisson"', b'"scheme":"full"', "scheme 'full'"),
        (SAMPLE_LINE, b"0.01", b"1.5", "not a number in [0, 1]"),
        (SAMPLE_LINE, b"0.01", b"NaN", "not a JSON number"),
        (SAMPLE_LINE, b'"kind":"sample"', b'"kind":"sampling"', "unknown record kind"),
        (
            SAMPLE_LINE,
            b'"sampling_probability":0.01,"population_size":60000',
            b'"population_size":60000,"sampling_probability":0.01',
            "fields",
        ),
        (QUERY_LINE, b'"noise_stddev":1.1', b'"noise_stddev":1.10', "layout"),
        (QUERY_LINE, b'"l2_norm_bound":1.0', b'"l2_norm_bound":1', "layout"),
        (QUERY_LINE, b'"noise_stddev":1.1', b'"noise_stddev":-1.1', "noise_stddev"),
        (QUERY_LINE, b'"l2_norm_bound":1.0', b'"l2_norm_bound":0.0', "l2_norm_bound"),
        (QUERY_LINE, b'"label":"dense/kernel"', b'"label":"dense\\/kernel"', "layout"),
        (QUERY_LINE, b'"label":"dense/kernel"', b'"label":"dens\xc3\xa9"', "ASCII"),
        (QUERY_LINE, b'"label":"dense/kernel"', b'"label":7', "label"),
        (QUERY_LINE, b'"label":"dense/kernel"', b'"label":"a","x":"b"', "fields"),
    ],
)
def test_only_the_exact_layout_is_accepted(tmp_path: Path, index, old, new, reason) -> None:
    data = build_sessions(tmp_path / "s.dpl")
    lines = data.splitlines(keepends=True)
    assert old in lines[index]
    lines[index] = seal(content_of(lines[index]).replace(old, new, 1))
    outcome = read_both(b"".join(rechain(lines, index)))
    assert outcome[0] == "error"
    _, line_number, message = outcome[1]
    assert line_number == index + 1
    assert reason in message


def test_order_rules(tmp_path: Path) -> None:
    data = build_sessions(tmp_path / "s.dpl")
    lines = data.splitlines(keepends=True)
    objs = [json.loads(line) for line in lines]
    close_at = next(i for i, o in enumerate(objs) if o["kind"] == "close")
    query_at = next(i for i, o in enumerate(objs) if o["kind"] == "sum_query")

    def renumbered(seq_lines: list[bytes]) -> bytes:
        out = []
        for seq, line in enumerate(seq_lines):
            c = re.sub(rb'"seq":\d+,', b'"seq":%d,' % seq, content_of(line), count=1)
            out.append(seal(c))
        return b"".join(rechain(out, 1))

    cases = {
        "sum query with no sampling event": [lines[0], lines[query_at]],
        "after the close marker": [*lines[: close_at + 1], lines[1]],
        "a second header": [lines[0], lines[0]],
        "sum query with no sampling event before it in its session": [
            *lines[: close_at + 2],
            lines[query_at],
        ],
        "the close marker counts": [lines[0], lines[1], lines[close_at]],
    }
    for reason, seq_lines in cases.items():
        outcome = read_both(renumbered(seq_lines))
        assert outcome[0] == "error", reason
        assert reason in outcome[1][2] and outcome[1][1] == len(seq_lines)


def test_unsupported_format_version(tmp_path: Path) -> None:
    data = build_sessions(tmp_path / "s.dpl")
    lines = data.splitlines(keepends=True)
    lines[0] = seal(content_of(lines[0]).replace(b'"format_version":2', b'"format_version":3'))
    outcome = read_both(b"".join(rechain(lines, 0)))
    assert outcome[0] == "error" and "format_version 3 is not supported" in outcome[1][2]


# ---------------------------------------------------------------------------- fast == slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.lists(
        st.tuples(
            st.floats(min_value=0.0, max_value=1.0),
            st.one_of(st.none(), st.integers(min_value=1, max_value=10**20)),
            st.lists(
                st.tuples(
                    st.floats(min_value=1e-300, max_value=1e300),
                    st.floats(min_value=0.0, max_value=1e300),
                    st.one_of(st.none(), st.text(max_size=6)),
                ),
                max_size=3,
            ),
        ),
        min_size=1,
        max_size=8,
    ),
    mutation=st.tuples(st.integers(min_value=0), st.integers(min_value=0, max_value=255)),
)
def test_fast_and_slow_paths_agree_on_valid_and_mutated_files(steps, mutation) -> None:
    buf = io.BytesIO()
    ledger = PrivacyLedger()
    for q, n, queries in steps:
        ledger.record_sample(sampling_probability=q, population_size=n)
        for s, sigma, label in queries:
            ledger.record_sum_query(l2_norm_bound=s, noise_stddev=sigma, label=label)
    # Write the same events the way a file-backed ledger does.
    line, head = ff.encode_header(
        neighboring=ledger.neighboring, metadata={}, library_version="t", created="now"
    )
    buf.write(line)
    for seq, event in enumerate(ledger.events(), start=1):
        if isinstance(event, SamplingEvent):
            line, head = ff.encode_sample(
                seq, head, event.sampling_probability, event.population_size, event.scheme.value
            )
        else:
            line, head = ff.encode_sum_query(
                seq, head, event.l2_norm_bound, event.noise_stddev, ff.encode_label(event.label)
            )
        buf.write(line)
    data = buf.getvalue()
    outcome = read_both(data)
    assert outcome[0] == "ok"
    assert outcome[1][0] == [
        ("sample", e.sampling_probability.hex(), e.population_size, e.scheme.value, None)
        if isinstance(e, SamplingEvent)
        else ("sum_query", e.l2_norm_bound.hex(), e.noise_stddev.hex(), e.label)
        for e in ledger.events()
    ]
    # Change one byte of one event line and repair the chain from there: whatever the readers
    # make of it, they make the same of it, and what they accept is exactly what the writer
    # would have written.
    lines = data.splitlines(keepends=True)
    position, byte = mutation
    position %= len(data) - len(lines[0])
    position += len(lines[0])
    mutated = bytearray(data)
    if mutated[position] in b"\n" or byte in (ord("\n"), mutated[position]):
        return  # not a one-byte change of one event line
    mutated[position] = byte
    mlines = bytes(mutated).splitlines(keepends=True)
    index = next(i for i in range(len(mlines)) if mlines[i] != lines[i])
    if len(mlines[index].rstrip(b"\n")) > 75:
        mlines[index] = seal(content_of(mlines[index]))
        mlines = rechain(mlines, index)
    outcome = read_both(b"".join(mlines))
    if outcome[0] == "ok":
        records = outcome[1][0]
        for i, rec in enumerate(records, start=1):
            if rec[0] == "sample":
                expected = ff.encode_sample(
                    i, json.loads(mlines[i])["prev"], float.fromhex(rec[1]), rec[2], rec[3]
                )[0]
            else:
                expected = ff.encode_sum_query(
                    i,
                    json.loads(mlines[i])["prev"],
                    float.fromhex(rec[1]),
                    float.fromhex(rec[2]),
                    ff.encode_label(rec[3]),
                )[0]
            assert expected == mlines[i]
