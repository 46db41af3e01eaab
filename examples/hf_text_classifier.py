"""Train a Hugging Face BERT classifier with DP-SGD, unchanged, and account for it.

The model is ``transformers``' own ``BertForSequenceClassification`` built from a small config
(random initialisation: nothing is downloaded). The data are generated: each sentence holds a
majority of "positive" or "negative" words among filler words, and its label says which kind.
``make_private`` wraps the model, AdamW and the data set in one call; every step draws a Poisson
sample, clips each sentence's gradient (per-layer rules for every BERT module, including its
position embeddings of shape (1, T) broadcast over the batch), adds Gaussian noise and records
the step in a ledger file. About 8 s on a 2-core x86_64 CPU
(``benchmarks/examples_wall_time.py``).

    python examples/hf_text_classifier.py [--ledger bert.dpl] [--epochs 3]
    dpledger epsilon bert.dpl --delta 1e-5
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812
from torch.utils.data import DataLoader, TensorDataset
from transformers import BertConfig, BertForSequenceClassification

from dpledger import PrivacyLedger
from dpledger.accountants import make_accountant
from dpledger.adapters.torch import make_private

DELTA = 1e-5
VOCAB, LENGTH = 120, 16
POSITIVE, NEGATIVE = range(10, 20), range(20, 30)  # the words that carry the label


def sentences(count: int, seed: int) -> TensorDataset:
    """Filler words and 8-15 words of the label's kind (positive for 1, negative for 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(30, VOCAB, (count, LENGTH), generator=g)
    labels = torch.randint(0, 2, (count,), generator=g)
    for i in range(count):
        k = int(torch.randint(8, LENGTH, (1,), generator=g))
        positions = 1 + torch.randperm(LENGTH - 1, generator=g)[:k]
        words = POSITIVE if labels[i] == 1 else NEGATIVE
        ids[i, positions] = words.start + torch.randint(0, len(words), (k,), generator=g)
    ids[:, 0] = 1  # a [CLS]-like first token
    return TensorDataset(ids, labels)


def accuracy(model: torch.nn.Module, data: TensorDataset) -> float:
    model.eval()
    with torch.no_grad():
        ids, labels = data.tensors
        predicted = model(input_ids=ids).logits.argmax(1)
    model.train()
    return float((predicted == labels).float().mean())


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ledger", type=Path, default=Path("bert.dpl"))
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--target-epsilon", type=float, default=8.0)
    parser.add_argument(
        "--noise-seed",
        type=int,
        default=None,
        help="seeds the noise and the batches, for tests only (default: the OS's entropy)",
    )
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    train, test = sentences(3000, seed=1), sentences(1000, seed=2)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=LENGTH,
        num_labels=2,
    )
    model = BertForSequenceClassification(config)  # dropout stays on: it is per record
    args.ledger.unlink(missing_ok=True)
    ledger = PrivacyLedger(args.ledger)
    model, optimizer, loader = make_private(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        DataLoader(train, batch_size=300, shuffle=True),  # replaced by Poisson, q = 300/3000
        l2_norm_bound=1.0,
        target_epsilon=args.target_epsilon,
        delta=DELTA,
        epochs=args.epochs,
        ledger=ledger,
        seed=args.noise_seed,  # None: noise and batches from the OS
    )
    start = time.perf_counter()
    for _ in range(args.epochs):
        for ids, labels in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(input_ids=ids).logits, labels)
            optimizer.backward(loss)
            optimizer.step()
    seconds = time.perf_counter() - start
    ledger.close()

    result = {
        "accuracy": accuracy(model, test),
        "epsilon": make_accountant("prv")
        .epsilon(PrivacyLedger.load(args.ledger), delta=DELTA)
        .epsilon,
        "steps": float(optimizer.steps_taken),
        "seconds": seconds,
    }
    print(
        f"BERT ({sum(p.numel() for p in model.parameters()):,} parameters), "
        f"{int(result['steps'])} DP steps in {seconds:.1f} s: test accuracy "
        f"{result['accuracy']:.3f} at ε = {result['epsilon']:.2f} (δ = {DELTA:g}, PRV), "
        f"noise multiplier {optimizer.noise_multiplier:.3f}; ledger: {args.ledger}"
    )
    return result


if __name__ == "__main__":
    main()
