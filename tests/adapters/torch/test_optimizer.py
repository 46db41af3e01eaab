"""DPOptimizer: the full DP step against explicit references, the ledger, and step semantics."""

from __future__ import annotations

import gc
import logging
import math
import weakref

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpledger import PrivacyLedger
from dpledger.adapters.torch import (
    DPOptimizer,
    PoissonBatchSampler,
    make_private,
    poisson_data_loader,
)
from dpledger.errors import (
    EngineStateError,
    InvalidParameterError,
    LedgerStateError,
    RecordMixingLayerError,
)
from dpledger.ledger import SamplingEvent, SumQueryEvent
from tests.adapters.torch.dp_helpers import (
    batch,
    clipped_sum,
    params_of,
    per_example,
    small_cnn,
)

Q, N = 0.05, 200  # q·n = 10
LR = 0.3


def wrap(model, opt=None, **kwargs):
    opt = opt or torch.optim.SGD(model.parameters(), lr=LR)
    kwargs.setdefault("l2_norm_bound", 1.0)
    kwargs.setdefault("noise_multiplier", 0.0)
    kwargs.setdefault("sampling_probability", Q)
    kwargs.setdefault("population_size", N)
    kwargs.setdefault("ledger", PrivacyLedger())
    return DPOptimizer(opt, model=model, **kwargs)


def one_step(model, dp, x, y, *, reduction="mean", fast=False):
    dp.zero_grad()
    loss = F.cross_entropy(model(x), y, reduction=reduction)
    if fast:
        dp.backward(loss)
    else:
        loss.backward()
    dp.step()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("fast", [False, True])
def test_zero_noise_and_no_clipping_is_the_non_private_step_over_qn(reduction, fast):
    x, y = batch(13)
    private, plain = small_cnn(), small_cnn()
    dp = wrap(private, l2_norm_bound=1e12, loss_reduction=reduction, check_steps=0)
    one_step(private, dp, x, y, reduction=reduction, fast=fast)
    opt = torch.optim.SGD(plain.parameters(), lr=LR)
    (F.cross_entropy(plain(x), y, reduction="sum") / (Q * N)).backward()
    opt.step()
    for n, p in plain.named_parameters():
        torch.testing.assert_close(dict(private.named_parameters())[n], p, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("opt_type", [torch.optim.Adam, torch.optim.AdamW])
def test_stateful_optimizers_receive_exactly_the_private_gradient(opt_type):
    x, y = batch(11)
    private, plain = small_cnn(), small_cnn()
    dp = wrap(private, opt_type(private.parameters(), lr=0.01), l2_norm_bound=1e12)
    opt = opt_type(plain.parameters(), lr=0.01)
    for _ in range(3):
        one_step(private, dp, x, y)
        opt.zero_grad()
        (F.cross_entropy(plain(x), y, reduction="sum") / (Q * N)).backward()
        opt.step()
    for n, p in plain.named_parameters():
        torch.testing.assert_close(dict(private.named_parameters())[n], p, rtol=1e-10, atol=1e-12)
    assert dp.state is dp.original_optimizer.state and len(dp.state) == len(opt.state)


CONFIGS = {
    "flat": ({}, "flat"),
    "global": ({"clipping": "global"}, "global"),
    "automatic": ({"clipping": "automatic"}, "automatic"),
    "per_layer": ({"groups": "per_layer"}, "flat"),
    "per_layer_by_dimension": ({"groups": "per_layer", "clip_split": "dimension"}, "flat"),
    "custom_groups_scaled": (
        {
            "groups": {
                "features": ["conv.weight", "conv.bias", "norm.weight", "norm.bias"],
                "head": ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"],
            },
            "scales": {"conv.weight": 2.0, "fc2.bias": 0.5},
        },
        "flat",
    ),
}


def _groups_and_bounds(dp):
    return list(dp.queries.members), [q.l2_norm_bound for q in dp.queries.queries]


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("strategy", ["auto", "generic"])
def test_full_step_equals_an_explicit_per_example_loop(config, strategy):
    kwargs, rule = CONFIGS[config]
    x, y = batch(9)
    model, ref = small_cnn(), small_cnn()
    dp = wrap(model, l2_norm_bound=2.4, strategy=strategy, **kwargs)
    before = params_of(model)
    grads = per_example(ref, x, y)
    norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in grads.values()))
    assert (norms < 2.4).any() and (norms > 2.4).any()  # some records clipped, some not
    one_step(model, dp, x, y, fast=True)
    groups, bounds = _groups_and_bounds(dp)
    want = clipped_sum(grads, groups, bounds, rule=rule, scales=kwargs.get("scales"))
    for n, p in model.named_parameters():
        expected = before[n] - LR * want[n] / (Q * N)
        torch.testing.assert_close(p.detach(), expected, rtol=1e-10, atol=1e-12)


