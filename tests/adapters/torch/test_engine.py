"""The hook-based engine on whole models: paths agree, edge cases, refusals, errors."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from dpledger.adapters.torch import PerExampleGradientEngine, register_layer_rule
from dpledger.adapters.torch.functional_gradients import FunctionalPerExampleEngine
from dpledger.adapters.torch.registry import unregister_layer_rule
from dpledger.errors import (
    DPLedgerError,
    EngineStateError,
    InvalidParameterError,
    RecordMixingLayerError,
    UnsupportedLayerError,
    UnsupportedParameterUseError,
)
from tests.adapters.torch.reference import (
    assert_close_dicts,
    loop_per_example_grads,
    squared_norms,
    weighted_sum,
)


class Scale(nn.Module):
    """A layer type with a parameter and no registered sampler."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.tanh(self.w)


class Mixed(nn.Module):
    """Every registered layer type plus an unregistered one, on two inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6, padding_idx=0)
        self.conv1 = nn.Conv1d(6, 8, 3, padding=1, groups=2)
        self.gn = nn.GroupNorm(2, 8)
        self.ln = nn.LayerNorm(8)
        self.lin_seq = nn.Linear(8, 6)
        self.rms = nn.RMSNorm(6)
        self.scale = Scale(6)
        self.conv2 = nn.Conv2d(1, 3, 3, padding="same", padding_mode="reflect")
        self.bn = nn.BatchNorm2d(3)
        self.drop = nn.Dropout(0.0)
        self.head = nn.Linear(6 + 3, 4)

    def forward(self, idx: torch.Tensor, img: torch.Tensor) -> torch.Tensor:
        h = self.conv1(self.emb(idx).transpose(1, 2))
        h = F.relu(self.gn(h)).transpose(1, 2)
        h = self.scale(self.rms(self.lin_seq(self.ln(h)))).mean(1)
        c = F.relu(self.bn(self.conv2(img)), inplace=True).mean((2, 3))
        return self.head(self.drop(torch.cat([h, c], 1)))


def mixed_model() -> tuple[nn.Module, tuple, torch.Tensor]:
    torch.manual_seed(0)
    model = Mixed().double()
    with torch.no_grad():
        model.bn.running_mean.normal_()
        model.bn.running_var.uniform_(0.5, 2.0)
    model.bn.eval()
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 11, (5, 7), generator=g)
    img = torch.randn(5, 1, 6, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (5,), generator=g)
    return model, (idx, img), y


def _step(engine, model, inputs, y, reduction="mean", fast=False):
    loss = F.cross_entropy(model(*inputs), y, reduction=reduction)
    if fast:
        engine.backward(loss)
    else:
        loss.backward()
    return loss


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_mixed_model_all_paths_agree_with_loop(reduction, caplog):
    model, inputs, y = mixed_model()
    want = loop_per_example_grads(model, F.cross_entropy, inputs, y)
    f = torch.rand(5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for strategy in ("auto", "ghost", "per_example", "generic"):
        engine = PerExampleGradientEngine(model, loss_reduction=reduction, strategy=strategy)
        _step(engine, model, inputs, y, reduction)
        assert engine.batch_size == 5
        assert_close_dicts(engine.squared_norms(), squared_norms(want))
        assert_close_dicts(engine.clipped_sum(f), weighted_sum(want, f))
        engine.remove()
    functional = FunctionalPerExampleEngine(model, F.cross_entropy)
    functional.compute(inputs, y)
    assert_close_dicts(functional.squared_norms(), squared_norms(want))
    assert_close_dicts(functional.clipped_sum(f), weighted_sum(want, f))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_unit_factors_give_the_batch_gradient(reduction):
    model, inputs, y = mixed_model()
    engine = PerExampleGradientEngine(model, loss_reduction=reduction)
    _step(engine, model, inputs, y, reduction)
    batch_grad = {n: p.grad.clone() for n, p in model.named_parameters()}
    per_record_sum = engine.clipped_sum(torch.ones(5, dtype=torch.float64))
    times = 5.0 if reduction == "mean" else 1.0  # Σ_i g_i = B · (mean-loss gradient)
    assert_close_dicts(per_record_sum, {n: g * times for n, g in batch_grad.items()})
    engine.write_clipped_sum(torch.ones(5, dtype=torch.float64))
    assert_close_dicts({n: p.grad for n, p in model.named_parameters()}, per_record_sum)


def test_engine_backward_skips_weight_gradients_and_matches():
    model, inputs, y = mixed_model()
    want = loop_per_example_grads(model, F.cross_entropy, inputs, y)
    engine = PerExampleGradientEngine(model, loss_reduction="mean", check_steps=0)
    _step(engine, model, inputs, y, fast=True)
    assert all(p.grad is None for p in model.parameters())
    assert_close_dicts(engine.squared_norms(), squared_norms(want))
    engine.write_clipped_sum(torch.ones(5, dtype=torch.float64))
    assert_close_dicts(
        {n: p.grad for n, p in model.named_parameters()}, weighted_sum(want, torch.ones(5))
    )


def test_engine_backward_runs_ordinary_backward_on_checking_steps():
    model, inputs, y = mixed_model()
    engine = PerExampleGradientEngine(model, loss_reduction="mean", check_steps=1)
    _step(engine, model, inputs, y, fast=True)
    assert all(p.grad is not None for p in model.parameters())
    engine.squared_norms()
    model.zero_grad(set_to_none=True)
    _step(engine, model, inputs, y, fast=True)
    assert all(p.grad is None for p in model.parameters())
    engine.squared_norms()


def test_mapping_factors_per_parameter():
    model, inputs, y = mixed_model()
    want = loop_per_example_grads(model, F.cross_entropy, inputs, y)
    engine = PerExampleGradientEngine(model, loss_reduction="mean")
    _step(engine, model, inputs, y)
    g = torch.Generator().manual_seed(4)
    factors = {n: torch.rand(5, generator=g, dtype=torch.float64) for n in engine.parameter_names}
    got = engine.clipped_sum(factors)
    for n in want:
        torch.testing.assert_close(got[n], weighted_sum({n: want[n]}, factors[n])[n])


def test_group_keyed_factors():
    model, inputs, y = mixed_model()
    engine = PerExampleGradientEngine(model, loss_reduction="mean")
    _step(engine, model, inputs, y)
    names = engine.parameter_names
    g = torch.Generator().manual_seed(6)
    f_head, f_rest = (torch.rand(5, generator=g, dtype=torch.float64) for _ in range(2))
    head = tuple(n for n in names if n.startswith("head."))
    rest = tuple(n for n in names if n not in head)
    grouped = engine.clipped_sum({head: f_head, rest: f_rest})
    per_name = engine.clipped_sum({n: f_head if n in head else f_rest for n in names})
    assert_close_dicts(grouped, per_name)


def test_factor_validation():
    model, inputs, y = mixed_model()
    engine = PerExampleGradientEngine(model, loss_reduction="mean")
    _step(engine, model, inputs, y)
    with pytest.raises(InvalidParameterError, match=r"factors.*shape \(5,\)"):
        engine.clipped_sum(torch.ones(4))
    with pytest.raises(InvalidParameterError, match="floating-point"):
        engine.clipped_sum(torch.ones(5, dtype=torch.int64))
    with pytest.raises(InvalidParameterError, match="every parameter"):
        engine.clipped_sum({"head.weight": torch.ones(5)})
    full = dict.fromkeys(engine.parameter_names, torch.ones(5))
    with pytest.raises(InvalidParameterError, match="unknown"):
        engine.clipped_sum({**full, "nope": torch.ones(5)})
    with pytest.raises(InvalidParameterError, match="twice"):
        engine.clipped_sum({**full, ("head.weight", "head.bias"): torch.ones(5)})
    with pytest.raises(InvalidParameterError, match="factors"):
        engine.clipped_sum([1.0] * 5)


def test_unregistered_layer_falls_back_and_logs_once(caplog):
    model, inputs, y = mixed_model()
    want = loop_per_example_grads(model, F.cross_entropy, inputs, y)
    with caplog.at_level(logging.WARNING, logger="dpledger.adapters.torch.engine"):
        engine = PerExampleGradientEngine(model, loss_reduction="mean")
        for _ in range(3):
            model.zero_grad()
            _step(engine, model, inputs, y)
            assert_close_dicts(engine.squared_norms(), squared_norms(want))
    records = [r for r in caplog.records if "generic" in r.getMessage()]
    assert len(records) == 1
    assert "scale (Scale)" in records[0].getMessage()
    assert engine.generic_modules == ("scale",)


def test_user_registered_layer_is_used():
    calls = []

    def norm_fn(module, activations, backprops):
        calls.append("norm")
        d = torch.tanh(module.w) ** 2 * 0 + (1 - torch.tanh(module.w) ** 2)
        g = (backprops * activations[0]).reshape(backprops.shape[0], -1, module.w.numel())
        return {"w": (g.sum(1) * d).square().sum(1)}

    def clipped_sum_fn(module, activations, backprops, factors):
        calls.append("sum")
        d = 1 - torch.tanh(module.w) ** 2
        g = (backprops * activations[0]).reshape(backprops.shape[0], -1, module.w.numel())
        return {"w": (factors["w"].view(-1, 1) * g.sum(1)).sum(0) * d}

    register_layer_rule(Scale, norm_fn=norm_fn, clipped_sum_fn=clipped_sum_fn)
    try:
        model, inputs, y = mixed_model()
        want = loop_per_example_grads(model, F.cross_entropy, inputs, y)
        engine = PerExampleGradientEngine(model, loss_reduction="mean")
        assert engine.generic_modules == ()
        _step(engine, model, inputs, y)
        f = torch.rand(5, dtype=torch.float64)
        assert_close_dicts(engine.squared_norms(), squared_norms(want))
        assert_close_dicts(engine.clipped_sum(f), weighted_sum(want, f))
        assert calls[:1] == ["norm"] and "sum" in calls
        # No per_example_fn: materialising (here, for per_example_gradients) uses torch.func.
        assert_close_dicts(engine.per_example_gradients(), want)
    finally:
        unregister_layer_rule(Scale)


def test_registry_rejects_bad_registrations():
    with pytest.raises(InvalidParameterError, match="module_type"):
        register_layer_rule(int, per_example_fn=lambda *a: {})
    with pytest.raises(InvalidParameterError, match="norm_fn"):
        register_layer_rule(Scale, clipped_sum_fn=lambda *a: {})
    with pytest.raises(InvalidParameterError, match="per_example_fn"):
        register_layer_rule(Scale)
    with pytest.raises(InvalidParameterError, match="callable"):
        register_layer_rule(Scale, per_example_fn="nope")
    with pytest.raises(InvalidParameterError, match="replace=True"):
        register_layer_rule(nn.Linear, per_example_fn=lambda *a: {})
    with pytest.raises(InvalidParameterError, match="applies_fn"):
        register_layer_rule(Scale, per_example_fn=lambda *a: {}, applies_fn=True)


def test_a_sampler_that_does_not_apply_leaves_the_module_to_the_generic_path():
    def per_example_fn(module, activations, backprops):
        raise AssertionError("not called for a module the sampler does not apply to")

    register_layer_rule(
        Scale, per_example_fn=per_example_fn, applies_fn=lambda m: bool(m.w.numel() > 100)
    )
    try:
        model, inputs, y = mixed_model()
        want = loop_per_example_grads(model, F.cross_entropy, inputs, y)
        engine = PerExampleGradientEngine(model, loss_reduction="mean")
        assert engine.generic_modules == ("scale",)
        _step(engine, model, inputs, y)
        assert_close_dicts(engine.per_example_gradients(), want)
    finally:
        unregister_layer_rule(Scale)


# ---------------------------------------------------------------- BatchNorm refusal


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.BatchNorm1d(4),
        lambda: nn.BatchNorm2d(4),
        lambda: nn.SyncBatchNorm(4),
        lambda: nn.LazyBatchNorm1d(),
    ],
)
def test_training_batchnorm_is_refused_with_advice(make):
    model = nn.Sequential(nn.Linear(3, 4), make())
    with pytest.raises(RecordMixingLayerError) as err:
        PerExampleGradientEngine(model, loss_reduction="mean")
    assert isinstance(err.value, ValueError) and isinstance(err.value, DPLedgerError)
    msg = str(err.value)
    assert "GroupNorm" in msg and "LayerNorm" in msg and "'1'" in msg
    with pytest.raises(RecordMixingLayerError):
        FunctionalPerExampleEngine(model, F.cross_entropy)


def test_batchnorm_without_running_stats_is_refused_even_in_eval():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, track_running_stats=False)).eval()
    with pytest.raises(RecordMixingLayerError, match="track_running_stats"):
        PerExampleGradientEngine(model, loss_reduction="mean")


def test_batchnorm_switched_back_to_training_is_refused_at_forward():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    model[1].eval()
    engine = PerExampleGradientEngine(model, loss_reduction="mean")
    model(torch.randn(2, 3)).sum().backward()
    engine.squared_norms()
    model.train()
    with pytest.raises(RecordMixingLayerError, match="training mode"):
        model(torch.randn(2, 3))
    with torch.no_grad(), pytest.raises(RecordMixingLayerError):
        model(torch.randn(2, 3))  # running statistics would learn from the batch too


def test_scale_grad_by_freq_is_refused():
    model = nn.Sequential(nn.Embedding(5, 3, scale_grad_by_freq=True))
    with pytest.raises(UnsupportedLayerError, match="scale_grad_by_freq"):
        PerExampleGradientEngine(model, loss_reduction="mean")


class _Noisy(nn.Module):
    """A module with its own parameter and dropout in its forward: a generic unit."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 3, dtype=torch.float64))

    def forward(self, x):
        return F.dropout(x * self.w, 0.5, self.training)


