"""Independent references for the engine tests: gradients of one example at a time.

The references always run on the CPU in float64. Tests parametrized over ``DEVICES`` run the code
under test on each device torch sees (the CPU always; CUDA where it is available, as on a GPU
machine) and compare it with the CPU reference, so the same assertions check the device path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

DEVICES: tuple[str, ...] = ("cpu",) + (("cuda",) if torch.cuda.is_available() else ())


def to_device(tree: Any, device: str | torch.device) -> Any:
    """``tree`` (tensors in tuples, lists and dicts) with every tensor moved to ``device``."""
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)


def loop_per_example_grads(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: tuple[torch.Tensor, ...],
    targets: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """g_i = ∇ loss_fn(model(x_i), y_i), each example run on its own as a batch of one."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    batch = targets.shape[0]
    rows: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    for i in range(batch):
        out = model(*(x[i : i + 1] for x in inputs))
        grads = torch.autograd.grad(loss_fn(out, targets[i : i + 1]), params, allow_unused=True)
        for n, p, g in zip(names, params, grads, strict=True):
            rows[n].append(torch.zeros_like(p) if g is None else g)
    return {
        n: torch.stack(v) if v else p.new_zeros((0, *p.shape))
        for (n, v), p in zip(rows.items(), params, strict=True)
    }


def squared_norms(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: g.flatten(1).square().sum(1) for n, g in grads.items()}


def weighted_sum(grads: dict[str, torch.Tensor], f: torch.Tensor) -> dict[str, torch.Tensor]:
    return {n: torch.einsum("b,b...->...", f.to(g), g) for n, g in grads.items()}


def assert_close_dicts(got: dict, want: dict, **tol) -> None:
    assert list(got) == list(want)
    for n in want:
        torch.testing.assert_close(
            got[n].to(want[n].device), want[n], msg=lambda m, n=n: f"{n}: {m}", **tol
        )
