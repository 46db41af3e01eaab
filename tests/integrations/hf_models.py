"""Tiny Hugging Face models and data for the integration tests: built from configs, random
init, nothing downloaded."""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    TrainingArguments,
)

VOCAB = 40
LENGTH = 6


def tiny_bert(*, seed: int = 0, dropout: float = 0.1) -> BertForSequenceClassification:
    """A 2-layer BERT classifier, hidden size 32."""
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=LENGTH,
        num_labels=2,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    return BertForSequenceClassification(config)


def tiny_gpt2(*, seed: int = 0) -> GPT2LMHeadModel:
    """A 2-layer GPT-2, hidden size 32."""
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2)
    return GPT2LMHeadModel(config)


def classification_data(n: int, *, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """n token sequences with a binary label each."""
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.randint(0, VOCAB, (LENGTH,), generator=g),
            "attention_mask": torch.ones(LENGTH, dtype=torch.long),
            "labels": torch.tensor(i % 2),
        }
        for i in range(n)
    ]


def lm_data(n: int, *, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """n token sequences labelled with themselves (causal language modelling)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (LENGTH,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def training_args(output_dir: str, **kwargs: Any) -> TrainingArguments:
    """TrainingArguments for the CPU, no reports, no progress bar."""
    defaults: dict[str, Any] = {
        "per_device_train_batch_size": 4,
        "max_steps": 2,
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
        "logging_steps": 1,
        "save_strategy": "no",
        "learning_rate": 1e-2,
        "optim": "sgd",
    }
    defaults.update(kwargs)
    return TrainingArguments(output_dir, **defaults)
