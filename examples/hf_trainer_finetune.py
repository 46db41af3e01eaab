"""Fine-tune a Hugging Face BERT classifier with DP inside ``transformers.Trainer``.

``DPTrainer`` is the Trainer with DP-SGD: its train loader draws Poisson samples of expected size
per_device_train_batch_size × world size × gradient_accumulation_steps, the accumulation's
micro-batches form one DP step, ε is logged with the Trainer's own logs, and every step is in a
ledger file whose path and head hash each checkpoint names. The model is built from a small
config (random initialisation: nothing is downloaded); the data are generated sentences whose
label says whether most of their words are "positive" or "negative" ones. The noise multiplier is
calibrated for ε = 8 at δ = 1e-5 over the planned steps. About 45 s of CPU time (2-core
x86_64; 20 steps; test accuracy 1.0).

    python examples/hf_trainer_finetune.py [--out hf-run] [--epochs 2]
    dpledger epsilon hf-run/run.dpl --delta 1e-5
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch
from transformers import BertConfig, BertForSequenceClassification, TrainingArguments

from dpledger import PrivacyLedger
from dpledger.accountants import make_accountant
from dpledger.integrations.transformers import DPTrainer

DELTA = 1e-5
VOCAB, LENGTH = 120, 16
POSITIVE, NEGATIVE = range(10, 20), range(20, 30)  # the words that carry the label


def sentences(count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Filler words and 8-15 words of the label's kind (positive for 1, negative for 0)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        label = int(torch.randint(0, 2, (1,), generator=g))
        ids = torch.randint(30, VOCAB, (LENGTH,), generator=g)
        k = int(torch.randint(8, LENGTH, (1,), generator=g))
        positions = 1 + torch.randperm(LENGTH - 1, generator=g)[:k]
        words = POSITIVE if label == 1 else NEGATIVE
        ids[positions] = words.start + torch.randint(0, len(words), (k,), generator=g)
        ids[0] = 1  # a [CLS]-like first token
        rows.append({"input_ids": ids, "labels": torch.tensor(label)})
    return rows


def accuracy(model: torch.nn.Module, data: list[dict[str, torch.Tensor]]) -> float:
    model.eval()
    with torch.no_grad():
        ids = torch.stack([row["input_ids"] for row in data])
        labels = torch.stack([row["labels"] for row in data])
        predicted = model(input_ids=ids).logits.argmax(1)
    return float((predicted == labels).float().mean())


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="hf-run", help="output folder (checkpoints, ledger)")
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--records", type=int, default=3000)
    args = parser.parse_args(argv)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)  # a fresh run: a ledger file is never overwritten
    torch.manual_seed(0)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    model = BertForSequenceClassification(
        BertConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=128,
            max_position_embeddings=LENGTH,
            num_labels=2,
        )
    )
    train, test = sentences(args.records, seed=1), sentences(512, seed=2)
    training = TrainingArguments(
        str(out),
        per_device_train_batch_size=150,
        gradient_accumulation_steps=2,  # one DP step of expected 300 records per optimizer step
        num_train_epochs=args.epochs,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        logging_steps=5,
        save_strategy="epoch",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = DPTrainer(
        model=model,
        args=training,
        train_dataset=train,
        l2_norm_bound=1.0,
        target_epsilon=8.0,
        delta=DELTA,
        ledger=out / "run.dpl",
    )
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    trainer.ledger.close()
    logged = [h["epsilon"] for h in trainer.state.log_history if "epsilon" in h]
    result = make_accountant("prv").epsilon(PrivacyLedger.load(out / "run.dpl"), delta=DELTA)
    summary = {
        "steps": float(trainer.state.global_step),
        "test_accuracy": accuracy(model, test),
        "logged_epsilon_rdp": logged[-1],
        "epsilon_prv": result.epsilon,
        "seconds": seconds,
    }
    print(
        f"{trainer.state.global_step} DP steps in {seconds:.1f} s, test accuracy "
        f"{summary['test_accuracy']:.3f}; ε logged by the Trainer (RDP) {logged[-1]:.3f}, "
        f"from the ledger file: {result.epsilon:.3f} ({result.kind.value}, PRV) at δ = {DELTA}"
    )
    return summary


if __name__ == "__main__":
    main()
