"""Fuzzing the ledger reader with files written by the library and then damaged.

Whatever the damage, loading either succeeds (possibly as a valid prefix, with a warning) or
raises a :mod:`dpledger.errors` type; never another exception. What loads verifies, and a file
that was altered rather than cut short never loads silently as the original.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpledger import PrivacyLedger
from dpledger.errors import (
    DPLedgerError,
    LedgerVerificationError,
    MissingHeaderError,
    NotALedgerError,
)
from dpledger.ledger.ledger import LedgerWarning
from dpledger.ledger.verify import verify_ledger

# A value that no writer produces, for every kind of field: what a forger (or a broken tool)
# may put in a line before recomputing its hash.
EXTREME_VALUES = [
    b"1" * 5000,  # beyond Python's int-string conversion limit
    b"-" + b"9" * 4301,
    b"1e400",  # a float that overflows to inf
    b"-1e400",
    b"1e-400",  # underflows to 0.0
    b"NaN",
    b"Infinity",
    b"-Infinity",
    b"[" * 5000 + b"]" * 5000,  # deeper than json's recursion limit
    b'{"a":' * 3000 + b"1" + b"}" * 3000,
    b"[" * 70 + b"]" * 70,  # parseable, but deeper than a writer nests metadata
    b"null",
    b"true",
    b'""',
    b'"' + b"x" * 100_000 + b'"',  # a very long string
    b"{}",
    b"[]",
    b"0",
    b"-0.0",
    b'"\\ud800"',  # a lone surrogate
    b"5e-324",
    b"1.7976931348623157e308",
]

FIELDS = [
    b"format_version",
    b"seq",
    b"prev",
    b"kind",
    b"library_version",
    b"created",
    b"neighboring",
    b"metadata",
    b"sampling_probability",
    b"population_size",
    b"scheme",
    b"l2_norm_bound",
    b"noise_stddev",
    b"label",
    b"time",
    b"events",
    b"steps",
]

TALLY: dict[str, int] = {}


def _count(key: str) -> None:
    TALLY[key] = TALLY.get(key, 0) + 1


def _write_ledger(path: Path) -> bytes:
    """A two-session ledger with every kind of line, written by the library."""
    with PrivacyLedger(path, metadata={"model": "cnn", "nested": {"k": [1, 2.5, None]}}) as led:
        led.record_sample(sampling_probability=0.01, population_size=60_000)
        led.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.1, label="dense/kernel")
        led.record_sum_query(l2_norm_bound=3e-300, noise_stddev=5e-324, label='b "x"\n')
        led.record_sample(sampling_probability=1.0)
    with PrivacyLedger(path, resume=True, metadata={"attempt": 2}) as led:
        led.record_sample(sampling_probability=0.5, population_size=2**60 + 1)
        led.record_sum_query(l2_norm_bound=2.0, noise_stddev=0.0)
    return path.read_bytes()


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return _write_ledger(tmp_path_factory.mktemp("fuzz") / "original.dpl")


def _reseal(line: bytes, prev: str | None) -> tuple[bytes, str]:
    """Recompute a line's hash (and its "prev" link, when it has one) as a forger would."""
    body = line.rstrip(b"\n")
    content = body[:-75] if body[-75:-66] == b',"hash":"' else body
    if prev is not None:
        i = content.find(b'"prev":"') + 8
        if i >= 8 and len(content) >= i + 64:
            content = content[:i] + prev.encode() + content[i + 64 :]
    digest = hashlib.sha256(content).hexdigest()
    return content + b',"hash":"' + digest.encode() + b'"}\n', digest


def _rechain(lines: list[bytes], start: int) -> list[bytes]:
    out = list(lines[:start])
    prev = "0" * 64
    if out:
        prev = hashlib.sha256(out[-1].rstrip(b"\n")[:-75]).hexdigest()
    for line in lines[start:]:
        sealed, prev = _reseal(line, prev)
        out.append(sealed)
    return out


