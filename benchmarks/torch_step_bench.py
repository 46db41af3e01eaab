"""Time one DP-SGD step of dpledger's DP optimizer (and its engine) against Opacus, same run.

Models (random data, CPU by default, device-agnostic):

* ``cnn``: the two-conv, two-linear CNN of Opacus's MNIST example on 28×28 single-channel input
  (conv 1→16 k8 s2 p3, max-pool 2/1, conv 16→32 k4 s2, max-pool 2/1, linear 512→32, linear
  32→10; 26,010 parameters), batch 256.
* ``transformer``: token embedding (vocabulary 1000) + position embedding, one pre-LayerNorm
  block with hand-written single-head attention (Linear q, k, v, output) and an MLP, a final
  LayerNorm, mean pooling and a linear head; width 64, sequence length 32, batch 64.
* ``transformer-mha``: the same with ``nn.MultiheadAttention`` (4 heads), which has no grad
  sampler, so the engine uses the generic torch.func path for it (ours only: Opacus needs the
  module replaced by its own DPMultiheadAttention).

Rows "DPOptimizer" are the full wrapper around the user's ``torch.optim.SGD``: ``zero_grad``,
forward, ``optimizer.backward(loss)`` (only the gradients with respect to layer outputs) or the
user's own ``loss.backward()``, and ``optimizer.step()``, which computes the per-example norms,
the flat clip factors on the device, the clipped sum, the sensitivity check, float64 Gaussian noise
from a seeded generator, the ledger's sampling and sum-query events (an in-memory ledger), the
fixed-denominator average sum/(q·n) and SGD's own step. "ledger file" (optimizer.backward)
records to a ledger file with default buffering instead (each step's events are written before
the step returns: the write-ahead write). "bias metrics on" adds the per-step clipping-bias
callback (one more book-keeping pass and a copy to the host); "strategy=generic" uses
torch.func for every layer.

Rows "ours fast"/"ours generic" time the per-example gradient engine alone, as before the
wrapper existed (norms, factors on the device, clipped sum, float32 noise, SGD step):
``engine.backward(loss)`` or the user's ``loss.backward()``; ``strategy=ghost`` never keeps
materialised per-example gradients (less memory, sometimes more time); "whole-model vmap" is
torch.func over the whole model.

Each engine-only DP step is: zero grads, forward, backward, per-example norms, flat clipping
factors f_i = min(1, C / ‖g_i‖), Σ_i f_i g_i, Gaussian noise σ·C on every coordinate, division by
B and an SGD step (Opacus: its GradSampleModule / DPOptimizer in the given grad_sample_mode, with
Poisson sampling off so that every method sees the same batch). The non-private step is zero
grads, forward, backward, SGD step. Times are medians over interleaved repeats; ratios are to the
non-private step of the same run. Peak memory is the peak of tensor memory allocated during one
step above what was allocated before it (torch.profiler memory events, CPU).

Run: ``PYTHONPATH=. python benchmarks/torch_step_bench.py`` (``--help`` for options).
"""

from __future__ import annotations

import os

# The bias-metrics row computes dot products of gradient-sized vectors in NumPy. OpenBLAS runs
# those on several threads that then busy-wait for a while, taking the cores from torch's threads
# in the rows timed after it (several times slower on 2 cores). BLAS is pinned to one thread
# before NumPy is imported; no other row calls BLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import copy
import logging
import platform
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from dpledger import PrivacyLedger
from dpledger.adapters.torch import DPOptimizer, PerExampleGradientEngine
from dpledger.adapters.torch.functional_gradients import FunctionalPerExampleEngine

CLIP = 1.0
POPULATION = 60_000
SIGMA = 1.0
LR = 0.05


class MnistCNN(nn.Module):
    """The CNN of Opacus's MNIST example (26,010 parameters on 28×28 input)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 8, 2, padding=3)
        self.conv2 = nn.Conv2d(16, 32, 4, 2)
        self.fc1 = nn.Linear(32 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2, 1)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2, 1)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class Attention(nn.Module):
    """Single-head self-attention from four nn.Linear layers."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(1, 2) / x.shape[-1] ** 0.5
        return self.out(torch.softmax(scores, -1) @ self.v(x))


