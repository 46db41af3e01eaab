"""DPOptimizer and make_private with ``noise=`` a CorrelatedNoiseSpec.

References: each step's gradient against a float64 per-example loop (clip, sum) plus the noise
of an independent ``noise_for`` generator of the same factorization and seed; the ε of a
non-amplified release against the closed form of a μ-GDP Gaussian mechanism
(δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2), Dong, Roth & Su 2019, Corollary 2.13) and
dp-accounting's RDP accountant on the Gaussian of noise multiplier 1/μ.
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from dp_accounting import dp_event, pld, rdp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpledger.accountants import make_accountant
from dpledger.adapters.torch import (
    CyclicBatchSampler,
    DPOptimizer,
    PoissonBatchSampler,
    make_private,
    private_data_loader,
)
from dpledger.errors import (
    InvalidParameterError,
    LedgerStateError,
    NoiseStreamEndError,
    SamplerMismatchError,
)
from dpledger.ledger import PrivacyLedger
from dpledger.ledger.correlated import (
    NoiseSeedReuseError,
    NoiseStreamRollbackError,
    StreamStepEvent,
)
from dpledger.mechanisms.correlated import CorrelatedNoiseSpec, noise_for
from dpledger.mechanisms.sum_query import SensitivityCheckError
from tests.adapters.torch.reference import DEVICES
from tests.gdp_oracle import gaussian_epsilon

N, D = 24, 3


def _data(seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 0.1
    return TensorDataset(x, y)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(D, 1, bias=False).double()


def _optimizer(
    spec: CorrelatedNoiseSpec,
    *,
    seed: int | None = 5,
    lr: float = 0.0,
    device: str = "cpu",
    **kwargs: object,
) -> tuple[nn.Module, DPOptimizer, DataLoader]:
    """A fresh model on ``device``, the spec's cyclic loader (partition seed 1) and an
    optimizer with noise seed ``seed`` (None draws one); ``kwargs`` go to DPOptimizer."""
    data = _data()
    model = _model().to(device)
    sampler = CyclicBatchSampler.for_spec(spec, population_size=N, seed=1)
    loader = private_data_loader(data, sampler=sampler)
    opt = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr),
        model=model,
        l2_norm_bound=0.5,
        noise_multiplier=1.3,
        sampler=loader,
        seed=seed,
        noise=spec,
        **kwargs,  # type: ignore[arg-type]
    )
    return model, opt, loader


def _step(model: nn.Module, opt: DPOptimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad()
    F.mse_loss(model(x).squeeze(-1), y).backward()
    opt.step()


@pytest.mark.parametrize(
    "spec",
    [
        CorrelatedNoiseSpec(strategy="tree_honaker", num_steps=8, period=4),
        CorrelatedNoiseSpec(strategy="bandmf", num_steps=8, period=4, bands=3),
        CorrelatedNoiseSpec(strategy="blt", num_steps=8, period=4, buffers=2),
    ],
)
@pytest.mark.parametrize("device", DEVICES)
def test_each_step_adds_the_streams_noise_to_the_clipped_sum(
    spec: CorrelatedNoiseSpec, device: str
) -> None:
    """p.grad = (Σ_i clip_S(g_i) + w_t) / (n / period), against a float64 per-example loop
    and an independent generator of the same factorization and seed (the model on each device
    of ``DEVICES``, the reference on the CPU)."""
    model, opt, loader = _optimizer(spec, device=device)
    assert opt.ledger is not None and opt.ledger.num_events == 0
    reference = noise_for(spec.factorization(), dim=D, noise_stddev=1.3 * 0.5, seed=5)
    w = model.weight.detach().clone().reshape(-1).cpu()
    taken = 0
    for _ in range(2):
        for x, y in loader:
            _step(model, opt, x.to(device), y.to(device))
            clipped = torch.zeros(D, dtype=torch.float64)
            for xi, yi in zip(x, y, strict=True):
                g = 2.0 * (xi @ w - yi) * xi
                clipped += g * min(1.0, 0.5 / float(g.norm()))
            expected = (clipped.numpy() + reference.next()) / (N / 4)
            np.testing.assert_allclose(
                model.weight.grad.reshape(-1).cpu().numpy(), expected, rtol=1e-9, atol=1e-12
            )
            taken += 1
            # recorded once, on the first step, with the sampler's own participation
            (event,) = opt.ledger.correlated_releases
            assert opt.ledger.num_steps == 0  # no sampling or sum-query events: stream steps
            assert opt.ledger.stream_progress(0) == taken
            assert list(opt.ledger.events())[1:] == [StreamStepEvent(0, t) for t in range(taken)]
    assert taken == 8
    schema, q = loader.batch_sampler.cyclic_scheme.participation()  # type: ignore[union-attr]
    assert (event.participation, event.min_separation, event.max_participations) == (
        schema.kind.value,
        schema.min_separation,
        schema.max_participations,
    )
    assert q is None and event.sampling == "none"
    assert event.l2_norm_bound == 0.5 and event.noise_stddev == pytest.approx(0.65, rel=1e-15)
    assert event.strategy_hash == spec.factorization().strategy_hash


def test_step_t_plus_one_is_refused_before_anything_happens() -> None:
    spec = CorrelatedNoiseSpec(strategy="tree", num_steps=4, period=2)
    model, opt, loader = _optimizer(spec, lr=0.1)
    for _ in range(2):
        for x, y in loader:
            _step(model, opt, x, y)
    assert len(loader) == 0 and list(loader) == []  # the sampler has no step T + 1
    before = model.weight.detach().clone()
    x, y = _data()[:4]
    with pytest.raises(NoiseStreamEndError, match="num_steps=4"):
        _step(model, opt, x, y)
    assert torch.equal(model.weight, before)
    assert opt.ledger is not None and len(opt.ledger.correlated_releases) == 1


def test_changing_the_clip_bound_or_noise_mid_stream_is_refused() -> None:
    spec = CorrelatedNoiseSpec(strategy="tree", num_steps=8, period=4)
    model, opt, loader = _optimizer(spec, lr=0.1)
    batches = iter(loader)
    _step(model, opt, *next(batches))
    before = model.weight.detach().clone()
    for name, value in (("l2_norm_bound", 0.25), ("noise_multiplier", 0.5)):
        setattr(opt, name, value)
        with pytest.raises(InvalidParameterError, match=r"one\s+clip bound"):
            _step(model, opt, *next(batches))  # refused before its draw is claimed
        setattr(opt, name, {"l2_norm_bound": 0.5, "noise_multiplier": 1.3}[name])
        batches = iter(loader)  # a new pass: step 1's batch again
    assert torch.equal(model.weight, before)
    _step(model, opt, *next(batches))  # step 1 with the release's values
    assert opt.ledger is not None and len(opt.ledger.correlated_releases) == 1


def test_the_sensitivity_check_runs_before_the_release_is_recorded() -> None:
    class Inflating(DPOptimizer):
        def clip(self, source, factors):  # type: ignore[no-untyped-def]
            return {k: s * 100.0 for k, s in super().clip(source, factors).items()}

    spec = CorrelatedNoiseSpec(strategy="tree", num_steps=4, period=2)
    data = _data()
    model = _model()
    loader = private_data_loader(
        data, sampler=CyclicBatchSampler.for_spec(spec, population_size=N, seed=1)
    )
    opt = Inflating(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        l2_norm_bound=0.5,
        noise_multiplier=1.0,
        sampler=loader,
        seed=0,
        noise=spec,
    )
    x, y = next(iter(loader))
    with pytest.raises(SensitivityCheckError):
        _step(model, opt, x, y)
    assert opt.ledger is not None and opt.ledger.num_events == 0


def test_batches_not_drawn_for_the_step_are_refused() -> None:
    spec = CorrelatedNoiseSpec(strategy="tree", num_steps=8, period=4)
    model, opt, loader = _optimizer(spec)
    x, y = _data()[:5]
    with pytest.raises(SamplerMismatchError, match="drew no batch"):
        _step(model, opt, x, y)  # not the sampler's draw
    batches = iter(loader)
    first = next(batches)
    opt.zero_grad()
    F.mse_loss(model(first[0]).squeeze(-1), first[1]).backward()
    opt.zero_grad()  # the batch of step 0 is skipped
    x, y = next(batches)
    with pytest.raises(SamplerMismatchError, match="skipped"):
        _step(model, opt, x, y)  # step 1's batch cannot be step 0
    assert opt.ledger is not None and opt.ledger.num_events == 0
    for x, y in loader:  # a new pass starts at step 0 again
        _step(model, opt, x, y)
    assert len(opt.ledger.correlated_releases) == 1


def test_wrong_samplers_and_settings_are_refused_by_name() -> None:
    spec = CorrelatedNoiseSpec(strategy="tree", num_steps=8, period=4)
    data = _data()
    model = _model()

    def build(**kwargs: object) -> DPOptimizer:
        return DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model=model,
            l2_norm_bound=1.0,
            noise_multiplier=1.0,
            **kwargs,  # type: ignore[arg-type]
        )

    with pytest.raises(InvalidParameterError, match="CyclicBatchSampler"):
        build(sampler=DataLoader(data, batch_size=4), noise=spec)
    poisson = PoissonBatchSampler(population_size=N, sampling_probability=0.2, seed=0)
    with pytest.raises(InvalidParameterError, match="CyclicBatchSampler"):
        build(sampler=poisson, noise=spec)
    with pytest.raises(InvalidParameterError, match="sampling_probability"):
        build(sampling_probability=0.2, population_size=N, noise=spec)
    cyclic = CyclicBatchSampler.for_spec(spec, population_size=N, seed=0)
    with pytest.raises(InvalidParameterError, match="noise=CorrelatedNoiseSpec"):
        build(sampler=cyclic)  # independent noise cannot record a cyclic draw
    with pytest.raises(InvalidParameterError, match="noise"):
        build(sampler=cyclic, noise="correlated")
    other = CorrelatedNoiseSpec(strategy="tree", num_steps=8, period=2)
    with pytest.raises(InvalidParameterError, match="same period"):
        build(sampler=cyclic, noise=other)
    with pytest.raises(InvalidParameterError, match=r"torch\.distributed"):
        build(sampler=cyclic, noise=spec, distributed=True)  # refused, not silently local


def test_per_layer_groups_are_refused_clearly() -> None:
    spec = CorrelatedNoiseSpec(strategy="tree", num_steps=8, period=4)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1)).double()
    cyclic = CyclicBatchSampler.for_spec(spec, population_size=N, seed=0)
    with pytest.raises(InvalidParameterError, match="'all'"):
        DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model=model,
            l2_norm_bound=1.0,
            noise_multiplier=1.0,
            sampler=cyclic,
            noise=spec,
            groups="per_layer",
        )


def _run(spec: CorrelatedNoiseSpec, steps_before_save: int | None, *, seed: int = 3) -> tuple:
    """Train the whole stream; with a checkpoint after ``steps_before_save`` steps, continue
    in a fresh model, optimizer and loader loaded from it (torch.save/torch.load)."""
    model, opt, loader = _optimizer(spec, seed=seed, lr=0.05)
    ledger = opt.ledger
    taken = 0
    while taken < spec.num_steps:
        for x, y in loader:
            _step(model, opt, x, y)
            taken += 1
            if taken == steps_before_save:
                # a fresh seed for the new optimizer: the checkpoint's stream must win
                model, opt, loader = _restored(spec, _checkpoint(model, opt), ledger, seed + 100)
                break
    return model.weight.detach().clone(), ledger


@pytest.mark.parametrize(
    "spec",
    [
        CorrelatedNoiseSpec(strategy="tree_honaker", num_steps=8, period=4),
        CorrelatedNoiseSpec(
            strategy="bandmf",
            num_steps=8,
            period=4,
            bands=2,
            amplified=True,
            sampling_probability=0.6,
        ),
        CorrelatedNoiseSpec(strategy="blt", num_steps=8, period=4, buffers=2),
    ],
)
def test_a_resumed_run_continues_the_same_noise_stream_bitwise(spec: CorrelatedNoiseSpec) -> None:
    whole, ledger = _run(spec, None)
    halves, resumed_ledger = _run(spec, 3)
    assert torch.equal(whole, halves)
    assert len(ledger.correlated_releases) == len(resumed_ledger.correlated_releases) == 1
    assert ledger.correlated_releases == resumed_ledger.correlated_releases


def test_a_checkpoint_is_refused_with_a_ledger_without_its_release() -> None:
    spec = CorrelatedNoiseSpec(strategy="tree", num_steps=4, period=2)
    model, opt, loader = _optimizer(spec)
    x, y = next(iter(loader))
    _step(model, opt, x, y)
    state = opt.state_dict()
    _, fresh, _ = _optimizer(spec)
    fresh_ledger = PrivacyLedger()
    fresh._ledger = fresh_ledger  # another run's ledger
    with pytest.raises(InvalidParameterError, match="holds this model's correlated-noise"):
        fresh.load_state_dict(state)


def _checkpoint(model: nn.Module, opt: DPOptimizer) -> dict:
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _restored(
    spec: CorrelatedNoiseSpec, state: dict, ledger: PrivacyLedger, seed: int | None = 103
) -> tuple[nn.Module, DPOptimizer, DataLoader]:
    """A fresh model, optimizer (another seed) and loader on ``ledger``, loaded from
    ``state``."""
    model, opt, loader = _optimizer(spec, seed=seed, lr=0.05, ledger=ledger)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    return model, opt, loader


def _train(model: nn.Module, opt: DPOptimizer, loader: DataLoader, steps: int) -> None:
    taken = 0
    while taken < steps:
        for x, y in loader:
            _step(model, opt, x, y)
            taken += 1
            if taken == steps:
                return


def test_an_older_checkpoint_is_refused_and_the_latest_continues_bitwise() -> None:
    """Reference: the same stream trained without interruption (weights bit for bit) and the
    ledger's progress; a checkpoint at p = 2 loaded after the ledger recorded q = 5 steps would
    reuse w_2..w_4, so it is refused before anything is restored or recorded."""
    spec = CorrelatedNoiseSpec(strategy="tree_honaker", num_steps=8, period=4)
    whole, _ = _run(spec, None)
    model, opt, loader = _optimizer(spec, seed=3, lr=0.05)
    ledger = opt.ledger
    assert ledger is not None
    _train(model, opt, loader, 2)
    old = _checkpoint(model, opt)
    _train(model, opt, loader, 3)
    latest = _checkpoint(model, opt)
    assert ledger.stream_progress(0) == 5 and latest["opt"]["correlated"]["step"] == 5
    events = list(ledger.events())
    with pytest.raises(NoiseStreamRollbackError, match=r"steps 2\.\.4 .* step 5") as info:
        _restored(spec, old, ledger)
    assert (info.value.checkpoint_step, info.value.ledger_step, info.value.release) == (2, 5, 0)
    assert isinstance(info.value, LedgerStateError)
    assert list(ledger.events()) == events  # nothing recorded
    model, opt, loader = _restored(spec, latest, ledger)
    _train(model, opt, loader, 3)
    assert torch.equal(model.weight.detach(), whole)
    assert ledger.stream_progress(0) == 8 and len(ledger.correlated_releases) == 1


def test_a_checkpoint_without_the_release_index_is_checked_against_its_release() -> None:
    """A checkpoint written before the release's index was saved finds its release by its
    values (the last match) and gets the same progress check."""
    spec = CorrelatedNoiseSpec(strategy="tree", num_steps=4, period=2)
    model, opt, loader = _optimizer(spec)
    _train(model, opt, loader, 2)
    state = _checkpoint(model, opt)
    del state["opt"]["correlated"]["release"]
    _train(model, opt, loader, 1)
    assert opt.ledger is not None
    with pytest.raises(NoiseStreamRollbackError, match=r"steps 2\.\.2 "):
        _restored(spec, state, opt.ledger)
    _, resumed, _ = _restored(spec, _checkpoint(model, opt), opt.ledger)
    assert resumed.state_dict()["correlated"]["release"] == 0


def test_a_ledger_behind_the_checkpoint_is_refused() -> None:
    """A ledger that holds the release but fewer of its steps than the checkpoint took is not
    the ledger the stream recorded into."""
    spec = CorrelatedNoiseSpec(strategy="tree", num_steps=4, period=2)
    model, opt, loader = _optimizer(spec)
    _train(model, opt, loader, 3)
    state = _checkpoint(model, opt)
    other = PrivacyLedger()
    assert opt.ledger is not None
    other.record_correlated_release(opt.ledger.correlated_releases[0])
    other.record_stream_step(release=0, step=0)
    with pytest.raises(LedgerStateError, match="records only 1 steps") as info:
        _restored(spec, state, other)
    assert not isinstance(info.value, NoiseStreamRollbackError)
    assert other.stream_progress(0) == 1


def _train_digits_like(spec: CorrelatedNoiseSpec, z: float) -> PrivacyLedger:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    model, opt, loader = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.2),
        TensorDataset(x, y),
        l2_norm_bound=1.0,
        noise_multiplier=z,
        noise=spec,
        seed=0,
    )
    for _ in range(spec.num_steps // spec.period):
        for xb, yb in loader:
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
    assert opt.ledger is not None
    return opt.ledger


@pytest.mark.parametrize(
    "spec",
    [
        CorrelatedNoiseSpec(strategy="tree", num_steps=16, period=4),
        CorrelatedNoiseSpec(strategy="tree_honaker", num_steps=16, period=4),
        CorrelatedNoiseSpec(strategy="blt", num_steps=16, period=4, buffers=2),
    ],
)
def test_end_to_end_epsilon_equals_the_gaussian_of_the_releases_mu(
    spec: CorrelatedNoiseSpec, tmp_path: object
) -> None:
    """A non-amplified release is one Gaussian mechanism of μ = sens(C)·S/σ: PLD and PRV give
    its ε(δ) (closed form) within their discretisation; RDP is dp-accounting's RDP bound."""
    ledger = _train_digits_like(spec, z=3.0)
    (event,) = ledger.correlated_releases
    mu = event.sensitivity * event.l2_norm_bound / event.noise_stddev
    exact = gaussian_epsilon(mu, 1e-5)
    pld = make_accountant("pld").epsilon(ledger, delta=1e-5).epsilon
    prv = make_accountant("prv").epsilon(ledger, delta=1e-5).epsilon
    rdp_eps = make_accountant("rdp").epsilon(ledger, delta=1e-5).epsilon
    slack = 1e-9  # brentq's xtol on the closed form
    assert exact - slack <= pld <= exact + 1e-2
    assert exact - slack <= prv <= exact + 2e-2
    oracle = rdp.RdpAccountant()
    oracle.compose(dp_event.GaussianDpEvent(1.0 / mu))
    assert rdp_eps == pytest.approx(oracle.get_epsilon(1e-5), rel=2e-2)
    assert rdp_eps >= exact - slack


