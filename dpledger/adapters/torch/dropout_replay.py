"""Dropout masks kept from a generic unit's forward call and replayed in its per-example re-run.

The generic path (``module_per_example_gradients`` in
:mod:`~dpledger.adapters.torch.functional_gradients`) re-runs a unit's forward one record at a
time under ``torch.func.vmap`` and starts it from the random-number state its call began with.
That reproduces a dropout's mask only where ``vmap`` draws the random tensor in the batch's
memory order; behind an attention layer (``vmap``'s batched tensors then keep the records in
another dimension of memory) it draws the same numbers in another order, and the per-example
gradients of a unit whose forward spans the whole model (a parameter owned by the model itself,
such as a learned position tensor, with ``nn.Dropout`` in its encoder layers) would use masks
the batch never used.

So every ``nn.Dropout`` module called while a generic unit's forward call is open keeps its mask:
its output is replaced by ``x * noise`` with ``noise = bernoulli(1 - p) / (1 - p)`` drawn from
the state the dropout's own draw started from (on the CPU the very mask it drew, computed the
way PyTorch's CPU dropout computes it; the generators are left where the dropout left them).
In the re-run, each ``nn.Dropout`` call takes the record's row of the next kept mask instead of a
draw of its own. A dropout in place (``inplace=True``) and functional dropout keep the
random-state replay.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__: list[str] = []  # internal to the engine

_replay = threading.local()


@contextlib.contextmanager
def replaying(masks: list[torch.Tensor] | None) -> Iterator[None]:
    """Within the block, ``nn.Dropout`` calls take these masks (one record's rows), in order."""
    previous = getattr(_replay, "masks", None)
    _replay.masks = None if masks is None else list(masks)
    try:
        yield
    finally:
        _replay.masks = previous


def _rng_state(device: torch.device) -> Any:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_rng_state(device: torch.device, state: Any) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class DropoutMasks:
    """The forward hooks on a model's ``nn.Dropout`` modules (see the module docstring).

    Args:
        engine: the engine; its ``_recomputing`` flag tells a re-run from a training forward,
            and ``_open_generic`` holds the mask lists of the generic calls now open.
    """

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._started: dict[int, list[Any]] = {}

    def install(self, model: nn.Module) -> list[Any]:
        """Hook every ``nn.Dropout`` of ``model``; returns the hook handles."""
        handles = []
        for module in model.modules():
            if type(module) is nn.Dropout:
                handles.append(module.register_forward_pre_hook(self._pre))
                handles.append(module.register_forward_hook(self._post))
        return handles

    def _keeps(self, module: nn.Module, args: tuple) -> bool:
        return (
            module.training
            and not module.inplace
            and module.p > 0.0
            and bool(args)
            and isinstance(args[0], torch.Tensor)
            and args[0].is_floating_point()
        )

    def _pre(self, module: nn.Module, args: tuple) -> None:
        engine = self._engine
        if engine._recomputing or not engine._open_generic or not torch.is_grad_enabled():
            return
        if self._keeps(module, args):
            state = _rng_state(args[0].device)
            self._started.setdefault(id(module), []).append(state)

    def _post(self, module: nn.Module, args: tuple, output: Any) -> Any:
        engine = self._engine
        if engine._recomputing:
            masks = getattr(_replay, "masks", None)
            if masks and self._keeps(module, args):
                noise = masks.pop(0)
                if noise.shape == args[0].shape:
                    return args[0] * noise
            return None
        started = self._started.get(id(module))
        if not started:
            return None
        x = args[0]
        begun = started.pop()
        after = _rng_state(x.device)
        _set_rng_state(x.device, begun)
        try:
            if module.p >= 1.0:
                noise = torch.zeros_like(x)
            else:
                noise = torch.empty_like(x).bernoulli_(1.0 - module.p).div_(1.0 - module.p)
        finally:
            _set_rng_state(x.device, after)
        noise = noise.detach()
        for kept in engine._open_generic:
            kept[1].append(noise)
        return x * noise
