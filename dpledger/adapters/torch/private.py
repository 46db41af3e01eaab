"""One call from a model, an optimizer and a data set to a DP training setup.

:func:`make_private` returns the model (with the per-example gradient engine attached), the
:class:`~dpledger.adapters.torch.optimizer.DPOptimizer` wrapping the given optimizer, and a
Poisson data loader whose q and n are the ones the optimizer records — so an existing loop over
``data_loader`` with ``loss.backward(); optimizer.step()`` trains with DP and leaves a ledger.

The noise multiplier is given, or chosen for a target (ε, δ) by
:func:`calibrated_noise_multiplier`, which asks
:func:`~dpledger.accountants.calibrate_noise_multiplier` for the smallest z whose ε after the
planned number of steps is at most the target. An *epoch* is round(1/q) steps (n records in
expectation), the Poisson data loader's default length.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from dpledger.accountants import Accountant, calibrate_noise_multiplier
from dpledger.adapters.torch.distributed import DistributedPoissonBatchSampler, distributed_world
from dpledger.adapters.torch.optimizer import DPOptimizer
from dpledger.adapters.torch.poisson import EmptyBatchCollate, _check_q, poisson_data_loader
from dpledger.adapters.torch.virtual_batches import virtual_batches
from dpledger.errors import InvalidParameterError
from dpledger.ledger import PrivacyLedger
from dpledger.validation import check_delta, check_positive_finite, check_positive_int

__all__ = ["PrivateTraining", "calibrated_noise_multiplier", "make_private", "steps_per_epoch"]


def steps_per_epoch(sampling_probability: float) -> int:
    """round(1/q) (at least 1): the steps in which Poisson sampling sees n records on average."""
    return max(1, round(1.0 / _check_q(sampling_probability)))


def _planned_steps(sampling_probability: float, steps: int | None, epochs: float | None) -> int:
    if (steps is None) == (epochs is None):
        raise InvalidParameterError(
            "steps", steps, "exactly one of steps= and epochs= (the length of the run)"
        )
    if steps is not None:
        return check_positive_int("steps", steps)
    e = check_positive_finite("epochs", epochs)
    return max(1, round(e * steps_per_epoch(sampling_probability)))


def calibrated_noise_multiplier(
    *,
    target_epsilon: float,
    delta: float,
    sampling_probability: float,
    steps: int | None = None,
    epochs: float | None = None,
    accountant: str | Accountant = "rdp",
) -> float:
    """The smallest noise multiplier z (to 0.1%) whose ε at δ after the run is ≤ the target.

    Args:
        target_epsilon: ε to meet.
        delta: δ in (0, 1).
        sampling_probability: q of every step.
        steps: T, the number of steps; or
        epochs: the number of epochs (T = epochs·round(1/q)).
        accountant: the accountant that decides (default ``"rdp"``: a valid upper bound).

    Raises:
        InvalidParameterError: bad arguments, or a target no z ≤ 10⁴ reaches.
    """
    q = _check_q(sampling_probability)
    t = _planned_steps(q, steps, epochs)
    return float(
        calibrate_noise_multiplier(
            target_epsilon=target_epsilon,
            delta=delta,
            sampling_probability=q,
            steps=t,
            accountant=accountant,
        ).value
    )


class PrivateTraining(NamedTuple):
    """What :func:`make_private` returns."""

    model: nn.Module
    optimizer: DPOptimizer
    data_loader: Iterable[Any]


def _seeds(seed: int | None) -> tuple[int | None, int | None]:
    if seed is None:
        return None, None
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InvalidParameterError("seed", seed, "an integer or None")
    sampling, noise = np.random.SeedSequence(seed).spawn(2)
    return int(sampling.generate_state(1, np.uint64)[0] >> 1), int(
        noise.generate_state(1, np.uint64)[0] >> 1
    )


def make_private(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Dataset | DataLoader,
    *,
    sampling_probability: float,
    max_grad_norm: float,
    noise_multiplier: float | None = None,
    target_epsilon: float | None = None,
    delta: float | None = None,
    epochs: float | None = None,
    steps: int | None = None,
    ledger: PrivacyLedger | None = None,
    accountant: str | Accountant = "rdp",
    seed: int | None = None,
    max_physical_batch_size: int | None = None,
    loss_reduction: str = "mean",
    **options: Any,
) -> PrivateTraining:
    """Wrap a model, its optimizer and its data for DP training in one call.

    Example::

        model, optimizer, loader = make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.5), train_set,
            sampling_probability=0.02, max_grad_norm=1.0,
            target_epsilon=8.0, delta=1e-5, epochs=10, ledger=PrivacyLedger("run.dpl"))
        for epoch in range(10):
            for x, y in loader:
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()

    Args:
        model: the model (the per-example gradient engine attaches to it).
        optimizer: any ``torch.optim.Optimizer`` over the model's parameters.
        data: a map-style data set, or a DataLoader whose data set, collate function and worker
            settings are reused (its batch size and shuffling are replaced by Poisson sampling).
        sampling_probability: q in (0, 1]: every step includes each record with probability q.
        max_grad_norm: C > 0.
        noise_multiplier: z ≥ 0; or give ``target_epsilon``, ``delta`` and ``epochs`` (or
            ``steps``) to calibrate it (:func:`calibrated_noise_multiplier`).
        target_epsilon: ε to meet at ``delta`` after the planned run.
        delta: δ of the target.
        epochs: planned epochs (round(1/q) steps each), for the calibration.
        steps: planned steps, instead of ``epochs``.
        ledger: the ledger to record into (None: in memory, ``optimizer.ledger``). Under
            ``torch.distributed`` pass it on rank 0 only.
        accountant: the accountant of the calibration.
        seed: seeds the sampling and the noise (two independent streams); None draws both
            from OS entropy (the sampling seed is then shared by rank 0 in distributed runs).
        max_physical_batch_size: split each logical batch into chunks of at most this many
            records (virtual batches; the loop stays the same).
        loss_reduction: ``"mean"`` or ``"sum"``, how the loop's loss combines examples.
        **options: further keyword arguments of :class:`DPOptimizer` (``clipping``,
            ``groups``, ``scales``, ``strategy``, ``loss_fn``, ``bam_radius``,
            ``bias_callback``, …).

    Returns:
        ``PrivateTraining(model, optimizer, data_loader)``.
    """
    q = _check_q(sampling_probability)
    if max_physical_batch_size is not None:
        check_positive_int("max_physical_batch_size", max_physical_batch_size)
    if (noise_multiplier is None) == (target_epsilon is None):
        raise InvalidParameterError(
            "noise_multiplier",
            noise_multiplier,
            "exactly one of noise_multiplier= and target_epsilon= (with delta= and epochs=)",
        )
    if target_epsilon is not None:
        if delta is None:
            raise InvalidParameterError("delta", delta, "δ in (0, 1) with target_epsilon=")
        check_delta("delta", delta)
        noise_multiplier = calibrated_noise_multiplier(
            target_epsilon=target_epsilon,
            delta=delta,
            sampling_probability=q,
            steps=steps,
            epochs=epochs,
            accountant=accountant,
        )
    for key in ("sampler", "sampling_probability", "population_size", "seed", "generator"):
        if key in options:
            raise InvalidParameterError(key, options[key], "not given: make_private sets it")
    if isinstance(data, DataLoader):
        dataset = data.dataset
        collate = data.collate_fn
        if isinstance(collate, EmptyBatchCollate):
            collate = collate._collate_fn
        loader_kwargs = {
            "num_workers": data.num_workers,
            "pin_memory": data.pin_memory,
            "collate_fn": collate,
        }
    elif isinstance(data, Dataset):
        dataset, loader_kwargs = data, {}
    else:
        raise InvalidParameterError("data", type(data).__name__, "a Dataset or a DataLoader")
    sampling_seed, noise_seed = _seeds(seed)
    _, world = distributed_world(options.get("process_group"))
    distributed = options.get("distributed")
    if distributed is None:
        distributed = world > 1
    if distributed:
        n = len(dataset)  # type: ignore[arg-type]
        batch_sampler = DistributedPoissonBatchSampler(
            population_size=n,
            sampling_probability=q,
            seed=sampling_seed,
            process_group=options.get("process_group"),
        )
        collate = EmptyBatchCollate(
            loader_kwargs.pop("collate_fn", None) or torch.utils.data.default_collate,
            dataset[0],
        )
        loader: DataLoader = DataLoader(
            dataset, batch_sampler=batch_sampler, collate_fn=collate, **loader_kwargs
        )
    else:
        loader = poisson_data_loader(
            dataset, sampling_probability=q, seed=sampling_seed, **loader_kwargs
        )
    dp_optimizer = DPOptimizer(
        optimizer,
        model=model,
        max_grad_norm=max_grad_norm,
        noise_multiplier=noise_multiplier,
        ledger=ledger,
        sampler=loader,
        loss_reduction=loss_reduction,  # type: ignore[arg-type]
        seed=noise_seed,
        **options,
    )
    data_loader: Iterable[Any] = loader
    if max_physical_batch_size is not None:
        data_loader = _VirtualLoader(loader, dp_optimizer, max_physical_batch_size)
    return PrivateTraining(model, dp_optimizer, data_loader)


class _VirtualLoader:
    """A re-iterable view of a loader in physical chunks (see :func:`virtual_batches`)."""

    def __init__(self, loader: DataLoader, optimizer: DPOptimizer, size: int) -> None:
        self.loader = loader
        self.optimizer = optimizer
        self.max_physical_batch_size = check_positive_int("max_physical_batch_size", size)

    @property
    def batch_sampler(self) -> Any:
        """The logical loader's Poisson batch sampler."""
        return self.loader.batch_sampler

    def __iter__(self) -> Any:
        return virtual_batches(
            self.loader, self.optimizer, max_physical_batch_size=self.max_physical_batch_size
        )
