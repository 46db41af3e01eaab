"""Lines with values no writer produces, hash recomputed: a typed error naming line and field."""

from __future__ import annotations

import hashlib
import io

import pytest

from dpledger import PrivacyLedger
from dpledger.errors import InvalidParameterError, LedgerVerificationError
from dpledger.ledger import fileformat as ff
from dpledger.ledger.events import NeighboringRelation


def _seal(content: bytes) -> bytes:
    return content + b',"hash":"' + hashlib.sha256(content).hexdigest().encode() + b'"}\n'


HEADER, HEAD = ff.encode_header(
    neighboring=NeighboringRelation.ADD_REMOVE, metadata={}, library_version="0", created="t"
)


def _header_with(metadata: bytes) -> bytes:
    return _seal(HEADER[:-76].replace(b'"metadata":{}', b'"metadata":' + metadata))


def _event(seq: int, prev: bytes, body: bytes) -> bytes:
    return _seal(b'{"seq":%d,"prev":"%s","kind":"%s' % (seq, prev, body))


def _sample(population: bytes = b"null", q: bytes = b"0.5") -> bytes:
    return _event(
        1,
        HEAD.encode(),
        b'sample","sampling_probability":'
        + q
        + b',"population_size":'
        + population
        + b',"scheme":"poisson"',
    )


def _with_query(label: bytes, sigma: bytes = b"1.0") -> bytes:
    first = _sample()
    prev = hashlib.sha256(first[:-76]).hexdigest().encode()
    query = b'sum_query","l2_norm_bound":1.0,"noise_stddev":' + sigma + b',"label":' + label
    return HEADER + first + _event(2, prev, query)


DEEP = b"[" * 5000 + b"]" * 5000
CASES = [
    (HEADER + _sample(b"1" * 5000), 2, "population_size <an integer of 5000 digits>"),
    (HEADER + _sample(b"1" * 700), 2, None),  # past the fast path's digits, but valid
    (HEADER + _sample(q=b"NaN"), 2, "sampling_probability NaN (not a JSON number)"),
    (HEADER + _sample(q=b"1e400"), 2, "sampling_probability inf"),
    (_with_query(DEEP), 3, 'too deeply to decode in "label"'),
    (_with_query(b"null", sigma=b"-Infinity"), 3, "noise_stddev -Infinity (not a JSON number)"),
    (_header_with(b'{"a":1e400}'), 1, "metadata holds the number inf"),
    (_header_with(b'{"a":NaN}'), 1, "metadata holds NaN"),
    (_header_with(b'{"a":' + b"9" * 5000 + b"}"), 1, "metadata holds <an integer of 5000 digits>"),
    (_header_with(b'{"a":' + DEEP + b"}"), 1, 'too deeply to decode in "metadata"'),
    (_header_with(b'{"a":' + b"[" * 70 + b"]" * 70 + b"}"), 1, "nested more than 64 levels"),
    (_header_with(b'{"a":"' + b"x" * 100_000 + b'"}'), 1, None),  # long, but valid
    (_header_with(b"[" + b"1," * 50_000 + b"1]"), 1, "metadata is not a JSON object"),
]


@pytest.mark.parametrize(("data", "line", "reason"), CASES)
def test_a_forged_value_is_a_verification_error_naming_line_and_field(
    tmp_path, data: bytes, line: int, reason: str | None
) -> None:
    if reason is None:
        ff.LedgerReader(io.BytesIO(data)).read()
        return
    with pytest.raises(LedgerVerificationError) as info:
        ff.LedgerReader(io.BytesIO(data)).read()
    assert info.value.line_number == line and reason in info.value.reason
    message = str(info.value)
    assert "\n" not in message and len(message) < 400
    path = tmp_path / "forged.dpl"
    path.write_bytes(data)
    with pytest.raises(LedgerVerificationError):
        PrivacyLedger.load(path)


def test_metadata_deeper_than_a_reader_accepts_is_refused_when_written(tmp_path) -> None:
    deep: dict = {}
    inner = deep
    for _ in range(ff.MAX_METADATA_DEPTH):
        inner["k"] = {}
        inner = inner["k"]
    with pytest.raises(InvalidParameterError, match="nested at most 64 levels"):
        PrivacyLedger(tmp_path / "deep.dpl", metadata=deep)
    assert not (tmp_path / "deep.dpl").exists()
    very_deep: list = []
    for _ in range(100_000):
        very_deep = [very_deep]
    with pytest.raises(InvalidParameterError):  # not a RecursionError
        PrivacyLedger(metadata={"x": very_deep})
    ok = deep["k"]  # 64 levels: written and read back
    with PrivacyLedger(tmp_path / "ok.dpl", metadata=ok):
        pass
    assert PrivacyLedger.load(tmp_path / "ok.dpl").header.metadata == ok