@pytest.mark.slow
def test_end_to_end_amplified_bandmf_equals_k_poisson_subsampled_gaussians() -> None:
    """With Poisson sampling within the bands (bands ≤ period), the release is k Poisson-
    subsampled Gaussians of noise multiplier σ/(S·max_j ‖C_j‖) (Choquette-Choo et al. 2023,
    "Amplified Banded Matrix Factorization", section 4): dp-accounting's PLD and RDP
    accountants on that composition are the oracles; ε is also at most the unamplified
    Gaussian's of μ = sens(C)·S/σ."""
    spec = CorrelatedNoiseSpec(
        strategy="bandmf", num_steps=16, period=4, bands=4, amplified=True, sampling_probability=0.5
    )
    ledger = _train_digits_like(spec, z=2.0)
    (event,) = ledger.correlated_releases
    assert event.sampling == "poisson_within_bands" and event.sampling_probability == 0.5
    assert event.max_participations == 4
    z = event.noise_stddev / (event.l2_norm_bound * event.max_column_norm)
    sampled = dp_event.PoissonSampledDpEvent(0.5, dp_event.GaussianDpEvent(z))
    pld_oracle = pld.PLDAccountant(value_discretization_interval=1e-4)
    pld_oracle.compose(sampled, 4)
    rdp_oracle = rdp.RdpAccountant()
    rdp_oracle.compose(sampled, 4)
    expected = pld_oracle.get_epsilon(1e-5)
    eps = {n: make_accountant(n).epsilon(ledger, delta=1e-5).epsilon for n in ("pld", "prv", "rdp")}
    assert eps["pld"] == pytest.approx(expected, abs=1e-2)
    assert eps["prv"] == pytest.approx(expected, abs=2e-2)
    assert eps["rdp"] == pytest.approx(rdp_oracle.get_epsilon(1e-5), rel=2e-2)
    mu = event.sensitivity * event.l2_norm_bound / event.noise_stddev
    assert eps["pld"] <= gaussian_epsilon(mu, 1e-5) + 1e-2


