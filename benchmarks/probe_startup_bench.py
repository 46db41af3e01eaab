"""Start-up cost of the record-independence probe on the PyTorch step benchmark's models.

Run from the repository root:

    PYTHONPATH=. python benchmarks/probe_startup_bench.py cnn transformer transformer-mha

For each model of ``benchmarks/torch_step_bench.py`` (same models, batches and data), a fresh
``DPOptimizer`` takes one step with ``check_record_independence=True`` and one with ``False``
(the probe runs before the first step), then five more steps; and the probe is timed on its own
on the same batch. Runs alternate between the two settings, ``--repeats`` times; the table shows
medians. One CPU thread, so the two settings do not compete for cores.
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_step_bench import make_model

from dpledger import PrivacyLedger
from dpledger.adapters.torch import DPOptimizer, probe_record_independence


def _step(model: torch.nn.Module, dp: DPOptimizer, x: Any, y: torch.Tensor) -> None:
    dp.zero_grad()
    dp.backward(functional.cross_entropy(model(x), y))
    dp.step()


def _run(base: torch.nn.Module, probe: bool, x: Any, y: torch.Tensor) -> tuple[float, ...]:
    """(first step, median of 5 later steps, the probe alone), in seconds."""
    model = copy.deepcopy(base)
    dp = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        sampling_probability=0.01,
        population_size=60_000,
        ledger=PrivacyLedger(),
        seed=0,
        check_record_independence=probe,
    )
    start = time.perf_counter()
    _step(model, dp, x, y)
    first = time.perf_counter() - start
    later = []
    for _ in range(5):
        start = time.perf_counter()
        _step(model, dp, x, y)
        later.append(time.perf_counter() - start)
    start = time.perf_counter()
    probe_record_independence(model, engine=dp.engine, args=(x,))
    alone = time.perf_counter() - start
    return first, statistics.median(later), alone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="names from torch_step_bench.make_model")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # the probe-off warning, once per optimizer
    torch.set_num_threads(1)
    print(
        "| model (batch) | first step, probe on | first step, probe off | probe alone "
        "| later steps, on / off |"
    )
    print("| --- | --- | --- | --- | --- |")
    for name in args.models:
        base, data, batch = make_model(name)
        x, y = data(batch, torch.device("cpu"))
        rows: dict[bool, list[tuple[float, ...]]] = {True: [], False: []}
        for _ in range(args.repeats):
            for probe in (True, False):
                rows[probe].append(_run(base, probe, x, y))

        def med(probe: bool, k: int, rows: dict = rows) -> float:
            return statistics.median(r[k] for r in rows[probe]) * 1e3

        print(
            f"| {name} ({batch}) | {med(True, 0):.1f} ms | {med(False, 0):.1f} ms "
            f"| {med(True, 2):.1f} ms | {med(True, 1):.1f} / {med(False, 1):.1f} ms |",
            flush=True,
        )


if __name__ == "__main__":
    main()
