"""A DPTrainer run under ``accelerate launch`` (DDP, gloo): each rank writes what it saw.

Usage: accelerate launch --cpu --num_processes 2 ddp_trainer_worker.py OUTPUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dpledger.accountants import RdpAccountant
from dpledger.integrations.transformers import DPTrainer
from tests.integrations.hf_models import classification_data, tiny_bert, training_args


def main(out: Path) -> None:
    torch.set_num_threads(1)
    args = training_args(
        str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2
    )
    trainer = DPTrainer(
        model=tiny_bert(dropout=0.0),
        args=args,
        train_dataset=classification_data(32),
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        delta=1e-5,
        ledger=out / "run.dpl",
        seed=5,
        epsilon_accountant=RdpAccountant(orders=tuple(range(2, 65))),
    )
    trainer.train()
    rank = dist.get_rank()
    ledger = trainer.ledger
    result = {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "global_step": trainer.state.global_step,
        "ledger_steps": None if ledger is None else ledger.num_steps,
        "events": None
        if ledger is None
        else [[s.sampling_probability, s.population_size] for s in ledger.steps()],
        "parameters": [p.detach().double().sum().item() for p in trainer.model.parameters()],
        "epsilon": [h.get("epsilon") for h in trainer.state.log_history],
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result), encoding="utf-8")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
