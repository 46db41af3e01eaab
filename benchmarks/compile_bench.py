"""Time a DP-SGD step of a ``torch.compile``d model against the eager one and Opacus, same run.

Model: the two-conv, two-linear CNN of Opacus's MNIST example (28×28 single-channel input,
26,010 parameters), float32, batch 64, random data, CPU. Rows:

* ``non-private eager`` / ``non-private compiled``: zero grads, forward, backward, SGD step.
* ``dpledger eager`` / ``dpledger compiled``: ``DPOptimizer`` around SGD (in-memory ledger,
  σ = 1, C = 1): zero grads, forward of the eager or the compiled model, ``loss.backward()``,
  ``step()``. The compiled row's hooks run outside the compiled region
  (``dpledger/adapters/torch/compiled_capture.py``).
* ``opacus eager`` / ``opacus compiled``: Opacus's ``PrivacyEngine.make_private`` (hooks mode,
  Poisson sampling off, so every row sees the same batch), its module used as is or compiled.

The first step of each compiled row (the compilation) is timed alone and reported as
"first step"; medians are over interleaved repeats after warm-up, ratios to the eager
non-private step of the same run. Dynamo's graph breaks are counted for each compiled row.

Run: ``PYTHONPATH=. python benchmarks/compile_bench.py [--repeats 20]``.
"""

from __future__ import annotations

import argparse
import logging
import platform
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch._dynamo.utils import counters

from dpledger import PrivacyLedger
from dpledger.adapters.torch import DPOptimizer

BATCH, SIGMA, CLIP = 64, 1.0, 1.0


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 8, 2, padding=3),
        nn.ReLU(),
        nn.MaxPool2d(2, 1),
        nn.Conv2d(16, 32, 4, 2),
        nn.ReLU(),
        nn.MaxPool2d(2, 1),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 32),
        nn.ReLU(),
        nn.Linear(32, 10),
    )


def _fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = cnn()
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def rows(x: torch.Tensor, y: torch.Tensor) -> dict[str, Callable[[], None]]:
    # The DP rows come first: Dynamo does not guard compiled code on module hooks, so a model
    # compiled first without dpledger's hooks would lend its code to a wrapped model of the
    # same structure (dpledger then refuses the step).
    steps: dict[str, Callable[[], None]] = {}
    for compiled in (False, True):
        model, opt = _fresh()
        dp = DPOptimizer(
            opt,
            model=model,
            l2_norm_bound=CLIP,
            noise_multiplier=SIGMA,
            sampling_probability=BATCH / 60_000,
            population_size=60_000,
            ledger=PrivacyLedger(),
        )
        forward = torch.compile(model) if compiled else model

        def private(forward=forward, dp=dp) -> None:
            dp.zero_grad()
            F.cross_entropy(forward(x), y).backward()
            dp.step()

        steps[f"dpledger {'compiled' if compiled else 'eager'}"] = private
    for compiled in (False, True):
        model, opt = _fresh()
        forward = torch.compile(model) if compiled else model

        def plain(forward=forward, opt=opt) -> None:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(forward(x), y).backward()
            opt.step()

        steps[f"non-private {'compiled' if compiled else 'eager'}"] = plain
    steps.update(_opacus_rows(x, y))
    return steps


def _opacus_rows(x: torch.Tensor, y: torch.Tensor) -> dict[str, Callable[[], None]]:
    try:
        import opacus
        from opacus import PrivacyEngine
    except ImportError:  # pragma: no cover - depends on the environment
        logging.warning("opacus is not installed: peer skipped")
        return {}
    steps: dict[str, Callable[[], None]] = {}
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    for compiled in (False, True):
        model, opt = _fresh()
        gm, go, _ = PrivacyEngine(accountant="rdp").make_private(
            module=model,
            optimizer=opt,
            data_loader=loader,
            noise_multiplier=SIGMA,
            max_grad_norm=CLIP,
            poisson_sampling=False,
        )
        forward = torch.compile(gm) if compiled else gm

        def step(forward=forward, go=go) -> None:
            go.zero_grad(set_to_none=True)
            F.cross_entropy(forward(x), y).backward()
            go.step()

        steps[f"opacus {opacus.__version__} {'compiled' if compiled else 'eager'}"] = step
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (BATCH,), generator=g)
    steps = rows(x, y)
    first: dict[str, float] = {}
    breaks: dict[str, int] = {}
    for name, f in steps.items():
        counters.clear()
        t0 = time.perf_counter()
        f()
        first[name] = time.perf_counter() - t0
        breaks[name] = sum(counters["graph_break"].values())
        for _ in range(args.warmup - 1):
            f()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.repeats):
        for name, f in steps.items():  # interleaved: drifts in machine load hit all rows alike
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    medians = {k: statistics.median(v) for k, v in times.items()}
    base = medians["non-private eager"]
    print(
        f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{args.threads} thread(s), batch {BATCH}, {args.repeats} repeats"
    )
    print(f"{'row':28} {'first step s':>12} {'graph breaks':>12} {'median ms':>10} {'ratio':>7}")
    for name, median in medians.items():
        print(
            f"{name:28} {first[name]:12.2f} {breaks[name]:12d} {median * 1e3:10.2f} "
            f"{median / base:7.2f}"
        )
    eager, compiled = medians["dpledger eager"], medians["dpledger compiled"]
    print(f"dpledger compiled / dpledger eager: {compiled / eager:.2f}")
    for name in medians:
        if name.startswith("opacus") and name.endswith("eager"):
            print(f"dpledger compiled / {name}: {compiled / medians[name]:.2f}")


if __name__ == "__main__":
    main()