def test_fast_and_generic_paths_give_the_same_steps_and_ledger():
    x, y = batch(16, seed=4)
    models = {s: small_cnn() for s in ("auto", "ghost", "generic")}
    ledgers = {}
    for strategy, model in models.items():
        ledgers[strategy] = PrivacyLedger()
        dp = wrap(
            model,
            strategy=strategy,
            l2_norm_bound=0.5,
            noise_multiplier=0.7,
            seed=3,
            ledger=ledgers[strategy],
        )
        for k in range(3):
            one_step(model, dp, x[k:], y[k:])
    ref = dict(models["generic"].named_parameters())
    for s in ("auto", "ghost"):
        for n, p in models[s].named_parameters():
            torch.testing.assert_close(p, ref[n], rtol=1e-9, atol=1e-11)
        assert list(ledgers[s].events()) == list(ledgers["generic"].events())


def _steps(ledger):
    return list(ledger.steps())


def test_ledger_records_q_n_and_exactly_the_bound_and_noise_used():
    x, y = batch(8)
    model = small_cnn()
    ledger = PrivacyLedger()
    dp = wrap(model, l2_norm_bound=1.5, noise_multiplier=1.1, ledger=ledger, seed=0)
    one_step(model, dp, x, y)
    dp.l2_norm_bound = 0.5
    dp.noise_multiplier = 2.0
    one_step(model, dp, x, y)
    first, second = _steps(ledger)
    assert first.sampling == SamplingEvent(Q, N)
    assert first.queries == (SumQueryEvent(1.5, 1.1 * 1.5, "gradient"),)
    assert second.queries == (SumQueryEvent(0.5, 2.0 * 0.5, "gradient"),)
    assert ledger.runs()[1].noise_multiplier == 2.0


def test_ledger_of_per_layer_groups_with_each_allocation():
    model = small_cnn()
    dims = {
        m: sum(p.numel() for n, p in model.named_parameters() if n.startswith(m + "."))
        for m in ("conv", "norm", "fc1", "fc2")
    }
    total = sum(dims.values())
    c, z = 2.0, 1.3
    for split, allocation in [("equal", "proportional"), ("dimension", "dimension")]:
        ledger = PrivacyLedger()
        dp = wrap(
            small_cnn(),
            groups="per_layer",
            clip_split=split,
            noise_allocation=allocation,
            l2_norm_bound=c,
            noise_multiplier=z,
            ledger=ledger,
            seed=0,
        )
        x, y = batch(5)
        one_step(dp.model, dp, x, y)
        (step,) = _steps(ledger)
        assert [q.label for q in step.queries] == list(dims)
        for q in step.queries:
            if split == "equal":
                s, sigma = c / 2.0, z * 2.0 * (c / 2.0)
            else:
                s = c * math.sqrt(dims[q.label] / total)
                sigma = z * math.sqrt(total / dims[q.label]) * s
            assert q.l2_norm_bound == pytest.approx(s, rel=1e-15)
            assert q.noise_stddev == pytest.approx(sigma, rel=1e-15)
        assert ledger.runs()[0].noise_multiplier == pytest.approx(z, rel=1e-12)


def test_sampler_q_and_n_are_recorded_never_one_over_len_loader():
    data = TensorDataset(*batch(40))
    loader = poisson_data_loader(data, sampling_probability=0.3, steps=2, seed=0)
    model = small_cnn()
    ledger = PrivacyLedger()
    dp = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        sampler=loader,
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        ledger=ledger,
        seed=0,
    )
    for x, y in loader:
        one_step(model, dp, x, y)
    assert [s.sampling for s in _steps(ledger)] == [SamplingEvent(0.3, 40)] * 2
    assert 1 / len(loader) != 0.3


