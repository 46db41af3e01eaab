"""DPTrainer: the Hugging Face Trainer with DP steps recorded in a ledger.

Tiny models from configs (2 layers, hidden 32), random init, generated data; nothing is
downloaded. Oracles: dp-accounting's RDP accountant for the logged ε, a float64 per-example
loop for the per-example token loss, and the plain Trainer on the same batches for the step.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
import torch
from torch.utils.data import IterableDataset
from transformers import Trainer
from transformers.modeling_outputs import SequenceClassifierOutput

from dpledger.accountants import RdpAccountant
from dpledger.errors import InvalidParameterError, PerExampleLossError
from dpledger.integrations.transformers import (
    LEDGER_INFO_NAME,
    DPTrainer,
    per_example_token_loss,
)
from dpledger.ledger import PrivacyLedger
from tests.integrations.hf_models import (
    classification_data,
    lm_data,
    tiny_bert,
    tiny_gpt2,
    training_args,
)

ROOT = Path(__file__).resolve().parents[2]
DELTA = 1e-5


def _dp_trainer(tmp: Path, *, n: int = 32, model=None, data=None, **kwargs) -> DPTrainer:
    args = kwargs.pop("args", None) or training_args(str(tmp / "out"))
    privacy = {"l2_norm_bound": 1.0, "noise_multiplier": 1.0, "delta": DELTA, "seed": 7}
    privacy.update(kwargs)
    return DPTrainer(
        model=model if model is not None else tiny_bert(),
        args=args,
        train_dataset=data if data is not None else classification_data(n),
        **privacy,
    )


INTEGER_ORDERS = tuple(range(2, 65))


def _rdp_epsilon(q: float, z: float, steps: int, delta: float) -> float:
    """dp-accounting's RDP ε for ``steps`` Poisson-sampled Gaussian steps, at integer orders
    (where its series and dpledger's agree; dpledger's rdp module docstring)."""
    accountant = dp_accounting.rdp.RdpAccountant(orders=INTEGER_ORDERS)
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
    accountant.compose(event, steps)
    return accountant.get_epsilon(delta)


# ------------------------------------------------------------------ one run, several checks
@pytest.fixture(scope="module")
def accumulated_run(tmp_path_factory) -> tuple[DPTrainer, Path]:
    """3 optimizer steps of 2 accumulated micro-batches (B = 2, k = 2, n = 32)."""
    tmp = tmp_path_factory.mktemp("accumulated")
    args = training_args(
        str(tmp / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3
    )
    trainer = _dp_trainer(
        tmp,
        args=args,
        ledger=tmp / "run.dpl",
        epsilon_accountant=RdpAccountant(orders=INTEGER_ORDERS),
    )
    trainer.train()
    return trainer, tmp / "run.dpl"


def test_one_ledger_step_per_optimizer_step_with_the_recorded_q_and_n(accumulated_run):
    trainer, _ = accumulated_run
    assert trainer.state.global_step == 3
    steps = list(trainer.ledger.steps())
    # two micro-batches per optimizer step, yet one sampling event each: q = B·W·k / n
    assert len(steps) == trainer.state.global_step
    for step in steps:
        assert step.sampling_probability == 2 * 1 * 2 / 32
        assert step.population_size == 32
        (query,) = step.queries
        assert query.l2_norm_bound == 1.0
        assert query.noise_stddev == pytest.approx(1.0)


def test_epsilon_is_in_the_log_history(accumulated_run):
    trainer, path = accumulated_run
    logged = [(h["step"], h["epsilon"]) for h in trainer.state.log_history if "loss" in h]
    assert [s for s, _ in logged] == [1, 2, 3]
    for step, epsilon in logged:
        assert epsilon == pytest.approx(_rdp_epsilon(0.125, 1.0, step, DELTA), rel=1e-6)
        # and never below the tight PLD value
        pld = dp_accounting.pld.PLDAccountant()
        pld.compose(
            dp_accounting.PoissonSampledDpEvent(0.125, dp_accounting.GaussianDpEvent(1.0)), step
        )
        assert epsilon >= pld.get_epsilon(DELTA)
    trainer.ledger.flush()
    accountant = RdpAccountant(orders=INTEGER_ORDERS)
    on_file = accountant.epsilon(PrivacyLedger.load(path), delta=DELTA).epsilon
    assert logged[-1][1] == on_file  # the ε of the ledger file, not of a setting
    assert all("grad_norm" not in h for h in trainer.state.log_history)


def test_the_checkpoint_folder_names_the_ledger_and_its_head(tmp_path):
    args = training_args(str(tmp_path / "out"), max_steps=2, save_strategy="steps", save_steps=1)
    trainer = _dp_trainer(tmp_path, args=args, ledger=tmp_path / "run.dpl")
    trainer.train()
    info = json.loads((tmp_path / "out" / "checkpoint-2" / LEDGER_INFO_NAME).read_text())
    assert info["ledger_path"] == os.fspath(tmp_path / "run.dpl")
    assert info["num_steps"] == 2 and info["global_step"] == 2
    assert info["head_hash"] == trainer.ledger.head_hash
    first = json.loads((tmp_path / "out" / "checkpoint-1" / LEDGER_INFO_NAME).read_text())
    assert first["num_steps"] == 1 and first["head_hash"] != info["head_hash"]


# ------------------------------------------------------------------ sampling
def test_each_poisson_draw_is_cut_into_the_accumulation_micro_batches(tmp_path):
    n, b, k, draws = 40, 2, 3, 300
    args = training_args(
        str(tmp_path / "out"), per_device_train_batch_size=b, gradient_accumulation_steps=k
    )
    trainer = _dp_trainer(tmp_path, n=n, args=args)
    loader = trainer.get_train_dataloader()
    q = b * k / n
    assert len(loader) == round(1 / q) * k
    sizes = []
    iterator = iter(loader)
    while len(sizes) < draws:
        try:
            parts = [next(iterator)["labels"].shape[0] for _ in range(k)]
        except StopIteration:
            iterator = iter(loader)
            continue
        assert max(parts) - min(parts) <= 1  # one draw cut evenly
        sizes.append(sum(parts))
    sizes_arr = np.asarray(sizes, dtype=float)
    # the logical batch is Binomial(n, q): mean q·n, variance n·q·(1 − q)
    se = math.sqrt(n * q * (1 - q) / draws)
    assert abs(sizes_arr.mean() - q * n) < 4 * se
    assert sizes_arr.var(ddof=1) == pytest.approx(n * q * (1 - q), rel=4 * math.sqrt(2 / draws))
    assert len(set(sizes)) > 3  # the batch size varies


# ------------------------------------------------------------------ the step itself
def test_no_noise_and_an_unreachable_bound_is_the_plain_trainer_on_the_same_batches(tmp_path):
    n, b, k = 8, 2, 4  # q = b·k / n = 1: every draw is the whole data set, cut in k
    model = tiny_bert(dropout=0.0)
    plain_model = copy.deepcopy(model)
    data = classification_data(n)
    args = training_args(
        str(tmp_path / "dp"), per_device_train_batch_size=b, gradient_accumulation_steps=k
    )
    privacy = {"noise_multiplier": 0.0, "l2_norm_bound": 1e6}
    # the same seed draws the same batches: take them from a trainer of a copy of the model
    loader = _dp_trainer(
        tmp_path, model=copy.deepcopy(model), data=data, args=args, **privacy
    ).get_train_dataloader()
    batches = []
    for _ in range(2):  # an epoch is one step here: its k micro-batches joined
        parts = list(loader)
        assert len(parts) == k
        batches.append({key: torch.cat([p[key] for p in parts]) for key in parts[0]})
    dp = _dp_trainer(tmp_path, model=model, data=data, args=args, **privacy)
    dp.train()

    class Replay(Trainer):
        def get_train_dataloader(self):
            return batches

    plain_args = training_args(
        str(tmp_path / "plain"), per_device_train_batch_size=b * k, max_grad_norm=0.0
    )
    Replay(model=plain_model, args=plain_args, train_dataset=data).train()
    assert dp.ledger.num_steps == 2
    # float32 sums in another order: a few units in the last place of each gradient
    for p, r in zip(model.parameters(), plain_model.parameters(), strict=True):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


def test_per_example_token_loss_is_each_examples_own_mean():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 7, (3, 5), generator=g)
    labels[1, 2:] = -100
    for shift in (False, True):
        got = per_example_token_loss(logits, labels, shift=shift)
        for i in range(3):
            lg, lb = (logits[i, :-1], labels[i, 1:]) if shift else (logits[i], labels[i])
            terms = [
                -torch.log_softmax(lg[t], dim=-1)[lb[t]] for t in range(len(lb)) if lb[t] != -100
            ]
            assert got[i].item() == pytest.approx(torch.stack(terms).mean().item(), rel=1e-12)
    # another example's number of tokens does not move example 0's loss
    fewer = labels.clone()
    fewer[2, 1:] = -100
    a = per_example_token_loss(logits, labels, shift=True)[0]
    assert per_example_token_loss(logits, fewer, shift=True)[0] == a


def test_a_causal_language_model_trains_with_the_per_example_token_loss(tmp_path):
    args = training_args(str(tmp_path / "out"), max_steps=1)
    trainer = _dp_trainer(tmp_path, model=tiny_gpt2(), data=lm_data(16), args=args)
    trainer.train()
    assert trainer.ledger.num_steps == trainer.state.global_step == 1


# ------------------------------------------------------------------ resuming
@pytest.mark.slow
def test_resume_continues_the_ledger_and_counts_nothing_twice(tmp_path):
    path = tmp_path / "run.dpl"
    out = str(tmp_path / "out")
    save = {"save_strategy": "steps", "save_steps": 1}
    first = _dp_trainer(tmp_path, args=training_args(out, max_steps=2, **save), ledger=path)
    first.train()
    first.ledger.close()
    kept = tmp_path / "checkpoint-1"
    shutil.copytree(Path(out) / "checkpoint-1", kept)
    # resumed from the last checkpoint: the ledger goes on from its 2 steps
    second = _dp_trainer(tmp_path, args=training_args(out, max_steps=3, **save), ledger=path)
    second.train(resume_from_checkpoint=str(Path(out) / "checkpoint-2"))
    assert second.state.global_step == 3
    assert second.ledger.num_steps == 3
    second.ledger.close()
    # resumed from an older checkpoint: the 2 steps taken after it stay spent
    third = _dp_trainer(tmp_path, args=training_args(out, max_steps=3, **save), ledger=path)
    third.train(resume_from_checkpoint=str(kept))
    assert third.state.global_step == 3
    assert third.ledger.num_steps == 3 + 2
    third.ledger.close()
    assert PrivacyLedger(path, resume=True).num_steps == 5


def test_a_new_run_does_not_overwrite_an_existing_ledger(tmp_path):
    path = tmp_path / "run.dpl"
    PrivacyLedger(path).close()
    trainer = _dp_trainer(tmp_path, ledger=path)
    with pytest.raises(FileExistsError):
        trainer.train()


# ------------------------------------------------------------------ refusals before training
class _CustomSampler(DPTrainer):
    def _get_train_sampler(self, train_dataset=None):
        return torch.utils.data.SequentialSampler(self.train_dataset)


class _CustomLoss(DPTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return model(**inputs).loss.sum()


class _Stream(IterableDataset):
    def __iter__(self):
        yield from classification_data(8)


class _Scorer(torch.nn.Module):
    """A head no mapping of transformers names: its loss is unknown to DPTrainer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(40, 4)
        self.out = torch.nn.Linear(4, 2)

    def forward(self, input_ids, attention_mask=None, labels=None):
        return SequenceClassifierOutput(logits=self.out(self.embed(input_ids).mean(dim=1)))


