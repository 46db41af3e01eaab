"""One DP-SGD step on large models: dpledger against the non-private step and Opacus, same run.

Runs on CUDA when it is available (full sizes), on the CPU otherwise (tiny sizes that finish in a
few minutes on 2 cores; the same architectures, so the counts of dispatched operations per step
are those of the full models up to the layers' widths). Rows (``--rows`` picks a subset):

* ``resnet18-256``, ``resnet18-1024``: ResNet-18 (CIFAR stem: 3×3 convolution, no max-pool;
  BasicBlocks [2, 2, 2, 2] of widths 64–512; GroupNorm with 32 groups instead of BatchNorm,
  which mixes records), 32×32 inputs, 10 classes, batch 256 and 1024. CPU: widths 8–64, 16×16
  inputs, batch 8 and 16.
* ``bert-32``, ``bert-64``: BERT-base (``BertForSequenceClassification`` from a
  ``BertConfig``, random initialisation, nothing downloaded), sequence 128, batch 32 and 64.
  CPU: 2 layers of width 64, sequence 16, batch 4 and 8.
* ``gpt2-32``, ``gpt2-64``: GPT-2 small (``GPT2LMHeadModel`` from a ``GPT2Config``), the
  next-token loss, sequence 128, batch 32 and 64. CPU: 2 layers of width 64, sequence 16.
* ``llama-lora``: a Llama-style decoder (``LlamaConfig``: width 1024, 8 layers, 16 heads of
  which 4 key/value heads (GQA), MLP 2816, vocabulary 32,000) with LoRA adapters (``peft``,
  r = 16 on the attention projections; only the adapters train), sequence 128, batch 32. CPU:
  width 64, 2 layers, 4 heads, 2 key/value heads, sequence 16, batch 4.

Methods per row: the non-private step (forward, ``loss.backward()``, SGD step); dpledger's
``DPOptimizer`` around SGD (``optimizer.backward(loss)``, Poisson-free fixed batch through
``sampling_probability=``/``population_size=``, flat clipping, σ = 1, an in-memory ledger);
Opacus's ``PrivacyEngine`` in ``hooks`` and ``ghost`` modes (Poisson sampling off so that every
method sees the same batch). A method that fails is reported as failed with the first line of
its error, and the run goes on.

Columns: ms/step (median over ``--repeats`` interleaved repeats, with a device synchronisation
around each step on CUDA), peak memory in a step (CUDA: ``torch.cuda.max_memory_allocated``
above what was allocated before it; CPU: the peak of the profiler's memory events), the
operations dispatched per step (CUDA: kernels launched; CPU: the aten operators called from
Python or from autograd, i.e. not nested inside another aten operator — each one is at least one
kernel launch on an accelerator), the host synchronisations per step (CUDA:
``cudaStreamSynchronize``/``cudaDeviceSynchronize``/``cudaEventSynchronize`` and blocking
``cudaMemcpy`` calls; CPU: reads of tensor data into Python (``.item()``, ``float()``,
``bool()``, ``int()``, ``.tolist()``, ``.cpu()``, which ``.numpy()`` of a device tensor needs;
not ``.to(device)``, which cannot tell a copy to the host from one between devices when every
tensor is on the CPU) and the operators whose output size depends on the data (``unique``,
``nonzero``, ``masked_select``), each of which waits for the device on an accelerator), and
on CUDA the largest batch that fits (doubling from the row's batch until out of memory, then
bisection; ``--no-max-batch`` skips it). Ratios are to the non-private step and to the faster of
Opacus's modes.

Run: ``PYTHONPATH=. python benchmarks/gpu_bench.py`` (``--help`` for options).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import copy
import gc
import logging
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.overrides import TorchFunctionMode

CLIP = 1.0
SIGMA = 1.0
LR = 1e-3
POPULATION = 1_000_000

# --------------------------------------------------------------------------- counting


_READS = {"__float__", "__bool__", "__int__", "__index__", "item", "tolist", "cpu"}
_DATA_DEPENDENT = ("aten::unique", "aten::_unique", "aten::nonzero", "aten::masked_select")
_CUDA_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


class _HostReads(TorchFunctionMode):
    """Counts reads of tensor data into Python (each a host synchronisation on a device)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _READS:
            self.count += 1
        return func(*args, **kwargs)