def test_step_semantics_are_airtight(caplog):
    x, y = batch(6)
    model = small_cnn()
    ledger = PrivacyLedger()
    dp = wrap(model, ledger=ledger, noise_multiplier=1.0, seed=0)
    with pytest.raises(EngineStateError, match="without a backward"):
        dp.step()
    assert ledger.num_events == 0
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(EngineStateError, match="lost"):
        model(x)  # a second forward before step
    dp.step()
    with pytest.raises(EngineStateError, match="without a backward"):
        dp.step()  # two steps after one backward
    assert ledger.num_steps == 1
    # a skipped batch: backward, then zero_grad without step
    F.cross_entropy(model(x), y).backward()
    with caplog.at_level(logging.WARNING):
        dp.zero_grad()
    assert "skipped" in caplog.text and ledger.num_steps == 1
    with torch.no_grad():
        model(x)  # evaluation forwards are always fine
    one_step(model, dp, x, y)
    assert ledger.num_steps == 2 and ledger.num_events == 4


def test_an_error_inside_the_step_drops_it_frees_its_memory_and_training_goes_on(monkeypatch):
    # An out-of-memory error while clipping (simulated): nothing is released or recorded, the
    # stored activations are freed, and the same process steps again at a smaller batch
    # without zero_grad() in between (the retry a user makes).
    x, y = batch(6)
    model = small_cnn()
    ledger = PrivacyLedger()
    dp = wrap(model, ledger=ledger, noise_multiplier=1.0, seed=0)
    stored = []
    hook = model.fc2.register_forward_hook(lambda m, args, out: stored.append(weakref.ref(args[0])))
    engine_type = type(dp.engine)
    real = engine_type.clipped_sum

    def out_of_memory(self, factors):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(engine_type, "clipped_sum", out_of_memory)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="out of memory") as raised:
        dp.step()
    assert any("dropped before anything was released" in n for n in raised.value.__notes__)
    del raised
    gc.collect()
    assert stored and all(ref() is None for ref in stored)  # the activations were let go
    assert ledger.num_events == 0
    monkeypatch.setattr(engine_type, "clipped_sum", real)
    hook.remove()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    F.cross_entropy(model(x[:3]), y[:3]).backward()  # no zero_grad(): the retry just works
    dp.step()
    assert ledger.num_steps == 1
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())


def test_an_empty_batch_is_a_step_that_releases_pure_noise():
    model = small_cnn()
    ledger = PrivacyLedger()
    dp = wrap(model, ledger=ledger, noise_multiplier=0.0)
    x, y = batch(0)
    before = params_of(model)
    one_step(model, dp, x, y)
    assert ledger.num_steps == 1
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n])  # σ = 0: the noise-only update is zero
    dp.detach()
    noisy = wrap(model, ledger=ledger, noise_multiplier=1.0, seed=5)
    one_step(model, noisy, x, y)
    # one group: its parameters form one vector, noised with one draw of N(0, σ̃² I)
    sizes = [p.numel() for p in model.parameters()]
    gen = torch.Generator().manual_seed(5)
    noise = torch.randn(sum(sizes), generator=gen, dtype=torch.float64).split(sizes)
    for (n, p), z in zip(model.named_parameters(), noise, strict=True):
        torch.testing.assert_close(p.detach(), before[n] - LR * z.view(p.shape) / (Q * N))
    noisy.empty_step()  # for models that cannot run on zero records
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(EngineStateError, match="empty_step"):
        noisy.empty_step()
    assert ledger.num_steps == 3 and _steps(ledger)[2].queries[0].noise_stddev == 1.0


def test_poisson_loader_with_empty_batches_keeps_one_step_per_batch():
    data = TensorDataset(*batch(10))
    loader = poisson_data_loader(data, sampling_probability=0.1, steps=12, seed=3)
    model = small_cnn()
    ledger = PrivacyLedger()
    dp = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        sampler=loader,
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        ledger=ledger,
        seed=0,
    )
    sizes = []
    for x, y in loader:
        one_step(model, dp, x, y)
        sizes.append(len(y))
    assert 0 in sizes and ledger.num_steps == 12


def test_a_parameter_unfrozen_after_wrapping_is_refused():
    model = small_cnn()
    model.fc2.bias.requires_grad_(False)
    dp = wrap(model)
    model.fc2.bias.requires_grad_(True)
    x, y = batch(4)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(EngineStateError, match="frozen"):
        dp.step()