def _batch_masked_reference(model, x, y, seed):
    """Per-example gradients with the batch's own dropout masks: one forward, B backwards."""
    torch.manual_seed(seed)
    losses = F.cross_entropy(model(x), y, reduction="none")
    names = [n for n, _ in model.named_parameters()]
    rows = [
        torch.autograd.grad(losses[i], list(model.parameters()), retain_graph=True)
        for i in range(x.shape[0])
    ]
    return {n: torch.stack([r[k] for r in rows]) for k, n in enumerate(names)}


def test_dropout_inside_a_generic_unit_replays_the_batch_masks():
    # The generic path re-runs the unit from the random state its call started with, so the
    # per-example gradients are those of the masks the batch actually used.
    torch.manual_seed(0)
    model = nn.Sequential(_Noisy(), nn.Linear(3, 2).double())
    x = torch.randn(8, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (8,))
    want = _batch_masked_reference(model, x, y, seed=11)
    engine = PerExampleGradientEngine(model, loss_reduction="mean")
    assert engine.generic_modules == ("0",)
    torch.manual_seed(11)
    _step(engine, model, (x,), y)
    after = torch.get_rng_state()
    got = engine.per_example_gradients()
    assert_close_dicts(got, want)
    assert (got["0.w"] == 0).any() and (got["0.w"] != 0).any()  # masks really dropped entries
    assert torch.equal(torch.get_rng_state(), after)  # the replay leaves the generator alone
    model.eval()  # no randomness in evaluation mode
    model(x).sum().backward()
    assert engine.squared_norms()["0.w"].shape == (8,)