def _args_with(tmp: Path, **fields):
    args = training_args(str(tmp / "out"))
    for name, value in fields.items():  # set after construction: no DeepSpeed or GPU needed
        setattr(args, name, value)
    return args


@pytest.mark.parametrize(
    ("make", "parameter"),
    [
        (
            lambda t: _dp_trainer(
                t, args=training_args(str(t / "o"), train_sampling_strategy="group_by_length")
            ),
            "args.train_sampling_strategy",
        ),
        (
            lambda t: _CustomSampler(
                model=tiny_bert(),
                args=training_args(str(t / "o")),
                train_dataset=classification_data(8),
                l2_norm_bound=1.0,
                noise_multiplier=1.0,
            ),
            "_get_train_sampler",
        ),
        (
            lambda t: _CustomLoss(
                model=tiny_bert(),
                args=training_args(str(t / "o")),
                train_dataset=classification_data(8),
                l2_norm_bound=1.0,
                noise_multiplier=1.0,
            ),
            "compute_loss",
        ),
        (
            lambda t: _dp_trainer(t, compute_loss_func=lambda outputs, labels, **kw: 0),
            "compute_loss_func",
        ),
        (lambda t: _dp_trainer(t, args=_args_with(t, deepspeed={"zero": 2})), "args.deepspeed"),
        (lambda t: _dp_trainer(t, args=_args_with(t, fp16=True)), "args.fp16"),
        (lambda t: _dp_trainer(t, data=_Stream()), "train_dataset"),
        (lambda t: _dp_trainer(t, target_epsilon=3.0), "noise_multiplier"),
        (
            lambda t: _dp_trainer(t, noise_multiplier=None, target_epsilon=3.0, delta=None),
            "delta",
        ),
    ],
    ids=[
        "group_by_length",
        "custom_sampler",
        "custom_compute_loss",
        "compute_loss_func",
        "deepspeed",
        "fp16",
        "iterable_dataset",
        "noise_and_target",
        "target_without_delta",
    ],
)
def test_settings_that_would_make_the_ledger_untrue_are_refused(tmp_path, make, parameter):
    with pytest.raises(InvalidParameterError) as info:
        make(tmp_path)
    assert info.value.parameter == parameter