def test_make_private_refuses_the_arguments_the_spec_replaces() -> None:
    spec = CorrelatedNoiseSpec(strategy="tree", num_steps=8, period=4)
    model = _model()
    for kwargs in (
        {"sampling": "shuffle"},
        {"batch_size": 4},
        {"sampling_probability": 0.1},
        {"max_physical_batch_size": 2},
        {"target_epsilon": 1.0, "delta": 1e-5},
    ):
        with pytest.raises(InvalidParameterError):
            make_private(
                model,
                torch.optim.SGD(model.parameters(), lr=0.1),
                _data(),
                l2_norm_bound=1.0,
                noise_multiplier=1.0,
                noise=spec,
                **kwargs,  # type: ignore[arg-type]
            )


def test_noise_independent_is_the_default_step_bit_for_bit() -> None:
    """``noise="independent"`` is today's DP-SGD: the same parameters and the same ledger
    events as an optimizer built without ``noise=`` (reference: the default path)."""
    runs = []
    for kwargs in ({}, {"noise": "independent"}):
        model = _model()
        sampler = PoissonBatchSampler(population_size=N, sampling_probability=0.25, seed=4)
        loader = private_data_loader(_data(), sampler=sampler)
        opt = DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model=model,
            l2_norm_bound=0.5,
            noise_multiplier=1.3,
            sampler=loader,
            seed=9,
            **kwargs,  # type: ignore[arg-type]
        )
        for x, y in loader:
            _step(model, opt, x, y)
        assert opt.ledger is not None and not opt.ledger.correlated_releases
        assert "correlated" in opt.state_dict() and opt.state_dict()["correlated"] is None
        runs.append((model.weight.detach().clone(), list(opt.ledger.events())))
    assert torch.equal(runs[0][0], runs[1][0])
    assert runs[0][1] == runs[1][1] and len(runs[0][1]) > 0


