"""A step that never finished does not keep the model, the optimizer or its activations alive.

The usual case is a step that ran out of device memory: the user (or a batch-size search such as
Hugging Face's ``auto_find_batch_size``) catches the error, drops the model and the optimizer, and
tries a smaller batch. The engine's hooks on the step's autograd nodes and on the parameters must
not tie the engine to the C++ autograd graph of the unfinished step, or the garbage collector can
never free any of it, and on a GPU the retry runs out of memory too.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from dpledger import PrivacyLedger
from dpledger.adapters.torch import DPOptimizer, PerExampleGradientEngine
from tests.adapters.torch.reference import DEVICES


class _Failing(nn.Module):
    """Raises in its forward while ``armed`` (as an allocation that runs out of memory would)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise RuntimeError("CUDA out of memory (simulated)")
        return x


class _OutOfMemoryError(RuntimeError):
    pass


def _raise_in_backward(grad: torch.Tensor) -> None:
    raise _OutOfMemoryError("CUDA out of memory in the backward (simulated)")


def _unfinished_step(where: str, device: str) -> tuple[weakref.ref, ...]:
    """A DP step, then a step that fails at ``where``; weak references to what it used."""
    torch.manual_seed(0)
    failing = _Failing()
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(64, 3), failing, nn.LogSoftmax(-1)
    ).to(device)
    dp = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        sampling_probability=0.1,
        population_size=100,
        ledger=PrivacyLedger(),
        seed=0,
    )
    x = torch.randn(8, 1, 6, 6, device=device)
    y = torch.randint(0, 3, (8,), device=device)
    dp.zero_grad()
    dp.backward(F.nll_loss(model(x), y))
    dp.step()
    dp.zero_grad()
    with pytest.raises(RuntimeError, match="out of memory"):
        if where == "forward":
            failing.armed = True
            model(x)
        else:
            loss = F.nll_loss(model(x), y)
            loss.register_hook(_raise_in_backward)
            if where == "dp.backward":
                dp.backward(loss)
            else:
                loss.backward()
    activation = weakref.ref(next(iter(dp._engine._units)).captures[0].args[0])
    return weakref.ref(model), weakref.ref(dp), weakref.ref(dp._engine), activation


def _allocated(device: str) -> int:
    """Bytes the caching allocator has handed out on ``device`` (0 on the CPU)."""
    gc.collect()
    if device != "cuda":
        return 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["forward", "dp.backward", "loss.backward"])
def test_an_unfinished_step_is_freed_once_the_user_drops_model_and_optimizer(where, device):
    """Nothing of the step is left; on CUDA the device memory is what it was before the second
    of two such attempts (the first one also makes one-time allocations, such as cuBLAS's
    workspace, that stay for the process)."""
    for attempt in range(2):
        before = _allocated(device)
        refs = _unfinished_step(where, device)
        gc.collect()
        assert [r() is None for r in refs] == [True] * 4
        if attempt == 1:
            assert _allocated(device) == before


def test_a_removed_engine_is_freed_and_a_backward_through_its_graph_still_runs():
    """The hooks on a step's autograd nodes hold the engine weakly: once the engine is removed
    and dropped, a backward through a graph it hooked runs as usual and reaches nothing."""
    model = nn.Linear(4, 2)
    engine = PerExampleGradientEngine(model, loss_reduction="mean")
    out = model(torch.randn(5, 4))
    engine.remove()
    engine_ref = weakref.ref(engine)
    del engine
    gc.collect()
    assert engine_ref() is None
    out.sum().backward()
    assert model.weight.grad is not None and model.weight.grad.shape == (2, 4)
