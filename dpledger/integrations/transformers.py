"""DP fine-tuning inside the Hugging Face ``Trainer``, with the ledger beside the checkpoints.

:class:`DPTrainer` is a ``transformers.Trainer`` that trains with DP-SGD (Abadi et al. 2016;
McMahan & Andrew 2018) through the PyTorch adapter's public API:

* **Sampling.** The train loader is replaced by a recorded
  :class:`~dpledger.adapters.torch.PoissonBatchSampler` (a
  :class:`~dpledger.adapters.torch.DistributedPoissonBatchSampler` under ``torch.distributed``)
  of rate q = B·W·k / n, the expected logical batch of B = ``per_device_train_batch_size``
  records on each of W ranks for each of k = ``gradient_accumulation_steps`` micro-batches
  (logged at the start). An epoch is round(1/q) logical steps.
* **Gradient accumulation** is a virtual batch: each Poisson draw is cut into k micro-batches
  (empty ones are skipped); every micro-batch's clipped per-example sum is accumulated with
  :meth:`~dpledger.adapters.torch.DPOptimizer.virtual_step`, and the Trainer's one optimizer step
  releases the logical step: one sampling event (q, n) and one noise draw per optimizer step,
  so the ledger's steps equal ``trainer.state.global_step``. A draw with no record on a rank is
  stepped with :meth:`~dpledger.adapters.torch.DPOptimizer.empty_step` (pure noise, recorded).
* **Optimizer and scheduler.** The optimizer the Trainer builds (or is given) is wrapped in a
  :class:`~dpledger.adapters.torch.DPOptimizer`; the scheduler is built on the wrapper and drives
  the wrapped optimizer's learning rate.
* **Loss.** The loss must be a per-example mean for the clipping to be per record: the
  Trainer's token-level losses (a sum over the batch's tokens divided by the batch's token
  count, ``num_items_in_batch``) let one record change another's weight, so DPTrainer computes
  each example's mean token loss itself for causal and masked language models and token
  classification, and averages over examples; sequence classification uses the model's loss
  (a mean over examples). Any other head needs ``per_example_loss=``.
* **ε** at ``delta`` (the ``epsilon_accountant``'s number, RDP by default, a valid upper bound)
  is added to every log of the Trainer as ``epsilon``, so it reaches ``log_history`` and every
  ``report_to`` integration. The non-private gradient norm (``grad_norm``) is not logged.
* **Checkpoints.** Each checkpoint folder gets ``dpledger.json`` (the ledger's path, head hash,
  steps and events); the optimizer's state carries the ledger position. With
  ``resume_from_checkpoint`` the ledger file is continued (``PrivacyLedger(path, resume=True)``):
  steps recorded after the checkpoint stay spent, nothing is recorded twice
  (:meth:`~dpledger.adapters.torch.DPOptimizer.load_state_dict`). The sampler's and the noise
  generator's states come back with the optimizer's; no batch is skipped or replayed
  (``args.ignore_data_skip`` is set: Poisson draws are independent of the epoch).

Refused before training, with :class:`~dpledger.errors.InvalidParameterError` (settings that
would make the ledger untrue): ``train_sampling_strategy`` other than ``"random"`` (e.g.
``"group_by_length"``), a subclass that overrides the train loader or sampler, a data set without
``__len__``, ``compute_loss_func`` or an overridden ``compute_loss`` (a loss DPTrainer cannot see
is a per-example mean), DeepSpeed, FSDP, ``fp16`` (the gradient scaler scales each record's
gradient before clipping) and ``DataParallel`` over several GPUs in one process.

Layer: an integration (docs/architecture.md, "Layers"): core, diagnostics and the PyTorch
adapter's public API, torch, transformers and accelerate.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import Trainer, TrainerCallback

from dpledger.accountants import Accountant, calibrate_noise_multiplier, make_accountant
from dpledger.adapters.torch import (
    DistributedPoissonBatchSampler,
    DPOptimizer,
    PoissonBatchSampler,
    private_data_loader,
)
from dpledger.errors import InvalidParameterError, PerExampleLossError
from dpledger.integrations.hf_batches import MicroBatchLoader, num_records
from dpledger.integrations.hf_loss import PerExampleLoss, loss_kind, per_example_token_loss
from dpledger.ledger import PrivacyLedger

__all__ = ["LEDGER_INFO_NAME", "DPTrainer", "per_example_token_loss"]

logger = logging.getLogger(__name__)

LEDGER_INFO_NAME = "dpledger.json"
"""The file each checkpoint folder gets: the ledger's path, head hash, steps and events."""