def test_a_learning_rate_scheduler_drives_the_wrapped_optimizer():
    model = small_cnn()
    dp = wrap(model)
    sched = torch.optim.lr_scheduler.StepLR(dp, step_size=1, gamma=0.5)
    x, y = batch(4)
    one_step(model, dp, x, y)
    sched.step()
    assert dp.param_groups[0]["lr"] == dp.original_optimizer.param_groups[0]["lr"] == LR / 2


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        ({"l2_norm_bound": 0.0}, "l2_norm_bound"),
        ({"l2_norm_bound": -1.0}, "l2_norm_bound"),
        ({"l2_norm_bound": math.nan}, "l2_norm_bound"),
        ({"l2_norm_bound": math.inf}, "l2_norm_bound"),
        ({"noise_multiplier": -0.5}, "noise_multiplier"),
        ({"noise_multiplier": math.nan}, "noise_multiplier"),
        ({"sampling_probability": 0.0}, "sampling_probability"),
        ({"sampling_probability": 1.5}, "sampling_probability"),
        ({"sampling_probability": math.nan}, "sampling_probability"),
        ({"population_size": 0}, "population_size"),
        ({"loss_reduction": "none"}, "loss_reduction"),
        ({"loss_reduction": "batchmean"}, "loss_reduction"),
        ({"clipping": "median"}, "clipping"),
        ({"groups": "per_block"}, "groups"),
        ({"groups": {"a": ["conv.weight"]}}, "groups"),
        ({"scales": {"conv.weight": 0.0}}, "scales['conv.weight']"),
        ({"bam_radius": 0.1}, "bam_radius"),
        ({"generator": 1}, "generator"),
        ({"generator": torch.Generator(), "seed": 1}, "seed"),
        ({"sampling_probability": None}, "sampler"),
        ({"sampler": torch.utils.data.DataLoader(range(4), batch_size=2)}, "sampler"),
        ({"clip_split": "half"}, "clip_split"),
        ({"noise_allocation": "even"}, "noise_allocation"),
        ({"clip_margin": 0.5}, "clip_margin"),
        ({"clip_margin": -0.1}, "clip_margin"),
        ({"clip_margin": True}, "clip_margin"),
    ],
)
def test_bad_arguments_are_refused_with_the_parameter_named(kwargs, parameter):
    model = small_cnn()
    if "sampler" in kwargs:
        kwargs = {**kwargs, "sampling_probability": None, "population_size": None}
    with pytest.raises(InvalidParameterError) as info:
        wrap(model, **kwargs)
    assert info.value.parameter == parameter


def test_optimizer_and_model_must_hold_the_same_parameters():
    model = small_cnn()
    partial = torch.optim.SGD(model.fc2.parameters(), lr=0.1)
    with pytest.raises(InvalidParameterError, match="requires_grad_"):
        wrap(model, partial)
    extra = torch.optim.SGD([*model.parameters(), nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(InvalidParameterError, match="not parameters of the model"):
        wrap(model, extra)
    dp = wrap(model)
    with pytest.raises(InvalidParameterError):
        wrap(model, dp)
    with pytest.raises(InvalidParameterError, match="param_group"):
        dp.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})
    with pytest.raises(LedgerStateError):
        closed = PrivacyLedger()
        closed.close()
        wrap(small_cnn(), ledger=closed)


def test_batchnorm_is_refused_by_the_wrapper_and_make_private():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(32, 3))
    with pytest.raises(RecordMixingLayerError, match="GroupNorm"):
        wrap(model)
    with pytest.raises(RecordMixingLayerError, match="LayerNorm"):
        make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            TensorDataset(*batch(10, dtype=torch.float32)),
            sampling_probability=0.5,
            l2_norm_bound=1.0,
            noise_multiplier=1.0,
        )


def test_closure_is_evaluated_before_the_step():
    model = small_cnn()
    ledger = PrivacyLedger()
    dp = wrap(model, ledger=ledger)
    x, y = batch(5)

    def closure():
        dp.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    loss = dp.step(closure)
    assert isinstance(loss, torch.Tensor) and ledger.num_steps == 1


def test_state_dict_in_the_middle_of_a_step_is_refused():
    model = small_cnn()
    dp = wrap(model)
    x, y = batch(3)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(EngineStateError, match="between steps"):
        dp.state_dict()
    dp.step()
    assert dp.state_dict()["steps_taken"] == 1


