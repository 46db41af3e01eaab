"""Note lines: JSON metadata about a run (its intent) recorded after the header."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from dpledger import PrivacyLedger
from dpledger.errors import LedgerStateError, LedgerVerificationError
from dpledger.ledger.intent import note_intent

from .conftest import content_of, rechain, seal

DATA = Path(__file__).parent / "data"
INTENT = {"target_epsilon": 3.0, "delta": 1e-5, "calibrated_by": "prv", "planned_steps": 30}


def _noted(path: Path) -> PrivacyLedger:
    ledger = PrivacyLedger(path, metadata={"model": "cnn"})
    ledger.record_note({"intent": INTENT})
    ledger.record_sample(sampling_probability=0.01, population_size=1000)
    ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.1)
    ledger.close()
    return ledger


def test_a_note_is_a_line_of_the_chain_and_loads_back(tmp_path: Path) -> None:
    path = tmp_path / "n.dpl"
    written = _noted(path)
    lines = path.read_bytes().splitlines()
    note = json.loads(lines[1])
    assert list(note) == ["seq", "prev", "kind", "time", "metadata", "hash"]
    assert note["kind"] == "note" and note["metadata"] == {"intent": INTENT}
    assert json.loads(lines[-1])["events"] == 2  # a note is no event
    loaded = PrivacyLedger.load(path)
    assert loaded.notes == ({"intent": INTENT},) and loaded.intent == INTENT
    assert loaded.header.metadata == {"model": "cnn"}
    assert (loaded.num_events, loaded.num_steps) == (2, 1) and loaded.closed_cleanly
    assert loaded.head_hash == written.head_hash
    in_memory = PrivacyLedger()
    in_memory.record_note({"intent": INTENT})
    assert in_memory.intent == INTENT


def test_files_without_notes_load_with_no_intent() -> None:
    ledger = PrivacyLedger.load(DATA / "golden.dpl")
    assert ledger.notes == () and ledger.intent is None


def test_an_altered_note_is_detected_at_its_line(tmp_path: Path) -> None:
    path = tmp_path / "n.dpl"
    _noted(path)
    lines = path.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].replace(b'"target_epsilon":3.0', b'"target_epsilon":9.0')
    path.write_bytes(b"".join(lines))
    with pytest.raises(LedgerVerificationError) as info:
        PrivacyLedger.load(path)
    assert info.value.line_number == 2


def test_a_note_ends_the_open_step(tmp_path: Path) -> None:
    path = tmp_path / "n.dpl"
    _noted(path)
    lines = path.read_bytes().splitlines(keepends=True)
    # sample, note, sum_query: the query has no sample in its step
    order = [lines[0], lines[2], lines[1], lines[3]]
    out = []
    for seq, line in enumerate(order):
        content = content_of(line)
        content = content.replace(b'"seq":%d,' % json.loads(line)["seq"], b'"seq":%d,' % seq, 1)
        out.append(seal(content))
    path.write_bytes(b"".join(rechain(out, 1)))
    with pytest.raises(LedgerVerificationError, match="sum query with no sampling event") as info:
        PrivacyLedger.load(path)
    assert info.value.line_number == 4


def test_a_version_1_file_holds_no_note(tmp_path: Path) -> None:
    path = tmp_path / "n.dpl"
    _noted(path)
    lines = path.read_bytes().splitlines(keepends=True)
    lines[0] = seal(content_of(lines[0]).replace(b'"format_version":2', b'"format_version":1'))
    path.write_bytes(b"".join(rechain(lines, 0)))
    with pytest.raises(LedgerVerificationError, match="format-version-1") as info:
        PrivacyLedger.load(path)
    assert info.value.line_number == 2


def test_note_intent_logs_what_a_read_only_ledger_cannot_take(tmp_path: Path, caplog) -> None:
    path = tmp_path / "plain.dpl"
    PrivacyLedger(path).close()
    ledger = PrivacyLedger.load(path)
    with caplog.at_level(logging.INFO, logger="dpledger"):
        note_intent(ledger, INTENT)
    assert "could not be recorded in the ledger" in caplog.text and "'prv'" in caplog.text
    with pytest.raises(LedgerStateError):
        ledger.record_note({"intent": INTENT})
    assert ledger.intent is None
    noted = PrivacyLedger()
    note_intent(noted, INTENT)
    note_intent(noted, {"delta": 1e-6})  # an intent already recorded is kept
    assert noted.notes == ({"intent": INTENT},)