class _RootPositions(nn.Module):
    """Opacus's IMDb transformer pattern: a position tensor owned by the model itself, dropout
    0.1 at its input, in the encoder layer's nn.Dropout modules and in its attention."""

    def __init__(self, dropout=0.1):
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.pos = nn.Parameter(0.1 * torch.randn(1, 5, 8))
        self.drop = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.encoder(self.drop(self.embed(x) + self.pos)).mean(1))


def test_dropout_in_the_models_own_forward_replays_the_batch_masks_for_its_parameter():
    # The model's own parameter is a generic unit whose re-run spans the whole encoder; its
    # dropout masks must be the batch's, behind attention too.
    torch.manual_seed(0)
    model = _RootPositions().double()
    x = torch.randint(0, 20, (6, 5))
    y = torch.randint(0, 3, (6,))
    want = _batch_masked_reference(model, x, y, seed=11)
    engine = PerExampleGradientEngine(model, loss_reduction="mean")
    assert "" in engine.generic_modules
    torch.manual_seed(11)
    _step(engine, model, (x,), y)  # the first step compares with autograd's batch gradient
    after = torch.get_rng_state()
    got = engine.per_example_gradients()
    assert_close_dicts(got, want)
    assert torch.equal(torch.get_rng_state(), after)


def test_root_parameter_with_dropout_trains_with_dp_optimizer():
    from dpledger import PrivacyLedger
    from dpledger.adapters.torch import DPOptimizer

    torch.manual_seed(0)
    model = _RootPositions()
    dp = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        sampling_probability=0.1,
        population_size=100,
        seed=0,
        ledger=PrivacyLedger(),
    )
    for _ in range(2):
        x = torch.randint(0, 20, (6, 5))
        F.cross_entropy(model(x), torch.randint(0, 3, (6,))).backward()
        dp.step()
    assert dp.ledger.num_steps == 2


