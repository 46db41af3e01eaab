"""DP training of a model compiled with ``torch.compile``.

The engine's hooks run outside the compiled region (``adapters/torch/compiled_capture.py``):
Dynamo's graph-break counter stays empty, and the compiled DP step equals the eager one with
σ = 0 and a binding clip bound (float64, batches of different sizes). The record-independence
probe still runs, eagerly, before the first step records anything, and a layer the compiled
path cannot take is refused with a typed error.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch._dynamo.utils import counters

from dpledger import PrivacyLedger
from dpledger.adapters.torch import DPOptimizer
from dpledger.errors import (
    RecordDependenceError,
    UnsupportedLayerError,
    UnsupportedParameterUseError,
)
from tests.adapters.torch.dp_helpers import batch, params_of, small_cnn

N, Q = 100, 0.2


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _optimizer(model: nn.Module, ledger: PrivacyLedger, **kwargs) -> DPOptimizer:
    return DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5),
        model=model,
        l2_norm_bound=0.05,  # binding: every per-example gradient is clipped
        noise_multiplier=0.0,
        sampling_probability=Q,
        population_size=N,
        ledger=ledger,
        **kwargs,
    )


def _train(model: nn.Module, forward, ledger: PrivacyLedger, sizes, **kwargs) -> list[dict]:
    opt = _optimizer(model, ledger, **kwargs)
    after = []
    for step, size in enumerate(sizes):
        x, y = batch(size, seed=10 + step)
        opt.zero_grad()
        loss = F.cross_entropy(forward(x), y)
        if kwargs.get("check_steps") == 0:
            opt.backward(loss)
        else:
            loss.backward()
        opt.step()
        after.append(params_of(model))
    return after


def _graph_breaks() -> dict:
    return dict(counters["graph_break"])


@pytest.mark.slow
def test_compiled_dp_step_equals_the_eager_one_with_no_graph_break():
    sizes = [12, 7]  # a new batch size: the compiled graph takes it as a dynamic shape
    eager = small_cnn(seed=3)
    reference = _train(eager, eager, PrivacyLedger(), sizes)
    model = small_cnn(seed=3)
    ledger = PrivacyLedger()
    compiled = _train(model, torch.compile(model), ledger, sizes)
    assert _graph_breaks() == {}
    assert counters["stats"]["unique_graphs"] >= 1  # the forward really was compiled
    for mine, ref in zip(compiled, reference, strict=True):
        for name in ref:
            torch.testing.assert_close(mine[name], ref[name], rtol=1e-10, atol=1e-12)
    assert len(list(ledger.steps())) == len(sizes)
    first = params_of(small_cnn(seed=3))
    assert any(not torch.equal(first[n], compiled[-1][n]) for n in first)  # it trained


@pytest.mark.slow
def test_compiled_step_with_the_cheaper_backward_equals_the_eager_one():
    sizes = [10, 10]
    eager = small_cnn(seed=4)
    reference = _train(eager, eager, PrivacyLedger(), sizes, check_steps=0)
    model = small_cnn(seed=4)
    compiled = _train(
        model, torch.compile(model, backend="aot_eager"), PrivacyLedger(), sizes, check_steps=0
    )
    assert _graph_breaks() == {}
    for mine, ref in zip(compiled, reference, strict=True):
        for name in ref:
            torch.testing.assert_close(mine[name], ref[name], rtol=1e-10, atol=1e-12)


class _Centre(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0)


def test_compiled_forward_is_probed_before_anything_is_recorded():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(36, 8), _Centre(), nn.Linear(8, 3)).double()
    ledger = PrivacyLedger()
    opt = _optimizer(model, ledger)
    before = params_of(model)
    x, y = batch(8)
    F.cross_entropy(torch.compile(model, backend="aot_eager")(x), y).backward()
    with pytest.raises(RecordDependenceError):
        opt.step()
    assert list(ledger.steps()) == []
    assert all(torch.equal(before[n], p) for n, p in params_of(model).items())


class _NoRule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(36, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1) * self.scale


def test_layer_without_a_rule_is_refused_under_compile():
    model = nn.Sequential(_NoRule(), nn.Linear(36, 3)).double()
    opt = _optimizer(model, PrivacyLedger())
    x, _ = batch(4)
    with pytest.raises(UnsupportedLayerError, match=r"0 \(_NoRule\) has none"):
        torch.compile(model, backend="aot_eager")(x)
    opt.zero_grad()


def test_model_compiled_before_it_was_wrapped_is_refused_at_the_step(monkeypatch):
    # Dynamo's default, as in a process where dpledger's engine was not created yet
    monkeypatch.setattr(torch._dynamo.config, "skip_nnmodule_hook_guards", True)
    x, y = batch(6)
    plain = small_cnn(seed=6)
    F.cross_entropy(torch.compile(plain, backend="aot_eager")(x), y).backward()
    wrapped = small_cnn(seed=5)  # the same structure: Dynamo reuses the code without hooks
    ledger = PrivacyLedger()
    opt = _optimizer(wrapped, ledger)
    F.cross_entropy(torch.compile(wrapped, backend="aot_eager")(x), y).backward()
    with pytest.raises(UnsupportedParameterUseError):
        opt.step()
    assert list(ledger.steps()) == []


def test_a_model_of_the_same_structure_compiled_later_does_not_take_the_wrapped_ones_place():
    sizes = [8, 8]
    eager = small_cnn(seed=7)
    reference = _train(eager, eager, PrivacyLedger(), sizes)
    model = small_cnn(seed=7)
    opt = _optimizer(model, PrivacyLedger())
    compiled = torch.compile(model, backend="aot_eager")
    other = small_cnn(seed=8)  # not wrapped, compiled between the wrapped model's steps
    other_compiled = torch.compile(other, backend="aot_eager")
    for step, size in enumerate(sizes):
        x, y = batch(size, seed=10 + step)
        opt.zero_grad()
        F.cross_entropy(compiled(x), y).backward()
        opt.step()
        F.cross_entropy(other_compiled(x), y).backward()
    for name, ref in reference[-1].items():
        torch.testing.assert_close(params_of(model)[name], ref, rtol=1e-10, atol=1e-12)
