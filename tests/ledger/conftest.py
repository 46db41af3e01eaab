"""Helpers shared by the ledger tests."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from dpledger import PrivacyLedger

# A small ledger that exercises every field: several steps with different q, several queries per
# step, labels with characters JSON must escape, an unknown population size, a step without
# queries, a full-batch step, a non-private query, awkward floats.
SMALL_EVENTS: list[tuple[str, dict[str, Any]]] = [
    ("sample", {"sampling_probability": 0.01, "population_size": 60_000}),
    ("query", {"l2_norm_bound": 1.0, "noise_stddev": 1.1, "label": "dense/kernel"}),
    ("query", {"l2_norm_bound": 0.5, "noise_stddev": 0.7, "label": 'bias "b", é\n'}),
    ("sample", {"sampling_probability": 0.1 + 0.2, "population_size": None}),
    ("query", {"l2_norm_bound": 3.0e-300, "noise_stddev": 5e-324, "label": None}),
    ("sample", {"sampling_probability": 1.0, "population_size": 2**60 + 1}),
    ("sample", {"sampling_probability": 0.0, "population_size": 1}),
    ("query", {"l2_norm_bound": 1.7976931348623157e308, "noise_stddev": 0.0, "label": "x"}),
]


def record(ledger: PrivacyLedger, events: list[tuple[str, dict[str, Any]]]) -> None:
    """Replay ``(kind, kwargs)`` pairs into a ledger."""
    for kind, kwargs in events:
        if kind == "sample":
            ledger.record_sample(**kwargs)
        else:
            ledger.record_sum_query(**kwargs)


def write_small(path: Path, *, close: bool = True, **kwargs: Any) -> PrivacyLedger:
    """A file-backed ledger holding SMALL_EVENTS (closed unless ``close=False``)."""
    ledger = PrivacyLedger(path, **kwargs)
    record(ledger, SMALL_EVENTS)
    if close:
        ledger.close()
    else:
        ledger.flush()
    return ledger


def snapshot(ledger: PrivacyLedger) -> dict[str, Any]:
    """Everything observable about a ledger's content, for before/after comparisons."""
    return {
        "events": list(ledger.events()),
        "runs": ledger.runs(),
        "num_events": ledger.num_events,
        "num_steps": ledger.num_steps,
        "labels": ledger.labels,
        "population_sizes": ledger.population_sizes,
        "head_hash": ledger.head_hash,
        "header": ledger.header,
    }


def lines_of(path: os.PathLike[str] | str) -> list[bytes]:
    """The file's lines, each with its newline."""
    return Path(path).read_bytes().splitlines(keepends=True)


def seal(content: bytes) -> bytes:
    """A line made from its content the way the format defines (hash suffix and newline)."""
    digest = hashlib.sha256(content).hexdigest().encode()
    return content + b',"hash":"' + digest + b'"}\n'


def content_of(line: bytes) -> bytes:
    """A line's bytes before the hash suffix."""
    return line.rstrip(b"\n")[:-75]


def rechain(lines: list[bytes], start: int = 0) -> list[bytes]:
    """Recompute "prev" and "hash" of every line from index ``start`` on (what a forger does).

    The lines must keep dpledger's layout up to the "prev" value, so the substitution is a
    plain byte replacement of the 64-digit previous hash.
    """
    out = list(lines[:start])
    prev = json.loads(out[-1])["hash"] if out else "0" * 64
    for line in lines[start:]:
        content = content_of(line)
        i = content.find(b'"prev":"') + 8
        if i >= 8:  # a line mangled beyond that is only resealed
            content = content[:i] + prev.encode() + content[i + 64 :]
        sealed = seal(content)
        out.append(sealed)
        prev = hashlib.sha256(content).hexdigest()
    return out


@pytest.fixture
def small_file(tmp_path: Path) -> Path:
    """A closed file-backed ledger holding SMALL_EVENTS."""
    path = tmp_path / "small.dpl"
    write_small(path, metadata={"model": "cnn", "lr": 0.1, "nested": {"k": [1, 2.5, None]}})
    return path