def test_dropout_in_a_chunked_generic_unit_draws_per_example_masks():
    # Chunks cannot replay one batch-wide draw: each example then gets its own independent
    # mask, so its gradient still depends on that example alone (its sensitivity is kept).
    torch.manual_seed(0)
    model = nn.Sequential(_Noisy())
    engine = PerExampleGradientEngine(
        model, loss_reduction="sum", generic_chunk_size=2, check_steps=0
    )
    x = torch.ones(6, 3, dtype=torch.float64)
    model(x).sum().backward()
    g = engine.per_example_gradients()["0.w"]
    # Every entry of g_i is x * mask / (1 - p) = 0 or 2; masks differ between examples.
    assert set(g.unique().tolist()) <= {0.0, 2.0}
    assert len({tuple(row.tolist()) for row in g}) > 1


def test_a_top_level_parameter_sends_only_itself_to_the_generic_path():
    # A learned position tensor owned by the model itself (Opacus's IMDB transformer): the
    # model's own parameter is differentiated generically, its layers keep their fast path.
    class WithPositions(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = nn.Parameter(torch.randn(1, 5, 4, dtype=torch.float64))
            self.inner = nn.Linear(4, 4).double()
            self.head = nn.Linear(4, 2).double()

        def forward(self, x):
            return self.head(torch.tanh(self.inner(x + self.pos)).mean(1))

    torch.manual_seed(0)
    model = WithPositions()
    x = torch.randn(6, 5, 4, dtype=torch.float64)
    y = torch.randint(0, 2, (6,))
    want = loop_per_example_grads(model, F.cross_entropy, (x,), y)
    engine = PerExampleGradientEngine(model, loss_reduction="mean", strategy="ghost")
    assert engine.generic_modules == ("",)
    _step(engine, model, (x,), y)
    assert_close_dicts(engine.squared_norms(), squared_norms(want))
    assert_close_dicts(engine.per_example_gradients(), want)
    # Both layers took the ghost-norm path; the model's unit materialised its own tensor only.
    assert [u.name for u, _ in engine._state.ghost] == ["inner", "head"]
    assert list(engine._state.per_example) == ["pos"]


# ---------------------------------------------------------------- tied and reused weights


class TiedLM(nn.Module):
    def __init__(self, outside: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(9, 4)
        self.mix = nn.Linear(4, 4)
        self.head = nn.Linear(4, 9, bias=False)
        self.head.weight = self.emb.weight
        self.outside = outside

    def forward(self, idx):
        h = torch.tanh(self.mix(self.emb(idx)))
        h = torch.tanh(self.mix(h))  # the same Linear used twice
        logits = F.linear(h, self.emb.weight) if self.outside else self.head(h)
        return logits.mean(1)


def test_tied_and_reused_weights_are_exact():
    torch.manual_seed(0)
    model = TiedLM().double()
    idx = torch.randint(0, 9, (4, 5), generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 9, (4,), generator=torch.Generator().manual_seed(1))
    want = loop_per_example_grads(model, F.cross_entropy, (idx,), y)
    assert list(want) == ["emb.weight", "mix.weight", "mix.bias"]
    for strategy in ("auto", "generic"):
        engine = PerExampleGradientEngine(model, loss_reduction="mean", strategy=strategy)
        _step(engine, model, (idx,), y)
        assert engine.parameter_names == ("emb.weight", "mix.weight", "mix.bias")
        f = torch.rand(4, dtype=torch.float64)
        assert_close_dicts(engine.squared_norms(), squared_norms(want))
        assert_close_dicts(engine.clipped_sum(f), weighted_sum(want, f))
        engine.remove()


def test_tied_weight_used_outside_a_module_forward_is_refused():
    torch.manual_seed(0)
    model = TiedLM(outside=True).double()
    idx = torch.randint(0, 9, (4, 5))
    engine = PerExampleGradientEngine(model, loss_reduction="mean")
    _step(engine, model, (idx,), torch.randint(0, 9, (4,)))
    with pytest.raises(UnsupportedParameterUseError, match=r"emb\.weight"):
        engine.squared_norms()


def test_parameter_with_gradient_but_no_observed_use_is_refused_every_step():
    class Parent(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(3, 3)  # its forward is never called
            self.out = nn.Linear(3, 2)

        def forward(self, x):
            return self.out(F.linear(x, self.inner.weight, self.inner.bias))

    model = Parent()
    engine = PerExampleGradientEngine(model, loss_reduction="mean", check_steps=0)
    model(torch.randn(4, 3)).sum().backward()
    with pytest.raises(UnsupportedParameterUseError, match=r"inner\.weight"):
        engine.squared_norms()


def test_regulariser_in_the_loss_is_caught_by_the_first_step_check():
    model = nn.Sequential(nn.Linear(3, 2)).double()
    engine = PerExampleGradientEngine(model, loss_reduction="mean")
    x = torch.randn(4, 3, dtype=torch.float64)
    loss = F.cross_entropy(model(x), torch.tensor([0, 1, 0, 1]))
    (loss + model[0].weight.square().sum()).backward()
    with pytest.raises(UnsupportedParameterUseError, match="weight decay in the optimizer"):
        engine.squared_norms()


# ---------------------------------------------------------------- modes, inputs, sizes


def test_train_eval_toggles_inputs_requiring_grad_and_inplace_ops():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(3, 5), nn.ReLU(inplace=True), nn.Dropout(0.3), nn.Linear(5, 2)
    ).double()
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 2, (6,))
    engine = PerExampleGradientEngine(model, loss_reduction="mean")
    for mode in ("eval", "train", "eval"):
        getattr(model, mode)()
        torch.manual_seed(7)
        model.zero_grad()
        _step(engine, model, (x,), y)
        norms = engine.squared_norms()
        engine.remove()
        torch.manual_seed(7)
        # dropout draws one mask for the whole batch: reproduce it, then differentiate per row
        out = model(x)
        losses = F.cross_entropy(out, y, reduction="none")
        want = {n: [] for n, _ in model.named_parameters()}
        for i in range(6):
            gs = torch.autograd.grad(losses[i], list(model.parameters()), retain_graph=True)
            for (n, _), g in zip(model.named_parameters(), gs, strict=True):
                want[n].append(g.flatten().square().sum())
        assert_close_dicts(norms, {n: torch.stack(v) for n, v in want.items()})
        engine = PerExampleGradientEngine(model, loss_reduction="mean")
    assert x.grad is not None  # the input's gradient is computed as usual


def test_batch_of_one():
    model, inputs, y = mixed_model()
    one = tuple(t[:1] for t in inputs)
    want = loop_per_example_grads(model, F.cross_entropy, one, y[:1])
    engine = PerExampleGradientEngine(model, loss_reduction="mean")
    _step(engine, model, one, y[:1])
    assert_close_dicts(engine.squared_norms(), squared_norms(want))
    assert_close_dicts(engine.clipped_sum(torch.ones(1)), weighted_sum(want, torch.ones(1)))


@pytest.mark.parametrize("strategy", ["auto", "per_example", "generic"])
def test_empty_batch(strategy):
    model, inputs, y = mixed_model()
    empty = tuple(t[:0] for t in inputs)
    engine = PerExampleGradientEngine(model, loss_reduction="sum", strategy=strategy)
    _step(engine, model, empty, y[:0], reduction="sum")
    assert engine.batch_size == 0
    norms = engine.squared_norms()
    assert all(v.shape == (0,) for v in norms.values())
    sums = engine.clipped_sum(torch.ones(0))
    for n, p in model.named_parameters():
        assert sums[n].shape == p.shape and not sums[n].any()
    engine.write_clipped_sum(torch.ones(0))
    assert all(not p.grad.any() for p in model.parameters())


def test_frozen_parameters_are_left_out():
    model, inputs, y = mixed_model()
    model.emb.weight.requires_grad_(False)
    model.head.bias.requires_grad_(False)
    want = loop_per_example_grads(model, F.cross_entropy, inputs, y)
    engine = PerExampleGradientEngine(model, loss_reduction="mean")
    assert "emb.weight" not in engine.parameter_names
    _step(engine, model, inputs, y)
    assert_close_dicts(engine.squared_norms(), squared_norms(want))


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_multihead_attention_through_the_generic_path():
    """A configuration the attention sampler leaves alone (add_zero_attn): the layer's own
    parameters take the generic path, and out_proj (used directly, never called) goes with it."""
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True, add_zero_attn=True)
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))

    model = Block().double()
    x = torch.randn(3, 4, 8, dtype=torch.float64)
    y = torch.tensor([0, 2, 1])
    want = loop_per_example_grads(model, F.cross_entropy, (x,), y)
    engine = PerExampleGradientEngine(model, loss_reduction="mean")
    assert engine.generic_modules == ("attn",)
    _step(engine, model, (x,), y)
    assert_close_dicts(engine.squared_norms(), squared_norms(want))


