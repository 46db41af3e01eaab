"""The bytes a ledger writes are fixed: a ledger with every record kind matches a golden file.

``data/golden.dpl`` was written by this test's :func:`write_every_kind` (with the clock and the
library version held fixed) before the ledger was split into its column store and its journal;
the same calls must keep producing the same bytes, line for line.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dpledger import PrivacyLedger, SamplingEvent
from dpledger.ledger import fileformat

from .test_fileformat import read_both

GOLDEN = Path(__file__).parent / "data" / "golden.dpl"
FIXED_TIME = "2026-01-02T03:04:05.678901Z"
FIXED_VERSION = "0.0.0+golden"


def _hold_clock_and_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fix the timestamps and the library version that the writer puts into lines."""
    monkeypatch.setattr(fileformat, "utc_timestamp", lambda: FIXED_TIME)
    for name, module in list(sys.modules.items()):
        if name.startswith("dpledger.ledger.") and hasattr(module, "__version__"):
            monkeypatch.setattr(module, "__version__", FIXED_VERSION)


def write_every_kind(path: Path) -> None:
    """Record every record kind: header, classic and extended samples, sum queries, markers."""
    with PrivacyLedger(
        path, neighboring="replace_one", metadata={"model": "cnn", "n": [1, 2.5]}
    ) as led:
        led.record_sample(sampling_probability=0.01, population_size=60_000)
        led.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.1, label="dense/kernel")
        led.record_sum_query(l2_norm_bound=0.5, noise_stddev=0.75, label=None)
        led.record_sample(sampling_probability=-0.0 + 0.25, population_size=None)
        led.record_sum_query(l2_norm_bound=2.0, noise_stddev=0.0, label='ünïcode "q"')
        led.record_sample(sampling_probability=1.0, population_size=10, scheme="full")
        led.record_sum_query(l2_norm_bound=1.0, noise_stddev=3.0)
        led.record_sample(event=SamplingEvent.fixed_size(32, 1000))
        led.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.3, label="dense/kernel")
        led.record_sample(event=SamplingEvent.truncated_poisson(0.02, 5000, 150))
        led.record_sample(event=SamplingEvent.balls_in_bins(4, 400, epoch_start=True))
        led.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.3)
        led.record_sample(event=SamplingEvent.shuffle(50, 1000, epoch_start=False))
        led.record_sample(event=SamplingEvent.poisson(0.003, 2000, unit="user"))
        led.record_sum_query(l2_norm_bound=1e-300, noise_stddev=1e300, label="")
        led.record_sample(event=SamplingEvent.poisson(0.5, 8))  # a classic event given as one
    with PrivacyLedger(path, resume=True) as led:  # a resume marker without metadata
        led.record_sample(sampling_probability=0.01, population_size=60_000)
        led.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.1, label="dense/kernel")
    with PrivacyLedger(path, resume=True, metadata={"session": 3}) as led:  # with metadata
        led.record_sample(sampling_probability=0.02, population_size=60_000)
    with PrivacyLedger(path, resume=True, buffer_size=1) as led:  # every event flushed at once
        led.record_sample(sampling_probability=0.02, population_size=60_000)
        led.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.1, label="dense/kernel")
    led = PrivacyLedger(path, resume=True)  # a session that ends without a close marker
    led.record_sample(sampling_probability=0.03, population_size=60_000)
    led.flush()
    del led  # garbage-collected open: flushed, the file released, no close marker


def test_the_same_calls_write_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _hold_clock_and_version(monkeypatch)
    path = tmp_path / "every-kind.dpl"
    write_every_kind(path)
    assert path.read_bytes().splitlines() == GOLDEN.read_bytes().splitlines()
    assert path.read_bytes() == GOLDEN.read_bytes()


def test_the_golden_file_loads_and_verifies() -> None:
    ledger = PrivacyLedger.load(GOLDEN)
    assert ledger.num_steps == 13
    assert ledger.closed_cleanly is False


def test_both_reader_paths_read_every_record_kind_alike() -> None:
    data = GOLDEN.read_bytes()
    outcome, (records, state) = read_both(data)
    assert outcome == "ok"
    kinds = {record[0] for record in records}
    assert kinds == {"sample", "sum_query", "resume", "close"}
    assert any(record[0] == "sample" and record[4] is not None for record in records)
    num_events, num_steps = state[-2:]
    assert num_events == sum(record[0] in ("sample", "sum_query") for record in records)
    assert num_steps == sum(record[0] == "sample" for record in records) == 13
    # Every cut of the file's last line is a torn tail that both paths report alike.
    last = data.rstrip(b"\n").rsplit(b"\n", 1)[1]
    for cut in range(1, len(last)):
        outcome, (_, cut_state) = read_both(data[: len(data) - len(last) - 1 + cut])
        assert outcome == "ok" and cut_state[2] is not None
