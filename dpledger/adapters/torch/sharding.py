"""DP-SGD of a model sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``).

FSDP2 is data parallel: each rank runs the forward and backward of its own records, with every
layer's parameters all-gathered for the layer's forward and backward, and keeps only a shard of
each parameter (a ``DTensor`` sharded along dimension 0 on a one-dimensional device mesh)
between steps. The engine's layer rules compute per-example norms and clipped sums from each
layer's inputs and output gradients, which do not depend on how the weights are stored: each
rank computes the full per-example norms of its own records and their clipped sum, and the step
then goes as under DDP (:mod:`~dpledger.adapters.torch.distributed`): the counts and clipped
sums are reduced onto rank 0, which runs the sensitivity check, records the global Poisson
sample and the sum queries once, draws all the noise from its generator and broadcasts the
averaged noisy gradient; each rank then keeps its own shard of it as the parameter's gradient
(:func:`local_gradient`) and the wrapped optimizer steps on the shards.

What this module adds for that: the layer rules of FSDP2's module classes (``fully_shard``
turns an ``nn.Linear`` into an ``FSDPLinear``, a subclass made on the fly: the rule of the
class it wraps applies, :func:`fsdp_layer_rule`), the checks of the sharding that is supported
(:func:`check_sharded_parameters`), and the model synchronisation that leaves shards alone
(:func:`replicated_tensors`).

Limits: every rank holds the full clipped sum of the step and the averaged noisy gradient for a
moment (the size of the model's trainable parameters, once), and rank 0 draws the noise for the
whole vector; the parameters, their gradients between steps and the optimizer's state stay
sharded. Hybrid sharding (a two-dimensional mesh) and shardings other than FSDP2's
``Shard(0)`` are refused before the first step.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from dpledger.adapters.torch.registry import LayerRule, layer_rule, register_rule_resolver
from dpledger.errors import InvalidParameterError, UnsupportedLayerError

__all__ = [
    "all_ranks_have_records",
    "check_sharded_model",
    "check_sharded_parameters",
    "fsdp_layer_rule",
    "is_sharded",
    "local_gradient",
    "replicated_tensors",
]


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    return DTensor


def _fsdp_module_type() -> type | None:
    """FSDP2's module class, if FSDP2 was imported (no module can be sharded otherwise)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return getattr(fsdp, "FSDPModule", None)


def fsdp_layer_rule(module_type: type[nn.Module]) -> LayerRule | None:
    """The layer rule of the class an FSDP2 module class wraps (None for other classes).

    ``fully_shard(module)`` changes the module's class to ``FSDP<Class>``, a subclass of
    ``FSDPModule`` and ``<Class>`` whose forward is ``<Class>``'s: its per-example gradients
    are ``<Class>``'s.
    """
    fsdp = _fsdp_module_type()
    if fsdp is None or not issubclass(module_type, fsdp) or module_type is fsdp:
        return None
    bases = [b for b in module_type.__bases__ if b is not fsdp]
    if len(bases) != 1 or not issubclass(bases[0], nn.Module):
        return None
    return layer_rule(bases[0])


register_rule_resolver(fsdp_layer_rule)


def is_sharded(t: Any) -> bool:
    """True for a ``DTensor`` (a parameter sharded by FSDP2)."""
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)


def check_sharded_parameters(params: dict[str, nn.Parameter], *, world_size: int) -> bool:
    """Refuse a sharding the DP step does not support; True when some parameter is sharded.

    Supported: FSDP2's sharding, ``Shard(0)`` on a one-dimensional mesh of all ``world_size``
    ranks (the optimizer's process group).

    Raises:
        InvalidParameterError: a parameter sharded otherwise (hybrid sharding, tensor
            parallelism), named with its placements.
    """
    from torch.distributed.tensor import Shard

    sharded = False
    for name, p in params.items():
        if not is_sharded(p):
            continue
        sharded = True
        mesh, placements = p.device_mesh, tuple(p.placements)
        if mesh.ndim != 1 or placements != (Shard(0),) or mesh.size() != world_size:
            raise InvalidParameterError(
                "model",
                f"<parameter {name!r} sharded as {placements} on a mesh of shape "
                f"{tuple(mesh.shape)}>",
                f"parameters sharded by fully_shard along dimension 0 over all {world_size} "
                "ranks (FSDP2's default, a one-dimensional mesh), or not sharded: hybrid "
                "sharding and tensor parallelism are not supported by the DP step",
            )
    return sharded


# Layer rules that recompute a layer's forward with its weights after the backward, when FSDP2
# holds only their shards: refused under FSDP2.
_NEED_FULL_WEIGHTS = (nn.RNNBase, nn.MultiheadAttention)


def check_sharded_model(model: nn.Module, engine: Any) -> None:
    """Refuse, before the first step, what the DP step cannot do on a model sharded by FSDP2.

    Refused: the functional path (``loss_fn=``: ``torch.func`` over the whole model's
    parameters), modules without a layer rule (the generic path differentiates the module
    again after the backward) and layers whose rule recomputes their forward (recurrent
    layers, ``nn.MultiheadAttention``): each needs the full weights after the backward, when
    FSDP2 holds only their shards.

    Raises:
        UnsupportedLayerError: naming the path or the modules.
    """
    if engine is None:
        raise UnsupportedLayerError(
            "loss_fn= (the functional per-example path) is not supported for a model sharded "
            "by FSDP2: run the forward and loss.backward() (the hook path) instead"
        )
    generic = list(engine.generic_modules)
    recomputed = [
        f"{name} ({type(m).__name__})"
        for name, m in model.named_modules()
        if isinstance(m, _NEED_FULL_WEIGHTS) and any(p.requires_grad for p in m.parameters())
    ]
    if generic or recomputed:
        names = ", ".join([*(f"{n or '<model>'} (no layer rule)" for n in generic), *recomputed])
        raise UnsupportedLayerError(
            f"a model sharded by FSDP2 needs layer rules that work from a layer's inputs and "
            f"output gradients alone (Linear, Conv, Embedding, the normalisation layers); "
            f"these need the full weights after the backward: {names}. Freeze them, replace "
            "them, or train without FSDP2 (DDP)"
        )


def all_ranks_have_records(records: int, *, minimum: int, process_group: Any = None) -> bool:
    """Whether every rank's batch has at least ``minimum`` records (one all-reduce).

    Under FSDP2 every forward and backward all-gathers the layers' weights, so the
    record-independence probe's extra forwards and backwards must run on every rank together
    or on none: the ranks decide together, at the same forward.
    """
    import torch.distributed as dist

    flat = torch.tensor([records], dtype=torch.int64)
    dist.all_reduce(flat, op=dist.ReduceOp.MIN, group=process_group)
    return int(flat.item()) >= minimum


def local_gradient(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``full`` (the same on every rank) as the gradient of ``param``.

    For a ``DTensor`` parameter, a ``DTensor`` with the parameter's mesh and placements whose
    local part is this rank's shard of ``full`` (no communication); otherwise ``full``.
    """
    full = full.to(dtype=param.dtype)
    if not is_sharded(param):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)


def replicated_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The model's parameters and buffers that every rank holds whole (not ``DTensor``s): the
    ones rank 0 broadcasts at construction."""
    return [t for t in (*model.parameters(), *model.buffers()) if not is_sharded(t)]
