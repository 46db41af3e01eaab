"""The checks :class:`~dpledger.adapters.torch.optimizer.DPOptimizer` runs when it is created.

Each function checks one part of the constructor's arguments (in the order the constructor
calls them, which is the order the errors are raised in) and returns what the optimizer keeps:
the resolved :class:`~dpledger.mechanisms.DPConfig`, the sampler and its sampling event, the
ledger, the trainable parameters, the clip margin, the noise generator. Every refusal is an
:class:`~dpledger.errors.InvalidParameterError` naming the argument, its value and what to change.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from dpledger.adapters.torch.backend import check_generator_device
from dpledger.adapters.torch.distributed import DistributedPoissonBatchSampler, distributed_world
from dpledger.adapters.torch.sampler_base import RecordedBatchSampler
from dpledger.errors import InvalidParameterError
from dpledger.ledger import SamplingEvent
from dpledger.mechanisms.clipping import rounding_clip_margin
from dpledger.mechanisms.config import DPConfig
from dpledger.mechanisms.construction_checks import (
    check_bias_callback,
    check_switch,
    config_with_noise,
)
from dpledger.sampling.validation import check_sampling_probability
from dpledger.validation import check_non_negative_finite, check_positive_int

__all__ = [
    "check_optimizer_and_model",
    "check_step_arguments",
    "check_user_level",
    "default_clip_margin",
    "distributed_setting",
    "noise_generator",
    "resolve_config",
    "sampling_of",
    "trainable_parameters",
]

_SAMPLERS = (
    "a PoissonBatchSampler, FixedSizeBatchSampler, TruncatedPoissonBatchSampler, "
    "BallsInBinsBatchSampler, ShuffleBatchSampler or UserPoissonBatchSampler"
)


def check_optimizer_and_model(optimizer: Any, model: Any, *, wrapper: type) -> None:
    """Refuse an ``optimizer`` that is no ``torch.optim.Optimizer`` or is already a ``wrapper``
    (a DPOptimizer), and a ``model`` that is no ``torch.nn.Module``."""
    if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, wrapper):
        raise InvalidParameterError(
            "optimizer", optimizer, "a torch.optim.Optimizer that is not already wrapped"
        )
    if not isinstance(model, nn.Module):
        raise InvalidParameterError("model", model, "a torch.nn.Module")


def resolve_config(config: DPConfig | None, **fields: Any) -> DPConfig:
    """The step's :class:`~dpledger.mechanisms.DPConfig` from ``config`` or the keyword
    arguments of its fields; it must carry a noise multiplier."""
    return config_with_noise(
        config,
        calibrate="DPOptimizer takes noise_multiplier=, since it does not know the run's "
        "length; make_private(..., config=config, epochs=...) calibrates z for a target",
        **fields,
    )


def check_step_arguments(
    *,
    loss_reduction: Any,
    loss_fn: Callable[..., torch.Tensor] | None,
    bam_radius: float | None,
    check_record_independence: Any,
    bias_callback: Any,
) -> float | None:
    """Check the arguments of the per-example gradients and the step's extras.

    Returns:
        BAM's radius λ, checked (None for none).
    """
    if loss_reduction not in ("mean", "sum"):
        raise InvalidParameterError(
            "loss_reduction",
            loss_reduction,
            "'mean' (the loss you backpropagate is (1/B)·Σ_i ℓ_i) or 'sum' (Σ_i ℓ_i): a "
            "loss that is not a sum or mean of per-example terms (reduction='none' "
            "reduced some other way, a batch-level term) hides the per-example gradients",
        )
    if loss_fn is not None and not callable(loss_fn):
        raise InvalidParameterError("loss_fn", loss_fn, "a callable (output, target) -> loss")
    radius = None
    if bam_radius is not None:
        radius = check_non_negative_finite("bam_radius", bam_radius)
        if loss_fn is None:
            raise InvalidParameterError(
                "bam_radius",
                bam_radius,
                "None unless loss_fn is given: BAM evaluates each example's loss at its own "
                "perturbed parameters, which needs the per-example loss function",
            )
    check_switch("check_record_independence", check_record_independence)
    check_bias_callback(bias_callback)
    return radius


def distributed_setting(distributed: Any, process_group: Any) -> tuple[bool, int, int]:
    """Whether the step is distributed, with this process's rank and the world size.

    Args:
        distributed: True, False, or None (when a group of more than one rank is initialised).
        process_group: the process group (None: the default group).
    """
    if distributed is None:
        distributed = distributed_world(process_group)[1] > 1
    elif not isinstance(distributed, bool):
        raise InvalidParameterError("distributed", distributed, "True, False or None")
    if distributed:
        rank, world = distributed_world(process_group)
        return True, rank, world
    return False, 0, 1


def _sampling_source(sampler: Any) -> RecordedBatchSampler:
    if isinstance(sampler, DataLoader):
        inner = sampler.batch_sampler
        if not isinstance(inner, RecordedBatchSampler):
            raise InvalidParameterError(
                "sampler",
                f"a DataLoader with batch_sampler {type(inner).__name__}",
                "a data loader whose batches are the draws of a recorded sampler "
                "(poisson_data_loader, private_data_loader, or a DataLoader with batch_sampler= "
                f"{_SAMPLERS}); the sampling probability of other loaders is not "
                "q = 1/len(loader), and their scheme is not known. For your own Poisson "
                "sampler, give sampling_probability= and population_size= instead",
            )
        return inner
    if isinstance(sampler, RecordedBatchSampler):
        return sampler
    raise InvalidParameterError("sampler", sampler, f"{_SAMPLERS}, or a DataLoader using one")


def sampling_of(
    sampler: RecordedBatchSampler | DataLoader | None,
    sampling_probability: float | None,
    population_size: int | None,
    *,
    distributed: bool,
    world: int,
) -> tuple[RecordedBatchSampler | None, SamplingEvent]:
    """The recorded sampler the batches come from (None for q and n given) and its event."""
    if sampler is not None:
        if sampling_probability is not None or population_size is not None:
            raise InvalidParameterError(
                "sampling_probability",
                sampling_probability,
                "None when sampler= is given (q and n are read from the sampler)",
            )
        source = _sampling_source(sampler)
        if distributed and not (
            isinstance(source, DistributedPoissonBatchSampler) and source.world_size == world
        ):
            raise InvalidParameterError(
                "sampler",
                type(source).__name__,
                f"a DistributedPoissonBatchSampler over {world} ranks: independent "
                "samplers on each rank do not draw one sample of the scheme they would "
                "record (dpledger has no distributed fixed-size, truncated, balls-in-bins "
                "or shuffle sampler: each would need every rank to draw one global sample "
                "and take its share, and only Poisson sampling is implemented that way)",
            )
        return source, source.sampling_event()
    if sampling_probability is None or population_size is None:
        raise InvalidParameterError(
            "sampler",
            None,
            f"{_SAMPLERS} (or its DataLoader), or both sampling_probability= and "
            "population_size= of the Poisson sampler you use",
        )
    event = SamplingEvent.poisson(
        check_sampling_probability(sampling_probability),
        check_positive_int("population_size", population_size),
    )
    return None, event


def check_user_level(
    user_level: bool, user_gradient: Any, bam_radius: float | None, bias_callback: Any
) -> None:
    """Check ``user_gradient`` and refuse what user-level sampling cannot do."""
    if user_gradient not in ("sum", "mean"):
        raise InvalidParameterError(
            "user_gradient",
            user_gradient,
            "'sum' or 'mean' (each sampled user's vector: the sum or the mean of the "
            "gradients of the user's records in the batch)",
        )
    if user_gradient != "sum" and not user_level:
        raise InvalidParameterError(
            "user_gradient",
            user_gradient,
            "'sum' unless sampler= is a UserPoissonBatchSampler (record-level steps clip "
            "each record's own gradient)",
        )
    if user_level:
        if bam_radius is not None:
            raise InvalidParameterError(
                "bam_radius",
                bam_radius,
                "None with a UserPoissonBatchSampler: BAM's ascent is per record, and "
                "dpledger has no user-level version of it",
            )
        if bias_callback is not None:
            raise InvalidParameterError(
                "bias_callback",
                "<a callable>",
                "None with a UserPoissonBatchSampler: the clipping-bias metrics are per "
                "record, not per user",
            )


def trainable_parameters(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, nn.Parameter], torch.device]:
    """The model's trainable parameters by name (each once) and their one device; the
    optimizer must update all of them and no tensor outside the model."""
    params: dict[str, nn.Parameter] = {}
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            params[name] = p
            seen.add(id(p))
    if not params:
        raise InvalidParameterError("model", type(model).__name__, "a trainable parameter")
    in_model = {id(p) for p in model.parameters()}
    in_opt = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [n for n, p in params.items() if id(p) not in in_opt]
    if missing:
        raise InvalidParameterError(
            "optimizer",
            f"<optimizer without the model's trainable parameters {missing}>",
            "an optimizer over model.parameters(); or freeze those parameters "
            "(p.requires_grad_(False)) before wrapping",
        )
    foreign = sum(
        1 for group in optimizer.param_groups for p in group["params"] if id(p) not in in_model
    )
    if foreign:
        raise InvalidParameterError(
            "optimizer",
            f"<optimizer with {foreign} tensor(s) that are not parameters of the model>",
            "an optimizer over this model's parameters only: tensors the DP step does not "
            "see would be updated with non-private gradients",
        )
    devices = {p.device for p in params.values()}
    if len(devices) != 1:
        raise InvalidParameterError(
            "model", f"<parameters on {sorted(map(str, devices))}>", "parameters on one device"
        )
    return params, next(iter(devices))


def default_clip_margin(params: Mapping[str, nn.Parameter]) -> float:
    """ρ chosen by dtype: the engine computes in the parameters' dtype, at least float32."""
    return rounding_clip_margin(
        max(torch.finfo(torch.promote_types(p.dtype, torch.float32)).eps for p in params.values())
    )


def noise_generator(
    generator: torch.Generator | None, seed: int | None, device: torch.device
) -> torch.Generator:
    """``generator`` (on ``device``), or a new one on ``device`` seeded with ``seed`` (from OS
    entropy when None)."""
    if generator is not None:
        if seed is not None:
            raise InvalidParameterError("seed", seed, "None when a generator is given")
        check_generator_device(generator, device, parameter="generator")
        return generator
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    elif isinstance(seed, bool) or not isinstance(seed, int):
        raise InvalidParameterError("seed", seed, "an integer or None")
    else:
        generator.manual_seed(seed)
    return generator