def test_a_second_release_with_a_given_seed_is_refused_before_anything_is_recorded() -> None:
    """Two releases of one ledger with the same seed would add the same noise to different
    gradients; the ledger records no seeds, so a ledger that holds a release takes another
    only from a freshly drawn seed (seed=None)."""
    spec = CorrelatedNoiseSpec(strategy="tree", num_steps=4, period=2)
    model, opt, loader = _optimizer(spec, seed=7, lr=0.05)
    _train(model, opt, loader, 2)
    ledger = opt.ledger
    assert ledger is not None
    events = list(ledger.events())
    again, opt2, loader2 = _optimizer(spec, seed=7, lr=0.05, ledger=ledger)
    x, y = next(iter(loader2))
    with pytest.raises(NoiseSeedReuseError, match="seed=None") as info:
        _step(again, opt2, x, y)
    assert isinstance(info.value, LedgerStateError)
    assert list(ledger.events()) == events  # nothing recorded
    fresh, opt3, loader3 = _optimizer(spec, seed=None, lr=0.05, ledger=ledger)
    _train(fresh, opt3, loader3, 2)
    assert len(ledger.correlated_releases) == 2 and ledger.stream_progress(1) == 2


def test_a_checkpoint_from_before_the_first_step_cannot_start_a_second_release() -> None:
    """A checkpoint taken before the stream's first step holds its seed; loaded after that seed
    was used for a release in the ledger, it would repeat the release's noise, so its first
    step is refused (even though the run drew the seed itself)."""
    spec = CorrelatedNoiseSpec(strategy="tree", num_steps=4, period=2)
    model, opt, loader = _optimizer(spec, seed=None, lr=0.05)  # seed=None: drawn afresh
    before = _checkpoint(model, opt)
    _train(model, opt, loader, 2)
    ledger = opt.ledger
    assert ledger is not None and len(ledger.correlated_releases) == 1
    # a seed drawn afresh, then replaced by the checkpoint's
    restored, opt2, loader2 = _restored(spec, before, ledger, seed=None)
    x, y = next(iter(loader2))
    with pytest.raises(NoiseSeedReuseError):
        _step(restored, opt2, x, y)
    assert len(ledger.correlated_releases) == 1 and ledger.stream_progress(0) == 2


