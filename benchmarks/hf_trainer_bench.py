"""Time the Hugging Face Trainer's optimizer step with and without DP (DPTrainer), same run.

Model: ``BertForSequenceClassification`` from a small config (2 layers, hidden 64, 2 heads,
intermediate 128, vocabulary 1000, sequence length 32; random init, nothing downloaded), on
generated token sequences. The plain row is ``transformers.Trainer`` on batches of B records
(AdamW, ``max_grad_norm=1``); the DP row is
:class:`~dpledger.integrations.transformers.DPTrainer` with Poisson batches of expected size B
(q = B / n), per-example clipping, Gaussian noise (z = 1) and an in-memory ledger, logging ε
every ``--log-every`` steps. A step is the time from the Trainer's ``on_step_begin`` to its
``on_step_end`` (data loading, forward, backward, the optimizer step and the scheduler; the DP
step adds per-example norms, clipping, noise and the ledger's events); the first ``--warmup``
steps of each run (the record-independence probe, allocator warm-up) are left out. The two
trainers run alternately ``--repeats`` times; the table prints the medians over all kept steps
and the ratio DP / plain.

Run: ``PYTHONPATH=. python benchmarks/hf_trainer_bench.py [--device cpu|cuda] [--batch 64]``.
"""

from __future__ import annotations

import argparse
import logging
import platform
import statistics
import tempfile
import time

import torch
import transformers
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from dpledger.integrations.transformers import DPTrainer

VOCAB, LENGTH = 1000, 32


class StepTimer(TrainerCallback):
    """Seconds of every optimizer step, from on_step_begin to on_step_end."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.times: list[float] = []
        self._start = 0.0

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def on_step_begin(self, args, state, control, **kwargs):
        self._sync()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self._sync()
        self.times.append(time.perf_counter() - self._start)


def data(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
    labels = torch.randint(0, 2, (n,), generator=g)
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(n)]


def model() -> BertForSequenceClassification:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=LENGTH,
        num_labels=2,
    )
    return BertForSequenceClassification(config)


def run(dp: bool, opts: argparse.Namespace, train: list[dict[str, torch.Tensor]]) -> list[float]:
    timer = StepTimer(opts.device)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            out,
            per_device_train_batch_size=opts.batch,
            max_steps=opts.steps,
            logging_steps=opts.log_every,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            use_cpu=opts.device == "cpu",
            dataloader_pin_memory=False,
        )
        common = {"model": model(), "args": args, "train_dataset": train, "callbacks": [timer]}
        if dp:
            trainer: Trainer = DPTrainer(
                **common, l2_norm_bound=1.0, noise_multiplier=1.0, delta=1e-5, seed=0
            )
        else:
            trainer = Trainer(**common)
        trainer.train()
    return timer.times[opts.warmup :]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--records", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=23)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=10)
    opts = parser.parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    train = data(opts.records)
    times: dict[str, list[float]] = {"Trainer (no DP)": [], "DPTrainer": []}
    for _ in range(opts.repeats):
        times["Trainer (no DP)"] += run(False, opts, train)
        times["DPTrainer"] += run(True, opts, train)
    device = torch.cuda.get_device_name() if opts.device == "cuda" else platform.processor()
    print(
        f"device {opts.device} ({device or platform.machine()}), torch {torch.__version__}, "
        f"transformers {transformers.__version__}, {torch.get_num_threads()} threads; "
        f"BERT 2×64, length {LENGTH}, batch {opts.batch} (DP: expected, q = "
        f"{opts.batch / opts.records:g}); medians of {len(times['DPTrainer'])} steps each"
    )
    plain = statistics.median(times["Trainer (no DP)"])
    print(f"{'trainer':<18}{'median step (ms)':>18}{'ratio':>8}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<18}{median * 1e3:>18.1f}{median / plain:>8.2f}")


if __name__ == "__main__":
    main()