@st.composite
def mutations(draw: st.DrawFn, data: bytes) -> tuple[bytes, str]:
    """A damaged copy of ``data`` and the kind of damage."""
    lines = data.splitlines(keepends=True)
    kind = draw(
        st.sampled_from(
            [
                "flip",
                "insert",
                "delete",
                "truncate",
                "drop_line",
                "duplicate_line",
                "swap_lines",
                "forge_value",
                "forge_value_in_place",
                "long_line",
                "non_utf8",
            ]
        )
    )
    if kind == "flip":
        i = draw(st.integers(0, len(data) - 1))
        bit = draw(st.integers(0, 7))
        return data[:i] + bytes([data[i] ^ (1 << bit)]) + data[i + 1 :], kind
    if kind == "insert":
        i = draw(st.integers(0, len(data)))
        junk = draw(st.binary(min_size=1, max_size=20))
        return data[:i] + junk + data[i:], kind
    if kind == "delete":
        i = draw(st.integers(0, len(data) - 1))
        n = draw(st.integers(1, 40))
        return data[:i] + data[i + n :], kind
    if kind == "truncate":
        return data[: draw(st.integers(0, len(data) - 1))], kind
    if kind == "drop_line":
        i = draw(st.integers(0, len(lines) - 1))
        return b"".join(lines[:i] + lines[i + 1 :]), kind
    if kind == "duplicate_line":
        i = draw(st.integers(0, len(lines) - 1))
        return b"".join(lines[: i + 1] + lines[i:]), kind
    if kind == "swap_lines":
        i = draw(st.integers(0, len(lines) - 2))
        lines[i], lines[i + 1] = lines[i + 1], lines[i]
        return b"".join(lines), kind
    if kind in ("forge_value", "forge_value_in_place"):
        # Replace one field's value and recompute the hashes (from that line on, or only that
        # line's), so that the reader gets past the hash check to the values themselves.
        i = draw(st.integers(0, len(lines) - 1))
        field = draw(st.sampled_from([f for f in FIELDS if b'"' + f + b'":' in lines[i]]))
        value = draw(st.sampled_from(EXTREME_VALUES))
        line = lines[i]
        start = line.index(b'"' + field + b'":') + len(field) + 3
        try:
            end = start + len(json.dumps(json.loads(line)[field.decode()]).replace(" ", ""))
        except (ValueError, KeyError):  # pragma: no cover - the library's lines parse
            end = start
        lines[i] = line[:start] + value + line[end:]
        if kind == "forge_value":
            return b"".join(_rechain(lines, i)), kind
        lines[i], _ = _reseal(lines[i], None)
        return b"".join(lines), kind
    if kind == "long_line":
        i = draw(st.integers(0, len(lines)))
        return b"".join([*lines[:i], b"x" * 3_000_000 + b"\n", *lines[i:]]), kind
    i = draw(st.integers(0, len(data) - 1))
    junk = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80\x80", b"\xe9"]))
    return data[:i] + junk + data[i + 1 :], kind


def _load(path: Path) -> tuple[PrivacyLedger | None, list[str], BaseException | None]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ledger = PrivacyLedger.load(path, keep_events=True)
        except DPLedgerError as exc:
            return None, [], exc
    others = [w for w in caught if not issubclass(w.category, LedgerWarning)]
    assert not others, [str(w.message) for w in others]
    return ledger, [str(w.message) for w in caught], None


@settings(
    max_examples=300,
    deadline=None,  # some examples hold multi-megabyte lines
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@pytest.mark.slow
@given(data=st.data())
def test_damaged_files_load_as_a_prefix_or_raise_a_typed_error(
    original: bytes, tmp_path: Path, data: st.DataObject
) -> None:
    damaged, kind = data.draw(mutations(original))
    _count(f"tried:{kind}")
    path = tmp_path / "damaged.dpl"
    path.write_bytes(damaged)
    ledger, notes, error = _load(path)  # anything but a DPLedgerError propagates and fails
    if error is not None:
        _count(f"error:{type(error).__name__}")
        message = str(error)
        assert message and "\n" not in message and len(message) < 2000
        if isinstance(error, LedgerVerificationError):
            assert error.line_number >= 1 and f"line {error.line_number}" in message
        assert isinstance(error, (LedgerVerificationError, NotALedgerError))
        if isinstance(error, MissingHeaderError):
            assert b"\n" not in damaged  # only a file without one complete line
        # verify_ledger agrees: it reports the damage, or refuses a file that is no ledger.
        try:
            report = verify_ledger(path)
        except NotALedgerError:
            assert isinstance(error, NotALedgerError)
        else:
            assert isinstance(error, LedgerVerificationError)
            assert not report.ok and report.first_bad_line == error.line_number
        return
    assert ledger is not None
    _count("loaded")
    # What loaded is a prefix of the file that verifies on its own, line for line.
    report = verify_ledger(path)
    prefix = damaged[: (ledger.torn_tail.offset if ledger.torn_tail else len(damaged))]
    assert report.head_hash == ledger.head_hash
    assert report.intact == (ledger.torn_tail is None)
    assert bool(notes) == (ledger.torn_tail is not None)
    cut = tmp_path / "prefix.dpl"
    cut.write_bytes(prefix)
    again = PrivacyLedger.load(cut)
    assert again.head_hash == ledger.head_hash and list(again.events()) == list(ledger.events())
    # The loaded prefix is a prefix of the original, or the file was rewritten with fresh
    # hashes (which only a published head hash can reveal).
    head_of_original = hashlib.sha256(original.splitlines()[-1][:-75]).hexdigest()
    if original.startswith(prefix.rstrip(b"\n")):
        _count("loaded:prefix_of_original")
        if ledger.closed_cleanly:
            # It ends at a close marker of the original: the last one (the whole file), or a
            # resumed ledger's earlier one (its first session, cut there: undetectable without a
            # published head hash, like any deletion of whole final lines).
            kept = original.splitlines(keepends=True)
            sessions = [
                b"".join(kept[: i + 1]) for i, line in enumerate(kept) if b'"kind":"close"' in line
            ]
            assert prefix.rstrip(b"\n") + b"\n" in sessions
            ends = {hashlib.sha256(s.splitlines()[-1][:-75]).hexdigest() for s in sessions}
            assert ledger.head_hash in ends
            if prefix.rstrip(b"\n") == original[:-1]:
                assert ledger.head_hash == head_of_original
    else:
        # Rewritten lines with recomputed hashes verify (the chain is not a signature), but
        # the head differs from the original's, so --expect-head refuses them.
        assert kind == "forge_value"
        assert ledger.head_hash != head_of_original
        _count("loaded:forged")


def test_tally(original: bytes) -> None:
    """Not a check: prints how many examples of each kind the test above ran (pytest -s)."""
    print(json.dumps(TALLY, sort_keys=True))