def test_a_head_whose_loss_is_unknown_needs_a_per_example_loss(tmp_path):
    with pytest.raises(PerExampleLossError, match="per_example_loss"):
        _dp_trainer(tmp_path, model=_Scorer())


def test_a_per_example_loss_of_the_wrong_shape_is_refused_before_anything_is_recorded(tmp_path):
    trainer = _dp_trainer(
        tmp_path,
        model=_Scorer(),
        per_example_loss=lambda outputs, labels: outputs.logits.sum(),
    )
    with pytest.raises(PerExampleLossError, match="one loss per example"):
        trainer.train()
    assert trainer.ledger is None or trainer.ledger.num_steps == 0


def test_a_batch_larger_than_the_data_set_is_refused(tmp_path):
    args = training_args(str(tmp_path / "out"), per_device_train_batch_size=8)
    trainer = _dp_trainer(tmp_path, n=4, args=args)
    with pytest.raises(InvalidParameterError) as info:
        trainer.train()
    assert info.value.parameter == "args.per_device_train_batch_size"


# ------------------------------------------------------------------ accelerate launch, 2 ranks
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_two_ranks_under_accelerate_launch_record_one_ledger(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    launcher = Path(sys.executable).with_name("accelerate")
    command = [
        str(launcher),
        "launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(_free_port()),
        str(ROOT / "tests" / "integrations" / "ddp_trainer_worker.py"),
        str(tmp_path),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert {r["backend"] for r in ranks} == {"gloo"}
    zero, one = ranks
    # q = B·W·k / n = 2·2·2 / 32, one event per optimizer step, recorded on rank 0 only
    assert zero["ledger_steps"] == zero["global_step"] == one["global_step"] == 2
    assert zero["events"] == [[0.25, 32], [0.25, 32]]
    assert one["ledger_steps"] is None
    assert zero["parameters"] == one["parameters"]  # every rank took the same step
    assert zero["epsilon"][-1] == pytest.approx(_rdp_epsilon(0.25, 1.0, 2, DELTA), rel=1e-6)


def test_an_empty_poisson_draw_is_a_recorded_step(tmp_path):
    n, steps = 64, 6  # q = 1/64: a draw is empty with probability (63/64)^64 ≈ 0.37
    args = training_args(str(tmp_path / "out"), per_device_train_batch_size=1, max_steps=steps)
    twin = _dp_trainer(tmp_path, n=n, args=args, model=tiny_bert()).get_train_dataloader()
    sizes = [batch["labels"].shape[0] for batch, _ in zip(twin, range(steps), strict=False)]
    assert 0 in sizes and any(sizes)  # the same seed draws these batches in the run below
    trainer = _dp_trainer(tmp_path, n=n, args=args)
    trainer.train()
    assert trainer.ledger.num_steps == trainer.state.global_step == steps
    assert all(s.sampling_probability == 1 / n for s in trainer.ledger.steps())