def _private_seedless(spec: CorrelatedNoiseSpec, ledger: PrivacyLedger) -> tuple:
    """make_private with noise=spec and the default seed=None: the scheme's partition and the
    noise seed are drawn from OS entropy."""
    model = _model()
    return make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        _data(),
        l2_norm_bound=0.5,
        noise_multiplier=1.3,
        noise=spec,
        ledger=ledger,
    )


@pytest.mark.parametrize(
    "spec",
    [
        CorrelatedNoiseSpec(strategy="tree_honaker", num_steps=8, period=4),
        CorrelatedNoiseSpec(
            strategy="bandmf",
            num_steps=8,
            period=4,
            bands=2,
            amplified=True,
            sampling_probability=0.6,
        ),
    ],
)
def test_a_seedless_make_private_run_resumes_bit_for_bit(
    spec: CorrelatedNoiseSpec, tmp_path: Path
) -> None:
    """Reference: the same run continued without interruption. A run of make_private(noise=spec)
    with seed=None is checkpointed after 3 steps (model and optimizer), its ledger file copied
    as it was then; the run goes on to T. A fresh make_private(seed=None), which draws another
    partition and noise seed, loads the checkpoint on the copied ledger and continues: it takes
    over the checkpoint's scheme (the batches) and noise stream, and ends with the same weights
    bit for bit and the same ledger events."""
    model, opt, loader = _private_seedless(spec, PrivacyLedger(tmp_path / "a.dpl"))
    _train(model, opt, loader, 3)
    state = _checkpoint(model, opt)
    shutil.copyfile(tmp_path / "a.dpl", tmp_path / "b.dpl")
    _train(model, opt, loader, spec.num_steps - 3)
    assert opt.ledger is not None
    whole, events = model.weight.detach().clone(), list(opt.ledger.events())

    model2, opt2, loader2 = _private_seedless(spec, PrivacyLedger(tmp_path / "b.dpl", resume=True))
    assert loader2.batch_sampler.cyclic_scheme != loader.batch_sampler.cyclic_scheme
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["opt"])
    assert loader2.batch_sampler.cyclic_scheme == loader.batch_sampler.cyclic_scheme
    _train(model2, opt2, loader2, spec.num_steps - 3)
    assert torch.equal(model2.weight.detach(), whole)
    assert opt2.ledger is not None and list(opt2.ledger.events()) == events


def test_a_checkpoint_of_another_scheme_is_still_refused() -> None:
    """Only the scheme's seed is taken over: a checkpoint of a sampler with another period,
    T, q or population is refused, naming the scheme."""
    spec = CorrelatedNoiseSpec(strategy="tree", num_steps=8, period=4)
    sampler = CyclicBatchSampler.for_spec(spec, population_size=N, seed=1)
    other = CyclicBatchSampler.for_spec(
        CorrelatedNoiseSpec(strategy="tree", num_steps=8, period=2), population_size=N, seed=1
    )
    with pytest.raises(InvalidParameterError, match="scheme"):
        sampler.load_state_dict(other.state_dict())
    fewer = CyclicBatchSampler.for_spec(spec, population_size=N - 1, seed=1)
    with pytest.raises(InvalidParameterError, match="scheme"):
        sampler.load_state_dict(fewer.state_dict())
    assert sampler.cyclic_scheme.seed == 1