# ---------------------------------------------------------------- state and arguments


def test_state_errors():
    model = nn.Linear(3, 2)
    engine = PerExampleGradientEngine(model, loss_reduction="sum")
    with pytest.raises(EngineStateError, match="no forward"):
        engine.squared_norms()
    out = model(torch.randn(4, 3))
    with pytest.raises(EngineStateError, match="backward"):
        engine.squared_norms()
    out.sum().backward(retain_graph=True)
    engine.squared_norms()
    out.sum().backward()  # the step changed after its results were computed
    with pytest.raises(EngineStateError, match="again"):
        engine.squared_norms()
    engine.clear()
    with pytest.raises(EngineStateError):
        engine.backward(torch.zeros(()))
    with pytest.raises(InvalidParameterError, match="loss"):
        engine.backward(1.0)


def test_records_must_be_along_dim_zero():
    class Transposer(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Linear(4, 2)

        def forward(self, x):
            return self.b(self.a(x).transpose(0, 1).reshape(3, 4))

    model = Transposer()
    engine = PerExampleGradientEngine(model, loss_reduction="sum")
    model(torch.randn(4, 3)).sum().backward()
    with pytest.raises(EngineStateError, match="dimension 0"):
        engine.squared_norms()


def test_layers_that_all_see_positions_along_dim_zero_are_refused():
    # Every parametrised layer sees (T, B, d): without a check the T positions would be clipped
    # as T records, and one example would contribute up to T times the clip norm.
    class SequenceFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 2)

        def forward(self, x):
            return self.layer(x.transpose(0, 1)).transpose(0, 1).sum(1)

    model = SequenceFirst()
    engine = PerExampleGradientEngine(model, loss_reduction="sum")
    model(torch.randn(2, 6, 4)).sum().backward()
    with pytest.raises(EngineStateError, match="dimension 0"):
        engine.squared_norms()


