"""Models and ledgers the adapter cannot train with give typed errors naming the module or file."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.utils.data import TensorDataset

from dpledger import PrivacyLedger
from dpledger.adapters.torch import DPOptimizer, PerExampleGradientEngine, make_private
from dpledger.errors import (
    EngineStateError,
    LedgerLockedError,
    LedgerStateError,
    RecordDependenceError,
    UnsupportedParameterUseError,
)


def _wrap(model, ledger=None, **kwargs):
    return DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        sampling_probability=0.1,
        population_size=100,
        ledger=ledger if ledger is not None else PrivacyLedger(),
        seed=0,
        **kwargs,
    )


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(6, 4, generator=g), torch.randint(0, 2, (6,), generator=g)


class ParentUsesChildWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)  # its forward is never called
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(torch.tanh(F.linear(x, self.inner.weight, self.inner.bias)))


def test_parent_using_a_childs_weight_names_the_parameter_and_its_module():
    torch.manual_seed(0)
    model = ParentUsesChildWeight()
    dp = _wrap(model)
    x, y = _batch()
    F.cross_entropy(model(x), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(
        UnsupportedParameterUseError, match=r"inner\.weight of module 'inner' \(Linear\)"
    ):
        dp.step()
    assert dp.ledger.num_events == 0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


class OnlyTheParentCalled(nn.Module):
    """No module's own forward runs: the parent uses its child's parameters directly."""

    def __init__(self):
        super().__init__()
        self.child = nn.Linear(4, 2)

    def forward(self, x):
        return F.linear(x, self.child.weight, self.child.bias)


def _names_the_parent_use(info, parent: str, example: str) -> None:
    message = str(info.value)
    assert re.search(
        r"child\.weight, (0\.)?child\.bias of module '(0\.)?child' \(Linear\)", message
    )
    assert f"whose parent is {parent}" in message
    assert f"F.linear(x, self.{example})" in message
    assert "register_layer_rule" in message and "nothing to backpropagate" not in message


@pytest.mark.parametrize("check_steps", [0, 1])
def test_a_parent_using_its_only_childs_weight_names_the_module_and_the_cause(check_steps):
    """Nothing the engine observes runs in the forward: it used to say "nothing to
    backpropagate to" (after the check steps) or "no forward of the model" (during them)."""
    torch.manual_seed(0)
    model = OnlyTheParentCalled()
    engine = PerExampleGradientEngine(model, loss_reduction="mean", check_steps=check_steps)
    x, y = _batch()
    with pytest.raises(UnsupportedParameterUseError, match=r"module 'child' \(Linear\)") as info:
        engine.backward(F.cross_entropy(model(x), y))
        engine.squared_norms()
    _names_the_parent_use(info, "the model (OnlyTheParentCalled)", "child.weight")


def test_make_private_with_a_parent_using_its_childs_weight_names_the_nested_parent():
    torch.manual_seed(0)
    model = nn.Sequential(OnlyTheParentCalled())
    x, y = _batch()
    model, opt, loader = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        TensorDataset(x, y),
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        sampling_probability=0.5,
        seed=0,
    )
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(UnsupportedParameterUseError, match=r"0\.child\.weight") as info:
        for xb, yb in loader:
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
    _names_the_parent_use(info, "'0' (OnlyTheParentCalled)", "child.weight")
    assert opt.ledger.num_steps == 0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_a_loss_that_uses_no_parameter_still_says_nothing_to_backpropagate():
    model = OnlyTheParentCalled()
    engine = PerExampleGradientEngine(model, loss_reduction="mean", check_steps=0)
    with torch.no_grad():
        model(_batch()[0])
    with pytest.raises(EngineStateError, match="nothing to backpropagate"):
        engine.backward(torch.ones(1, requires_grad=True).sum() * 2)


class TiedOutside(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(9, 4)
        self.mix = nn.Linear(4, 4)

    def forward(self, idx):
        h = torch.tanh(self.mix(self.emb(idx)))
        return F.linear(h, self.emb.weight).mean(1)  # the embedding reused as the output layer


def test_tied_weight_used_by_the_parent_names_the_module_at_the_first_step_check():
    torch.manual_seed(0)
    model = TiedOutside()
    dp = _wrap(model)
    idx = torch.randint(0, 9, (6, 5), generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 9, (6,), generator=torch.Generator().manual_seed(1))
    F.cross_entropy(model(idx), y).backward()
    with pytest.raises(
        UnsupportedParameterUseError, match=r"emb\.weight of module 'emb' \(Embedding\)"
    ):
        dp.step()
    assert dp.ledger.num_events == 0


class OwnBatchNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return F.batch_norm(x, None, None, self.weight, self.bias, training=True)


def test_functional_batch_norm_inside_a_custom_module_names_the_module():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), OwnBatchNorm(4), nn.Linear(4, 2))
    dp = _wrap(model)
    x, _ = _batch()
    with pytest.raises(RecordDependenceError, match=r"'1' \(OwnBatchNorm\)") as info:
        model(x)
    assert (info.value.layer_name, info.value.layer_type) == ("1", "OwnBatchNorm")
    assert dp.ledger.num_events == 0


def _setup(ledger, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 2))
    g = torch.Generator().manual_seed(seed)
    data = TensorDataset(torch.randn(50, 4, generator=g), torch.randint(0, 2, (50,), generator=g))
    return make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        sampling_probability=0.2,
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        ledger=ledger,
        seed=seed,
    )


def _train(model, optimizer, loader):
    for x, y in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        return


def test_resume_while_another_writer_holds_the_ledger_names_the_file(tmp_path):
    path = tmp_path / "run.dpl"
    first = PrivacyLedger(path)
    model, optimizer, loader = _setup(first)
    _train(model, optimizer, loader)
    checkpoint = optimizer.state_dict()
    with pytest.raises(LedgerLockedError, match=r"run\.dpl") as info:  # the racing resume
        PrivacyLedger(path, resume=True)
    assert str(info.value.path) == str(path)
    first.close()
    second = PrivacyLedger(path, resume=True)  # once the first writer is done: fine
    _, resumed, _ = _setup(second, seed=1)
    resumed.load_state_dict(checkpoint)
    assert resumed.steps_taken == 1
    second.close()


def test_ledger_closed_by_another_owner_refuses_the_step_naming_the_file(tmp_path):
    path = tmp_path / "run.dpl"
    ledger = PrivacyLedger(path)
    model, optimizer, loader = _setup(ledger)
    _train(model, optimizer, loader)
    ledger.close()  # e.g. another copy of the loop finishing with the same ledger object
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _batch()
    F.cross_entropy(model(x)[:, :2], y).backward()
    with pytest.raises(LedgerStateError, match=r"run\.dpl.*was closed"):
        optimizer.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert PrivacyLedger.load(path).num_steps == 1
    optimizer.zero_grad()  # the batch is dropped; the optimizer is between steps again
    assert optimizer.state_dict()["ledger"]["num_steps"] == 1
    with pytest.raises(LedgerStateError, match=r"run\.dpl.*was closed"):
        optimizer.load_state_dict(optimizer.state_dict())