@dataclass
class Counts:
    ops: int  # CPU: top-level aten operators; CUDA: kernels launched
    syncs: int


def count_step(step: Callable[[], None], device: torch.device) -> Counts:
    """Dispatched operations and host synchronisations of one call of ``step``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    reads = _HostReads()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=activities) as prof:
            if device.type == "cpu":
                with reads:
                    step()
            else:
                step()
                torch.cuda.synchronize(device)
    events = prof.events()
    if device.type == "cuda":
        kernels = sum(
            1
            for e in events
            if e.device_type == torch.autograd.DeviceType.CUDA
            and not e.name.startswith(("Memcpy", "Memset"))
        )
        syncs = sum(
            1
            for e in events
            if e.name.startswith(_CUDA_SYNCS) or e.name in ("cudaMemcpy", "cudaMemcpy2D")
        )
        return Counts(ops=kernels, syncs=max(syncs - 1, 0))  # less the one after the step
    top = 0
    data_dependent = 0
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            top += 1
            if e.name.startswith(_DATA_DEPENDENT):
                data_dependent += 1
    return Counts(ops=top, syncs=reads.count + data_dependent)


# --------------------------------------------------------------------------- models


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.gn1 = nn.GroupNorm(min(32, cout // 2), cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.gn2 = nn.GroupNorm(min(32, cout // 2), cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(min(32, cout // 2), cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.gn1(self.conv1(x)))
        out = self.gn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 with GroupNorm (CIFAR stem); ``width`` is the first stage's channels."""

    def __init__(self, width: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.gn1 = nn.GroupNorm(min(32, width // 2), width)
        layers = []
        cin = width
        for i, stride in enumerate((1, 2, 2, 2)):
            cout = width * 2**i
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(F.relu(self.gn1(self.conv1(x))))
        return self.fc(F.adaptive_avg_pool2d(out, 1).flatten(1))


class _ClassifierLoss(nn.Module):
    """A Hugging Face model as ``model(ids) -> logits``, so every method calls it alike."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=ids).logits


@dataclass
class Row:
    model: Callable[[], nn.Module]
    data: Callable[[int, torch.device], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    batch: int


def _images(size: int) -> Callable:
    def data(batch: int, device: torch.device) -> tuple:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(batch, 3, size, size, generator=g)
        return x.to(device), torch.randint(0, 10, (batch,), generator=g).to(device)

    return data


def _tokens(vocab: int, length: int, classes: int | None) -> Callable:
    def data(batch: int, device: torch.device) -> tuple:
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, vocab, (batch, length), generator=g)
        y = x if classes is None else torch.randint(0, classes, (batch,), generator=g)
        return x.to(device), y.to(device)

    return data


def _lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    # mean over every predicted token: (1/B)·Σ_i ℓ_i with ℓ_i the mean over record i's tokens
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def make_rows(full: bool) -> dict[str, Row]:
    """The rows at full size (CUDA) or tiny size (CPU)."""
    width, image = (64, 32) if full else (8, 16)
    rows = {
        "resnet18-256": Row(
            lambda: ResNet18(width), _images(image), F.cross_entropy, 256 if full else 8
        ),
        "resnet18-1024": Row(
            lambda: ResNet18(width), _images(image), F.cross_entropy, 1024 if full else 16
        ),
    }
    length = 128 if full else 16
    vocab = 30522 if full else 1000

    def bert() -> nn.Module:
        from transformers import BertConfig, BertForSequenceClassification

        kw = {} if full else dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
        if not full:
            kw.update(intermediate_size=128, vocab_size=vocab, max_position_embeddings=64)
        cfg = BertConfig(num_labels=2, attn_implementation="eager", **kw)
        return _ClassifierLoss(BertForSequenceClassification(cfg))

    def gpt2() -> nn.Module:
        from transformers import GPT2Config, GPT2LMHeadModel

        kw = {} if full else dict(n_embd=64, n_layer=2, n_head=4, vocab_size=vocab, n_positions=64)
        cfg = GPT2Config(attn_implementation="eager", **kw)
        return _ClassifierLoss(GPT2LMHeadModel(cfg))

    gpt_vocab = 50257 if full else vocab
    for b in (32, 64):
        small = b // 8
        rows[f"bert-{b}"] = Row(
            bert, _tokens(vocab, length, 2), F.cross_entropy, b if full else small
        )
        rows[f"gpt2-{b}"] = Row(
            gpt2, _tokens(gpt_vocab, length, None), _lm_loss, b if full else small
        )

    llama_vocab = 32000 if full else vocab

    def llama() -> nn.Module:
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM

        if full:
            kw = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16)
            kw.update(num_key_value_heads=4, intermediate_size=2816)
        else:
            kw = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
            kw.update(num_key_value_heads=2, intermediate_size=128)
        cfg = LlamaConfig(
            vocab_size=llama_vocab, max_position_embeddings=256, attn_implementation="eager", **kw
        )
        lora = LoraConfig(
            r=16,
            lora_alpha=32,
            lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        )
        return _ClassifierLoss(get_peft_model(LlamaForCausalLM(cfg), lora))

    rows["llama-lora"] = Row(llama, _tokens(llama_vocab, length, None), _lm_loss, 32 if full else 4)
    return rows


# --------------------------------------------------------------------------- methods


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def build_method(
    name: str, row: Row, base: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> Callable[[], None]:
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(_trainable(model), lr=LR)
    batch = x.shape[0]
    if name == "non-private":

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            row.loss(model(x), y).backward()
            opt.step()

        return step
    if name == "dpledger":
        from dpledger import PrivacyLedger
        from dpledger.adapters.torch import DPOptimizer

        dp = DPOptimizer(
            opt,
            model=model,
            l2_norm_bound=CLIP,
            noise_multiplier=SIGMA,
            sampling_probability=batch / POPULATION,
            population_size=POPULATION,
            ledger=PrivacyLedger(),
            seed=0,
        )

        def step() -> None:
            dp.zero_grad(set_to_none=True)
            dp.backward(row.loss(model(x), y))
            dp.step()

        return step
    from opacus import PrivacyEngine

    mode = name.split()[-1]
    dataset = torch.utils.data.TensorDataset(x.cpu(), y.cpu())
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch)

    class _Criterion(nn.Module):
        def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return row.loss(out, target)

    out = PrivacyEngine(accountant="rdp").make_private(
        module=model,
        optimizer=opt,
        criterion=_Criterion(),
        data_loader=loader,
        noise_multiplier=SIGMA,
        max_grad_norm=CLIP,
        poisson_sampling=False,
        grad_sample_mode=mode,
    )
    if mode == "ghost":
        gm, go, crit, _ = out

        def step() -> None:
            go.zero_grad(set_to_none=True)
            crit(gm(x), y).backward()
            go.step()

    else:
        gm, go, _ = out

        def step() -> None:
            go.zero_grad(set_to_none=True)
            row.loss(gm(x), y).backward()
            go.step()

    return step


METHODS = ("non-private", "dpledger", "opacus hooks", "opacus ghost")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_memory(step: Callable[[], None], device: torch.device) -> int:
    if device.type == "cuda":
        _sync(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        _sync(device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

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


def _fits(name: str, row: Row, base: nn.Module, batch: int, device: torch.device) -> bool:
    gc.collect()
    torch.cuda.empty_cache()
    try:
        x, y = row.data(batch, device)
        step = build_method(name, row, base, x, y)
        for _ in range(2):
            step()
        _sync(device)
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:
        x = y = step = None
        gc.collect()
        torch.cuda.empty_cache()


def max_batch(name: str, row: Row, base: nn.Module, device: torch.device, limit: int) -> str:
    """The largest batch that fits: doubling from the row's batch, then bisection."""
    lo = row.batch
    if not _fits(name, row, base, lo, device):
        return f"<{lo}"
    hi = lo * 2
    while hi <= limit and _fits(name, row, base, hi, device):
        lo, hi = hi, hi * 2
    if hi > limit:
        return f">={lo}"
    while hi - lo > max(1, lo // 16):  # to within 1/16
        mid = (lo + hi) // 2
        if _fits(name, row, base, mid, device):
            lo = mid
        else:
            hi = mid
    return str(lo)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:160]


def run_row(key: str, row: Row, args: argparse.Namespace, device: torch.device) -> None:
    torch.manual_seed(0)
    try:
        base = row.model().to(device)
    except Exception as err:
        print(f"\n## {key}: model failed: {_first_line(err)}")
        return
    x, y = row.data(row.batch, device)
    trainable = sum(p.numel() for p in _trainable(base))
    print(
        f"\n## {key}: {type(getattr(base, 'inner', base)).__name__}, {trainable:,} trainable "
        f"parameters, batch {row.batch}, {args.repeats} repeats"
    )
    steps: dict[str, Callable[[], None]] = {}
    failed: dict[str, str] = {}
    for name in METHODS:
        if name.startswith("opacus") and args.no_opacus:
            continue
        try:
            step = build_method(name, row, base, x, y)
            for _ in range(args.warmup):
                step()
            _sync(device)
            steps[name] = step
        except Exception as err:  # report and go on
            failed[name] = _first_line(err)
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.repeats):
        for k, f in list(steps.items()):
            try:
                _sync(device)
                t0 = time.perf_counter()
                f()
                _sync(device)
                times[k].append(time.perf_counter() - t0)
            except Exception as err:
                failed[k] = _first_line(err)
                del steps[k], times[k]
    med = {k: statistics.median(v) for k, v in times.items()}
    base_t = med.get("non-private")
    opacus = {k: v for k, v in med.items() if k.startswith("opacus")}
    best = min(opacus.values()) if opacus else None
    header = (
        f"{'method':14s} {'ms/step':>9s} {'x non-priv':>10s} {'x opacus':>9s} {'peak MB':>9s} "
        f"{'ops/step' if device.type == 'cpu' else 'kernels':>9s} {'syncs':>6s} {'max batch':>10s}"
    )
    print(header)
    for name in METHODS:
        if name in failed:
            print(f"{name:14s} failed: {failed[name]}")
            continue
        if name not in med:
            continue
        v = med[name]
        counts = count_step(steps[name], device)
        mem = _peak_memory(steps[name], device)
        fits = "-"
        if device.type == "cuda" and not args.no_max_batch:
            del steps[name]
            fits = max_batch(name, row, base, device, args.max_batch_limit)
        ratio = f"{v / base_t:10.2f}" if base_t else f"{'-':>10s}"
        rel = f"{v / best:9.2f}" if best else f"{'-':>9s}"
        print(
            f"{name:14s} {v * 1e3:9.2f} {ratio} {rel} {mem / 1e6:9.1f} {counts.ops:9d} "
            f"{counts.syncs:6d} {fits:>10s}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=None, help="comma-separated subset of the rows")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--size", choices=("auto", "full", "tiny"), default="auto")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-opacus", action="store_true")
    parser.add_argument("--no-max-batch", action="store_true")
    parser.add_argument("--max-batch-limit", type=int, default=1 << 15)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    warnings.filterwarnings("ignore")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    full = args.size == "full" or (args.size == "auto" and device.type == "cuda")
    if args.repeats is None:
        args.repeats = 20 if device.type == "cuda" else 5
    rows = make_rows(full)
    keys = list(rows) if args.rows is None else args.rows.split(",")
    unknown = [k for k in keys if k not in rows]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {list(rows)}")
    try:
        import opacus

        peer = f"opacus {opacus.__version__}"
    except ImportError:  # pragma: no cover - depends on the environment
        peer = "opacus not installed"
        args.no_opacus = True
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {where}; "
        f"python {platform.python_version()}, torch {torch.__version__}, {peer}; "
        f"{'full' if full else 'tiny'} sizes"
    )
    for key in keys:
        try:
            run_row(key, rows[key], args, device)
        except Exception as err:  # report the row and go on with the next
            print(f"\n## {key}: failed: {_first_line(err)}")
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
