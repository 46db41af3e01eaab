"""The first step's loss-reduction check when the loss is differentiated by a plain
``loss.backward()`` (the engine never sees the loss), next to ``optimizer.backward(loss)``.

Reference: PyTorch's own reduction of a built-in loss (``nn.CrossEntropyLoss(reduction=...)``,
``nn.MSELoss``) against the declared ``loss_reduction``: a sum over B records is B times their
mean, so a mismatch scales every per-example gradient by B or 1/B.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dpledger.adapters.torch import DPOptimizer, PerExampleGradientEngine
from dpledger.adapters.torch import loss_reduction as loss_reduction_module
from dpledger.errors import LossReductionWarning

BATCH = 6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 5, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


def _warnings_of(run) -> list[LossReductionWarning]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [w.message for w in caught if issubclass(w.category, LossReductionWarning)]


def _dp_steps(declared: str, loss_fn: nn.Module, steps: int = 1) -> list[LossReductionWarning]:
    model = _model()
    dp = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        sampling_probability=0.5,
        population_size=12,
        loss_reduction=declared,
        check_record_independence=False,
        seed=0,
    )
    x, y = _batch()

    def run() -> None:
        for _ in range(steps):
            dp.zero_grad()
            loss_fn(model(x), y).backward()
            dp.step()

    found = _warnings_of(run)
    assert dp.ledger.num_steps == steps  # recorded as ever: the warning changes nothing
    return found


def test_a_sum_cross_entropy_under_the_default_mean_is_warned_about_once():
    """nn.CrossEntropyLoss(reduction="sum") + loss.backward() under the default "mean": one
    warning on the first step, naming both reductions, the loss node, its B terms and B."""
    found = _dp_steps("mean", nn.CrossEntropyLoss(reduction="sum"), steps=3)
    (message,) = found
    assert (message.declared, message.found) == ("mean", "sum")
    assert message.loss_function == "NllLossBackward0"
    assert str(message).startswith(
        f"the loss was computed with reduction='sum' (NllLossBackward0, over {BATCH} terms, a "
        f"batch of {BATCH} records) but loss_reduction='mean' was declared: every per-example "
        f"gradient is scaled by B = {BATCH} before clipping"
    )


@pytest.mark.parametrize(
    ("declared", "reduction"), [("mean", "mean"), ("sum", "sum")], ids=["mean", "sum"]
)
def test_a_cross_entropy_that_matches_the_declaration_is_not_warned_about(declared, reduction):
    """The declaration equals the loss's reduction: nothing to say."""
    assert _dp_steps(declared, nn.CrossEntropyLoss(reduction=reduction)) == []


def test_a_mean_mse_loss_under_a_sum_declaration_is_warned_about():
    """nn.MSELoss() (mean over B·3 elements) under "sum": the terms are the input's elements."""
    mse = nn.MSELoss()

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return mse(out, nn.functional.one_hot(y, 3).to(out.dtype))

    (message,) = _dp_steps("sum", loss_fn)
    assert (message.declared, message.found, message.loss_function) == (
        "sum",
        "mean",
        "MseLossBackward0",
    )
    assert f"over {BATCH * 3} terms, a batch of {BATCH} records" in str(message)


def test_a_mean_cross_entropy_under_a_sum_declaration_is_judged_by_optimizer_backward_only():
    """After the loss's own backward its targets are freed, so ignored targets (which change a
    mean's divisor) cannot be seen: a plain backward claims nothing; optimizer.backward(loss)
    reads the targets first and warns."""
    assert _dp_steps("sum", nn.CrossEntropyLoss()) == []
    model = _model()
    engine = PerExampleGradientEngine(model, loss_reduction="sum")
    x, y = _batch()
    (message,) = _warnings_of(lambda: engine.backward(nn.CrossEntropyLoss()(model(x), y)))
    assert (message.declared, message.found) == ("sum", "mean")


@pytest.mark.parametrize(
    "backward",
    [
        lambda loss: (2.0 * loss).backward(),
        lambda loss: loss.backward(gradient=torch.tensor(2.0)),
        lambda loss: torch.autograd.backward([loss, 0.0 * loss]),
    ],
    ids=["rescaled-loss", "explicit-gradient", "two-roots"],
)
def test_a_loss_that_is_not_the_built_in_output_is_not_judged(backward):
    """A rescaled loss, an explicit output gradient or several roots: the differentiated loss
    is not the built-in loss's output, so its reduction is no fact about it."""
    model = _model()
    engine = PerExampleGradientEngine(model, loss_reduction="mean")
    x, y = _batch()
    assert _warnings_of(lambda: backward(nn.CrossEntropyLoss(reduction="sum")(model(x), y))) == []
    assert engine._reduction_checked  # the step was looked at, and nothing claimed
    assert engine.batch_size == BATCH


def test_the_plain_backward_check_runs_on_the_first_step_only(monkeypatch):
    """After the first step the hooks do not look for the loss at all (no cost)."""
    calls = []
    original = loss_reduction_module._loss_reduction_of_backward

    def counted(node):
        calls.append(node)
        return original(node)

    monkeypatch.setattr(loss_reduction_module, "_loss_reduction_of_backward", counted)
    model = _model()
    engine = PerExampleGradientEngine(model, loss_reduction="mean", check_steps=0)
    x, y = _batch()
    for _ in range(3):
        nn.CrossEntropyLoss()(model(x), y).backward()
        engine.squared_norms()
    assert len(calls) == 1


def test_the_loss_is_found_from_another_thread_than_the_backward_caller():
    """A device's backward runs its hooks on an autograd thread while the caller's thread
    waits in ``loss.backward()``: the loss is then read from the waiting thread's stack. Here a
    worker thread, started from inside the backward, stands in for the autograd thread."""
    import threading

    model = _model()
    x, y = _batch()
    out = model(x)
    node = out.grad_fn
    seen = []

    def look(grads):
        worker = threading.Thread(
            target=lambda: seen.append(loss_reduction_module._loss_reduction_of_backward(node))
        )
        worker.start()
        worker.join()

    node.register_prehook(look)
    nn.CrossEntropyLoss(reduction="sum")(out, y).backward()
    assert seen == [("NllLossBackward0", "sum", BATCH)]
    assert loss_reduction_module._loss_reduction_of_backward(node) is None  # none running now