class _TrainerDPOptimizer(DPOptimizer):
    """A DPOptimizer whose ``step()`` records an empty step when the Trainer's micro-batches of
    the logical batch held no record on this rank (every micro-batch is skipped then)."""

    records_in_step = 0

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        records, self.records_in_step = self.records_in_step, 0
        if records == 0 and closure is None:
            self.empty_step()
            return None
        return super().step(closure)


class _LedgerCheckpointCallback(TrainerCallback):
    """Writes the ledger's position into each checkpoint folder (rank 0)."""

    def __init__(self, trainer: DPTrainer) -> None:
        self.trainer = trainer

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        ledger = self.trainer.ledger
        if ledger is None or not state.is_world_process_zero:
            return
        ledger.flush()
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        folder.mkdir(parents=True, exist_ok=True)
        info = {
            "ledger_path": None if ledger.path is None else os.fspath(ledger.path),
            "head_hash": ledger.head_hash,
            "num_steps": ledger.num_steps,
            "num_events": ledger.num_events,
            "global_step": state.global_step,
        }
        (folder / LEDGER_INFO_NAME).write_text(json.dumps(info, indent=2), encoding="utf-8")


class DPTrainer(Trainer):
    """A ``transformers.Trainer`` that trains with DP and records every step in a ledger.

    See the module docstring for what changes in the Trainer. Example::

        trainer = DPTrainer(
            model=model, args=TrainingArguments("out", per_device_train_batch_size=16,
                                                gradient_accumulation_steps=4, max_steps=100),
            train_dataset=train_set, l2_norm_bound=1.0, target_epsilon=8.0, delta=1e-5,
            ledger="run.dpl")
        trainer.train()
        trainer.log_history[-1]["epsilon"]

    Args:
        *args: the ``Trainer``'s positional arguments (``model``, ``args``, …).
        l2_norm_bound: C > 0, each record's gradient bound.
        noise_multiplier: z ≥ 0; or give ``target_epsilon`` and ``delta``.
        target_epsilon: ε to meet at ``delta`` after the planned steps (``args.max_steps``, or
            ``ceil(num_train_epochs · round(1/q))``): z is calibrated by ``accountant``
            (:func:`~dpledger.accountants.calibrate_noise_multiplier`).
        delta: δ of the target, and of the ε added to the logs (no ``epsilon`` is logged
            without it).
        ledger: a path (a new ledger file, continued when training resumes from a checkpoint),
            a :class:`~dpledger.ledger.PrivacyLedger`, or None (in memory). Under
            ``torch.distributed`` only rank 0 opens or takes it.
        accountant: the accountant of the calibration (default ``"prv"``).
        epsilon_accountant: the accountant of the logged ε, by name (default ``"rdp"``) or an
            :class:`~dpledger.accountants.Accountant`.
        seed: seeds the sampling and the noise (two independent streams); None draws both
            from OS entropy (a caller-given seed means the noise is not secret).
        per_example_loss: ``per_example_loss(outputs, labels)`` → the ``(B,)`` losses of a
            head DPTrainer does not know; the loss stepped is their mean.
        dp_options: further keyword arguments of
            :class:`~dpledger.adapters.torch.DPOptimizer` (``clipping``, ``groups``,
            ``strategy``, ``check_record_independence``, …).
        **kwargs: the ``Trainer``'s keyword arguments.

    Raises:
        InvalidParameterError: a bad privacy argument, or a Trainer setting that would make the
            ledger untrue (module docstring), before training.
        PerExampleLossError: a model head whose loss is not known to be a per-example mean,
            without ``per_example_loss``.
    """

    def __init__(
        self,
        *args: Any,
        l2_norm_bound: float,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        delta: float | None = None,
        ledger: str | os.PathLike[str] | PrivacyLedger | None = None,
        accountant: str = "prv",
        epsilon_accountant: str | Accountant = "rdp",
        seed: int | None = None,
        per_example_loss: PerExampleLoss | None = None,
        dp_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if (noise_multiplier is None) == (target_epsilon is None):
            raise InvalidParameterError(
                "noise_multiplier",
                noise_multiplier,
                "exactly one of noise_multiplier= and target_epsilon= (with delta=)",
            )
        if target_epsilon is not None and delta is None:
            raise InvalidParameterError("delta", delta, "δ in (0, 1) with target_epsilon=")
        if ledger is not None and not isinstance(ledger, (str, os.PathLike, PrivacyLedger)):
            raise InvalidParameterError("ledger", ledger, "a path, a PrivacyLedger or None")
        if not isinstance(epsilon_accountant, Accountant):  # an unknown name fails here
            epsilon_accountant = make_accountant(epsilon_accountant)
        super().__init__(*args, **kwargs)
        self._dp = {
            "l2_norm_bound": l2_norm_bound,
            "noise_multiplier": noise_multiplier,
            "target_epsilon": target_epsilon,
            "delta": delta,
            "accountant": accountant,
            "seed": seed,
            "options": dict(dp_options or {}),
        }
        self._ledger_arg = ledger
        self._epsilon_accountant = epsilon_accountant
        self._per_example_loss = per_example_loss
        self._loss_kind = "custom" if per_example_loss is not None else loss_kind(self.model)
        self._resuming = False
        self._dp_optimizer: _TrainerDPOptimizer | None = None
        self._train_loader: MicroBatchLoader | None = None
        self.ledger: PrivacyLedger | None = None
        self._refuse_untrue_settings()
        self.add_callback(_LedgerCheckpointCallback(self))

    # ------------------------------------------------------------------ refusals
    def _refuse_untrue_settings(self) -> None:
        """Refuse, before training, every setting that would make the ledger untrue."""
        args = self.args
        if self.train_dataset is not None and not hasattr(self.train_dataset, "__len__"):
            raise InvalidParameterError(
                "train_dataset",
                type(self.train_dataset).__name__,
                "a map-style data set with __len__ (Poisson sampling draws from all n records)",
            )
        strategy = getattr(args, "train_sampling_strategy", "random")
        if strategy != "random" or getattr(args, "group_by_length", False):
            raise InvalidParameterError(
                "args.train_sampling_strategy",
                "group_by_length" if getattr(args, "group_by_length", False) else strategy,
                "'random': DPTrainer draws every batch by Poisson sampling, which the ledger "
                "records; batches grouped by length are no scheme the accountants analyse",
            )
        for name in ("get_train_dataloader", "_get_train_sampler"):
            if getattr(type(self), name) is not getattr(DPTrainer, name):
                raise InvalidParameterError(
                    name,
                    f"{type(self).__name__}.{name}",
                    "not overridden: DPTrainer's recorded Poisson sampler must draw the batches "
                    "(a custom sampler's draws are not what the ledger records)",
                )
        if self.compute_loss_func is not None:
            raise InvalidParameterError(
                "compute_loss_func",
                self.compute_loss_func,
                "None: give per_example_loss=(outputs, labels) -> (B,) losses instead; a loss "
                "that is not a per-example mean makes records depend on each other",
            )
        if type(self).compute_loss is not DPTrainer.compute_loss:
            raise InvalidParameterError(
                "compute_loss",
                f"{type(self).__name__}.compute_loss",
                "not overridden: give per_example_loss=(outputs, labels) -> (B,) losses",
            )
        self._refuse_untrue_engines(args)
        if self._loss_kind is None:
            raise PerExampleLossError(
                f"DPTrainer does not know whether the loss of {type(self.model).__name__} is a "
                "per-example mean (it knows sequence classification, causal and masked language "
                "models and token classification): give per_example_loss=(outputs, labels) -> "
                "one loss per example, shape (B,)"
            )

    def _refuse_untrue_engines(self, args: Any) -> None:
        refused = {
            "args.deepspeed": self.is_deepspeed_enabled or bool(args.deepspeed),
            "args.fsdp": self.is_fsdp_enabled or bool(args.fsdp),
            "args.fp16": bool(args.fp16),
        }
        for name, on in refused.items():
            if on:
                raise InvalidParameterError(
                    name,
                    getattr(args, name.split(".")[1], True),
                    "off: DPTrainer supports one process or DDP without a gradient scaler "
                    "(DeepSpeed ZeRO and FSDP shard the gradients the per-example engine needs; "
                    "fp16's scaler scales every record's gradient before clipping)",
                )
        if args.n_gpu > 1:
            raise InvalidParameterError(
                "args.n_gpu",
                args.n_gpu,
                "1 per process: use DDP (accelerate launch / torchrun), not DataParallel",
            )

    # ------------------------------------------------------------------ setup
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kw: Any) -> Any:
        """``Trainer.train``; with ``resume_from_checkpoint`` the ledger file is continued."""
        self._resuming = resume_from_checkpoint not in (None, False)
        if self._resuming and not self.args.ignore_data_skip:
            # every Poisson draw is fresh: there are no batches of the checkpoint's epoch to
            # skip (the sampler's state comes back with the optimizer's)
            logger.info("resuming: args.ignore_data_skip set to True (Poisson draws are fresh)")
            self.args.ignore_data_skip = True
        return super().train(resume_from_checkpoint, *args, **kw)

    def _setup_dp(self) -> None:
        """Build the Poisson loader, the ledger and the DPOptimizer once (at the first of
        ``get_train_dataloader`` and ``create_optimizer``)."""
        if self._dp_optimizer is not None:
            return
        if self.train_dataset is None:
            raise InvalidParameterError("train_dataset", None, "a data set to train on")
        args = self.args
        dataset = self.train_dataset
        if type(dataset).__module__.startswith("datasets"):
            dataset = self._remove_unused_columns(dataset, description="training")
        n = len(dataset)
        world, parts = args.world_size, args.gradient_accumulation_steps
        expected = args.per_device_train_batch_size * world * parts
        q = expected / n
        if not 0 < q <= 1:
            raise InvalidParameterError(
                "args.per_device_train_batch_size",
                args.per_device_train_batch_size,
                f"B with B·W·k = B·{world}·{parts} ≤ n = {n} (q = B·W·k / n ≤ 1)",
            )
        sampling_seed, noise_seed = self._seeds()
        if world > 1:
            sampler: Any = DistributedPoissonBatchSampler(
                population_size=n, sampling_probability=q, seed=sampling_seed
            )
        else:
            sampler = PoissonBatchSampler(
                population_size=n, sampling_probability=q, seed=sampling_seed
            )
        loader = private_data_loader(
            dataset,
            sampler=sampler,
            collate_fn=self.data_collator,
            num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory,
        )
        steps_per_epoch = len(sampler)
        z = self._noise_multiplier(q, steps_per_epoch)
        logger.info(
            "DP training: Poisson sampling with q = B·W·k / n = %d·%d·%d / %d = %r (expected "
            "logical batch %d records, %d steps per epoch), C = %r, z = %r",
            args.per_device_train_batch_size,
            world,
            parts,
            n,
            q,
            expected,
            steps_per_epoch,
            self._dp["l2_norm_bound"],
            z,
        )
        self.ledger = self._open_ledger(world)
        optimizer = self.optimizer if self.optimizer is not None else super().create_optimizer()
        self._dp_optimizer = _TrainerDPOptimizer(
            optimizer,
            model=self.model,
            l2_norm_bound=self._dp["l2_norm_bound"],
            noise_multiplier=z,
            ledger=self.ledger,
            sampler=loader,
            seed=noise_seed,
            loss_reduction="mean",
            **self._dp["options"],
        )
        self.optimizer = self._dp_optimizer
        self.ledger = self._dp_optimizer.ledger  # the one given, or the optimizer's in-memory one
        self._train_loader = MicroBatchLoader(loader, parts)

    def _seeds(self) -> tuple[int | None, int | None]:
        seed = self._dp["seed"]
        if seed is None:
            return None, None
        sampling, noise = np.random.SeedSequence(seed).generate_state(2, dtype=np.uint32)
        return int(sampling), int(noise)

    def _noise_multiplier(self, q: float, steps_per_epoch: int) -> float:
        if self._dp["noise_multiplier"] is not None:
            return float(self._dp["noise_multiplier"])
        args = self.args
        steps = (
            args.max_steps
            if args.max_steps > 0
            else math.ceil(args.num_train_epochs * steps_per_epoch)
        )
        result = calibrate_noise_multiplier(
            target_epsilon=self._dp["target_epsilon"],
            delta=self._dp["delta"],
            sampling_probability=q,
            steps=steps,
            accountant=self._dp["accountant"],
        )
        logger.info(
            "noise multiplier %r calibrated by the %s accountant for ε = %g at δ = %g over %d "
            "steps",
            result.value,
            result.accountant,
            result.target_epsilon,
            result.delta,
            steps,
        )
        return float(result.value)

    def _open_ledger(self, world: int) -> PrivacyLedger | None:
        if world > 1 and not self.is_world_process_zero():
            return None
        given = self._ledger_arg
        if given is None or isinstance(given, PrivacyLedger):
            return given
        return PrivacyLedger(given, resume=self._resuming)

    def get_train_dataloader(self) -> Any:
        """The recorded Poisson loader, each draw cut into the accumulation's micro-batches."""
        self._setup_dp()
        return self._train_loader

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        """Not used: the recorded Poisson batch sampler draws the batches."""
        return None

    def create_optimizer(self, model: Any = None) -> Any:
        """The Trainer's optimizer (built as usual, or the one given), wrapped in a
        :class:`~dpledger.adapters.torch.DPOptimizer`."""
        self._setup_dp()
        return self.optimizer

    # ------------------------------------------------------------------ the step
    def compute_loss(
        self,
        model: Any,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        """The mean over the batch's examples of each example's own loss (module docstring);
        ``num_items_in_batch`` is ignored (normalising by the batch's token count mixes
        records)."""
        labels = inputs.get("labels")
        if labels is None:
            raise PerExampleLossError("DPTrainer needs labels= in every batch to form the loss")
        kind = self._loss_kind
        if kind == "sequence":
            outputs = model(**inputs)
            loss = outputs.loss
        else:
            outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
            if kind == "custom":
                assert self._per_example_loss is not None
                losses = self._per_example_loss(outputs, labels)
            else:
                losses = per_example_token_loss(outputs.logits, labels, shift=kind == "causal")
            if losses.shape != (labels.shape[0],):
                raise PerExampleLossError(
                    f"per_example_loss returned shape {tuple(losses.shape)}; expected "
                    f"({labels.shape[0]},), one loss per example"
                )
            loss = losses.mean()
        return (loss, outputs) if return_outputs else loss

    def training_step(
        self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """One micro-batch: forward, backward, and its clipped sum accumulated into the
        logical step (the Trainer's optimizer step releases it). Returns the micro-batch's
        mean loss divided by the accumulation steps, for the Trainer's logged loss."""
        assert self._dp_optimizer is not None
        model.train()
        inputs = self._prepare_inputs(inputs)
        records = num_records(inputs)
        if records == 0:  # an empty micro-batch of a Poisson draw: nothing to clip or add
            return torch.zeros((), device=self.args.device)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        if self.args.world_size > 1:
            loss.backward()  # DDP's reducer expects every parameter's gradient
        else:  # only the gradients with respect to the layers' outputs (the engine's fast path)
            self._dp_optimizer.backward(loss)
        self._dp_optimizer.virtual_step()
        self._dp_optimizer.records_in_step += records
        # the per-example sums are taken: drop autograd's batch gradient, so that nothing
        # (the Trainer's grad_norm, a callback) sees the non-private gradient
        self.model.zero_grad(set_to_none=True)
        return loss.detach() / self.current_gradient_accumulation_steps

    # ------------------------------------------------------------------ logs
    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """``Trainer.log`` with ``epsilon`` (at ``delta``) added and the non-private
        ``grad_norm`` removed."""
        logs.pop("grad_norm", None)
        delta = self._dp["delta"]
        if self.ledger is not None and delta is not None and self.ledger.num_steps > 0:
            logs["epsilon"] = float(
                self._epsilon_accountant.epsilon(self.ledger, delta=delta).epsilon
            )
        super().log(logs, *args, **kwargs)