def test_forward_without_grad_keeps_the_step():
    model = nn.Linear(3, 2)
    engine = PerExampleGradientEngine(model, loss_reduction="sum")
    model(torch.randn(4, 3)).sum().backward()
    with torch.no_grad():
        model(torch.randn(7, 3))
    assert engine.batch_size == 4


def test_remove_detaches_hooks():
    model = nn.Linear(3, 2)
    with PerExampleGradientEngine(model, loss_reduction="sum") as engine:
        pass
    model(torch.randn(4, 3)).sum().backward()
    with pytest.raises(EngineStateError):
        engine.squared_norms()
    assert not model._forward_hooks and not model._forward_pre_hooks


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        ({"loss_reduction": "avg"}, "loss_reduction"),
        ({"loss_reduction": "mean", "strategy": "fast"}, "strategy"),
        ({"loss_reduction": "mean", "check_steps": -1}, "check_steps"),
        ({"loss_reduction": "mean", "check_steps": True}, "check_steps"),
        ({"loss_reduction": "mean", "generic_chunk_size": 0}, "generic_chunk_size"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, parameter):
    with pytest.raises(InvalidParameterError, match=parameter):
        PerExampleGradientEngine(nn.Linear(2, 2), **kwargs)
    with pytest.raises(InvalidParameterError, match="model"):
        PerExampleGradientEngine("model", loss_reduction="mean")