class MhaAttention(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(width, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mha(x, x, x, need_weights=False)[0]


class TinyTransformer(nn.Module):
    def __init__(
        self, *, vocab: int = 1000, width: int = 64, length: int = 32, mha: bool = False
    ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(length, width)
        self.ln1 = nn.LayerNorm(width)
        self.attn = MhaAttention(width) if mha else Attention(width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp1 = nn.Linear(width, 2 * width)
        self.mlp2 = nn.Linear(2 * width, width)
        self.ln3 = nn.LayerNorm(width)
        self.head = nn.Linear(width, 4)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # contiguous: Opacus 1.6's ghost mode calls .view on the indices of an embedding
        pos = torch.arange(idx.shape[1], device=idx.device).repeat(idx.shape[0], 1)
        h = self.tokens(idx) + self.positions(pos)
        h = h + self.attn(self.ln1(h))
        h = h + self.mlp2(F.gelu(self.mlp1(self.ln2(h))))
        return self.head(self.ln3(h).mean(1))


def make_model(name: str) -> tuple[nn.Module, Callable[[int, torch.device], tuple], int]:
    if name == "cnn":

        def data(batch: int, device: torch.device) -> tuple:
            g = torch.Generator().manual_seed(1)
            x = torch.randn(batch, 1, 28, 28, generator=g).to(device)
            return x, torch.randint(0, 10, (batch,), generator=g).to(device)

        return MnistCNN(), data, 256

    def data_t(batch: int, device: torch.device) -> tuple:
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, 1000, (batch, 32), generator=g).to(device)
        return x, torch.randint(0, 4, (batch,), generator=g).to(device)

    return TinyTransformer(mha=name == "transformer-mha"), data_t, 64


def _noise_and_step(params: list[nn.Parameter], opt: torch.optim.Optimizer, batch: int) -> None:
    with torch.no_grad():
        for p in params:
            p.grad.add_(torch.randn_like(p), alpha=SIGMA * CLIP).div_(batch)
    opt.step()


def _flat_factors(norms: dict[str, torch.Tensor]) -> torch.Tensor:
    total = torch.stack(list(norms.values())).sum(0).sqrt()
    return (CLIP / (total + 1e-6)).clamp(max=1.0)


def build_steps(
    name: str,
    device: torch.device,
    with_opacus: bool,
    with_metrics: bool = True,
    ledger_dir: str | None = None,
) -> dict[str, Callable]:
    base, data, batch = make_model(name)
    base = base.to(device)
    x, y = data(batch, device)
    steps: dict[str, Callable] = {}

    def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
        m = copy.deepcopy(base)
        return m, torch.optim.SGD(m.parameters(), lr=LR)

    m0, o0 = fresh()

    def non_private() -> None:
        o0.zero_grad(set_to_none=True)
        F.cross_entropy(m0(x), y).backward()
        o0.step()

    steps["non-private"] = non_private

    def ours(strategy: str, fast_backward: bool) -> Callable:
        m, o = fresh()
        params = [p for p in m.parameters() if p.requires_grad]
        engine = PerExampleGradientEngine(m, loss_reduction="mean", strategy=strategy)

        def step() -> None:
            o.zero_grad(set_to_none=True)
            loss = F.cross_entropy(m(x), y)
            if fast_backward:
                engine.backward(loss)
            else:
                loss.backward()
            engine.write_clipped_sum(_flat_factors(engine.squared_norms()))
            _noise_and_step(params, o, batch)

        return step

    def wrapped(
        fast_backward: bool, *, metrics: bool = False, strategy: str = "auto", file: bool = False
    ) -> Callable:
        m, o = fresh()
        path = os.path.join(ledger_dir, f"{name}.dpl") if file and ledger_dir else None
        opt = DPOptimizer(
            o,
            model=m,
            l2_norm_bound=CLIP,
            noise_multiplier=SIGMA,
            sampling_probability=batch / POPULATION,
            population_size=POPULATION,
            ledger=PrivacyLedger(path),
            seed=0,
            strategy=strategy,
            bias_callback=(lambda step, metrics: None) if metrics else None,
        )

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(m(x), y)
            if fast_backward:
                opt.backward(loss)
            else:
                loss.backward()
            opt.step()

        return step

    steps["DPOptimizer (optimizer.backward)"] = wrapped(True)
    steps["DPOptimizer (loss.backward)"] = wrapped(False)
    if ledger_dir is not None:
        steps["DPOptimizer, ledger file"] = wrapped(True, file=True)
    if with_metrics:
        steps["DPOptimizer, bias metrics on"] = wrapped(True, metrics=True)
    steps["DPOptimizer, strategy=generic"] = wrapped(True, strategy="generic")
    steps["ours fast (engine.backward)"] = ours("auto", True)
    steps["ours fast (loss.backward)"] = ours("auto", False)
    steps["ours fast, strategy=ghost"] = ours("ghost", True)

    mf, of = fresh()
    pf = [p for p in mf.parameters() if p.requires_grad]
    functional = FunctionalPerExampleEngine(mf, F.cross_entropy)

    def ours_functional() -> None:
        of.zero_grad(set_to_none=True)
        functional.compute(x, y)
        functional.write_clipped_sum(_flat_factors(functional.squared_norms()))
        _noise_and_step(pf, of, batch)

    steps["ours generic (whole-model vmap)"] = ours_functional

    if with_opacus and name != "transformer-mha":
        steps.update(_opacus_steps(fresh, x, y, batch))
    return steps


def _opacus_steps(fresh: Callable, x: torch.Tensor, y: torch.Tensor, batch: int) -> dict:
    try:
        import opacus
        from opacus import PrivacyEngine
    except ImportError:  # pragma: no cover - depends on the environment
        logging.warning("opacus is not installed: peers skipped")
        return {}
    steps = {}
    dataset = torch.utils.data.TensorDataset(x.cpu(), y.cpu())
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch)
    for mode in ("hooks", "functorch", "ew", "ghost"):
        m, o = fresh()
        engine = PrivacyEngine(accountant="rdp")
        try:
            out = engine.make_private(
                module=m,
                optimizer=o,
                criterion=nn.CrossEntropyLoss(),
                data_loader=loader,
                noise_multiplier=SIGMA,
                max_grad_norm=CLIP,
                poisson_sampling=False,
                grad_sample_mode=mode,
            )
        except Exception as err:  # report and go on with the other modes
            logging.warning("opacus %s mode unavailable: %s", mode, err)
            continue
        if mode == "ghost":
            gm, go, crit, _ = out

            def step(gm=gm, go=go, crit=crit) -> None:
                go.zero_grad(set_to_none=True)
                crit(gm(x), y).backward()
                go.step()

        else:
            gm, go, _ = out

            def step(gm=gm, go=go) -> None:
                go.zero_grad(set_to_none=True)
                F.cross_entropy(gm(x), y).backward()
                go.step()

        steps[f"opacus {opacus.__version__} {mode}"] = step
    return steps


def time_steps(steps: dict[str, Callable], repeats: int, warmup: int) -> dict[str, float]:
    for f in steps.values():
        for _ in range(warmup):
            f()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(repeats):
        for k, f in steps.items():  # interleaved, so drifts in machine load hit all alike
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def peak_memory(step: Callable) -> int:
    """Peak bytes of tensor memory allocated during one call of ``step`` (profiler events)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    current = peak = 0
    for e in events:
        current += e.nbytes()
        peak = max(peak, current)
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="cnn,transformer,transformer-mha")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-opacus", action="store_true")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-metrics", action="store_true", help="leave out the bias-metrics row")
    parser.add_argument(
        "--no-ledger-file", action="store_true", help="leave out the ledger-file row"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    try:
        import opacus

        peer = f"opacus {opacus.__version__}"
    except ImportError:  # pragma: no cover - depends on the environment
        peer = "opacus not installed"
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
        f"python {platform.python_version()}, torch {torch.__version__}, {peer}; "
        f"torch threads {torch.get_num_threads()}, device {device}"
    )
    ledger_dir = None if args.no_ledger_file else tempfile.mkdtemp(prefix="dpledger-bench-")
    try:
        for name in args.models.split(","):
            steps = build_steps(name, device, not args.no_opacus, not args.no_metrics, ledger_dir)
            model, _, batch = make_model(name)
            nparams = sum(p.numel() for p in model.parameters())
            med = time_steps(steps, args.repeats, args.warmup)
            base = med["non-private"]
            print(f"\n## {name}: {nparams} parameters, batch {batch}, {args.repeats} repeats")
            opacus_best = min((v for k, v in med.items() if k.startswith("opacus")), default=None)
            print(f"{'method':40s} {'ms/step':>9s} {'x non-private':>14s} {'x best opacus':>14s}")
            for k, v in med.items():
                rel = f"{v / opacus_best:14.2f}" if opacus_best else f"{'-':>14s}"
                print(f"{k:40s} {v * 1e3:9.2f} {v / base:14.2f} {rel}")
            if not args.no_memory and device.type == "cpu":
                mem = {k: peak_memory(f) for k, f in steps.items()}
                print(f"{'peak memory in a step':40s} {'MB':>9s} {'x non-private':>14s}")
                for k, v in mem.items():
                    print(f"{k:40s} {v / 1e6:9.2f} {v / mem['non-private']:14.2f}")
    finally:
        if ledger_dir is not None:
            shutil.rmtree(ledger_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