def test_loader_that_is_not_poisson_is_refused_with_advice():
    data = TensorDataset(*batch(8))
    model = small_cnn()
    with pytest.raises(InvalidParameterError, match="1/len"):
        DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model=model,
            sampler=DataLoader(data, batch_size=4),
            l2_norm_bound=1.0,
            noise_multiplier=1.0,
        )
    sampler = PoissonBatchSampler(population_size=8, sampling_probability=0.5, seed=0)
    dp = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        sampler=sampler,
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
    )
    assert dp.expected_batch_size == 4.0 and dp.sampler is sampler


def test_a_trained_model_and_its_optimizer_can_be_garbage_collected():
    model = small_cnn()
    dp = wrap(model)
    for _ in range(2):
        x, y = batch(4)
        one_step(model, dp, x, y)
    refs = [weakref.ref(model), weakref.ref(dp), weakref.ref(dp.ledger)]
    del model, dp, x, y
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


def test_hyperparameters_set_between_steps_are_validated():
    dp = wrap(small_cnn())
    for name, value in [
        ("l2_norm_bound", 0.0),
        ("l2_norm_bound", True),
        ("noise_multiplier", -1.0),
        ("noise_multiplier", math.nan),
    ]:
        with pytest.raises(InvalidParameterError) as info:
            setattr(dp, name, value)
        assert info.value.parameter == name
    with pytest.raises(InvalidParameterError, match="generator"):
        dp.generator = 3
    dp.noise_multiplier = 2.0
    dp.noise_multiplier = 0.0
    dp.noise_multiplier = 2.0
    assert dp.queries.queries[0].noise_stddev == 2.0


def test_a_bfloat16_model_steps_with_float32_sums_and_keeps_its_dtype():
    model = small_cnn(dtype=torch.bfloat16)
    dp = wrap(model, noise_multiplier=1.0, seed=0)
    x, y = batch(6, dtype=torch.bfloat16)
    before = params_of(model)
    one_step(model, dp, x, y)
    for n, p in model.named_parameters():
        assert p.dtype == p.grad.dtype == torch.bfloat16
        assert not torch.equal(p.detach(), before[n])
    assert dp.ledger.num_steps == 1


def _records_just_above(bound: float, count: int, dim: int) -> torch.Tensor:
    """float32 records whose exact norm lies in (bound, bound·(1 + 2⁻²⁵)]: a float32 norm or
    factor computation may round them to exactly the bound."""
    gen = torch.Generator().manual_seed(0)
    out = []
    while len(out) < count:
        v = torch.randn(dim, generator=gen, dtype=torch.float64)
        for k in range(-8, 9):
            w = (v / v.norm() * bound * (1 + k * 2.0**-26)).to(torch.float32)
            exact = float(w.to(torch.float64).norm())
            if bound < exact <= bound * (1 + 2.0**-25):
                out.append(w)
                break
    return torch.stack(out)


def test_float32_rounding_never_lets_a_contribution_exceed_the_bound():
    """With the default margin every released record contributes at most C (the ledger's S);
    without it, some record just above C passes unshrunk through float32 rounding."""
    bound, dim = 1.0, 64
    records = _records_just_above(bound, 48, dim)

    def contributions(margin):
        model = nn.Linear(dim, 1, bias=False)  # the gradient of record i under loss y_i is x_i
        dp = wrap(
            model,
            l2_norm_bound=bound,
            sampling_probability=1.0,
            population_size=1,
            clip_margin=margin,
        )
        norms = []
        for r in records:
            dp.zero_grad()
            model(r[None, :]).sum().backward()
            dp.step()
            norms.append(float(model.weight.grad.to(torch.float64).norm()))  # sum / (q·n = 1)
        return torch.tensor(norms, dtype=torch.float64)

    assert bool((contributions(None) <= bound).all())
    assert bool((contributions(0.0) > bound).any())


def test_default_clip_margin_follows_the_computation_dtype():
    from dpledger.mechanisms.clipping import rounding_clip_margin

    f32 = wrap(nn.Linear(3, 1))
    f64 = wrap(nn.Linear(3, 1).double())
    bf16 = wrap(nn.Linear(3, 1).to(torch.bfloat16))  # per-example work runs in float32
    assert f32._clip_margin == rounding_clip_margin(torch.finfo(torch.float32).eps)
    assert f64._clip_margin == rounding_clip_margin(torch.finfo(torch.float64).eps)
    assert bf16._clip_margin == f32._clip_margin