def test_generic_chunk_size_gives_the_same_result():
    model, inputs, y = mixed_model()
    results = []
    for chunk in (None, 2):
        engine = PerExampleGradientEngine(
            model, loss_reduction="mean", strategy="generic", generic_chunk_size=chunk
        )
        _step(engine, model, inputs, y)
        results.append(engine.squared_norms())
        engine.remove()
    assert_close_dicts(results[0], results[1])


def test_float32_model_keeps_its_dtype():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 2))
    engine = PerExampleGradientEngine(model, loss_reduction="mean")
    x = torch.randn(5, 1, 4, 4)
    F.cross_entropy(model(x), torch.zeros(5, dtype=torch.int64)).backward()
    assert all(v.dtype == torch.float32 for v in engine.squared_norms().values())
    engine.write_clipped_sum(torch.ones(5, dtype=torch.float64))
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


def test_autocast_bfloat16_step():
    """Inputs in float32 and output gradients in bfloat16 are promoted, not refused."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(12, 3))
    x = torch.randn(6, 2, 4, 4)
    y = torch.randint(0, 3, (6,))

    def loss_fn(out, target):
        return F.cross_entropy(out.float(), target)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = loop_per_example_grads(model, loss_fn, (x,), y)
        engine = PerExampleGradientEngine(model, loss_reduction="mean")
        loss_fn(model(x), y).backward()  # the first-step check runs here too
        norms = engine.squared_norms()
    assert all(v.dtype == torch.float32 for v in norms.values())
    # per-example bfloat16 arithmetic in the loop vs batched in the step: bfloat16 has 8
    # significant bits, so agreement is to a few units of 2^-8 relative
    tol = {"rtol": 8 * 2.0**-8, "atol": 1e-3}
    assert_close_dicts(norms, squared_norms(want), **tol)


def test_bfloat16_model_computes_in_float32_and_keeps_parameter_dtype():
    model, (idx, img), y = mixed_model()
    model = model.to(torch.bfloat16)
    img = img.to(torch.bfloat16)

    def loss_fn(out, target):
        return F.cross_entropy(out.float(), target)

    want = loop_per_example_grads(model, loss_fn, (idx, img), y)
    for strategy in ("auto", "per_example"):
        engine = PerExampleGradientEngine(model, loss_reduction="mean", strategy=strategy)
        loss_fn(model(idx, img), y).backward()
        norms = engine.squared_norms()
        assert all(v.dtype == torch.float32 for v in norms.values())
        # the same bfloat16 gradients, reduced in float32 here and in bfloat16 in the reference
        tol = {"rtol": 8 * 2.0**-8, "atol": 1e-3}
        assert_close_dicts(norms, {n: v.float() for n, v in squared_norms(want).items()}, **tol)
        engine.write_clipped_sum(torch.ones(5))
        assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())
        engine.remove()
