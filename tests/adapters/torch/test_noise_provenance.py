"""Where the noise comes from: the PyTorch entry points record it, and default checkpoints carry
neither the noise generator's state nor the batch sampler's."""

from __future__ import annotations

import io
import logging

import torch
import torch.nn.functional as F  # noqa: N812
from torch.utils.data import TensorDataset

from dpledger import PrivacyLedger
from dpledger.adapters.torch import DPOptimizer, PoissonBatchSampler, make_private
from dpledger.adapters.torch.batch_samplers import ShuffleBatchSampler
from dpledger.ledger.provenance import provenance_of
from tests.adapters.torch.dp_helpers import batch, small_cnn

DATA = TensorDataset(*batch(40, seed=2))


def _private(ledger, **kwargs):
    model = small_cnn()
    return make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DATA,
        sampling_probability=0.2,
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        ledger=ledger,
        **kwargs,
    )


def _train(model, optimizer, loader, steps: int) -> None:
    for i, (x, y) in enumerate(loader):
        if i == steps:
            return
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def _saved(state) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def test_make_private_without_a_seed_records_os_entropy_for_noise_and_sampler():
    ledger = PrivacyLedger()
    _private(ledger)
    (record,) = provenance_of(ledger.notes)
    assert record.entry_point == "torch.DPOptimizer"
    assert record.generator == "torch.Generator(cpu)"
    assert (record.seeding, record.sampler_seeding) == ("os_entropy", "os_entropy")
    assert record.checkpoint == "excluded" and record.secure_sampler is False
    assert not record.caller_seeded


def test_a_seed_or_a_generator_of_the_caller_is_recorded_as_such_never_the_seed():
    ledger = PrivacyLedger()
    _private(ledger, seed=12345)
    (record,) = provenance_of(ledger.notes)
    assert (record.seeding, record.sampler_seeding) == ("caller_seed", "caller_seed")
    assert "12345" not in str(ledger.notes)

    ledger = PrivacyLedger()
    model = small_cnn()
    DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        sampler=PoissonBatchSampler(population_size=40, sampling_probability=0.2),
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        ledger=ledger,
        generator=torch.Generator(),
    )
    (record,) = provenance_of(ledger.notes)
    assert (record.seeding, record.sampler_seeding) == ("caller_generator", "os_entropy")


def test_a_default_checkpoint_holds_no_generator_state_in_its_bytes():
    ledger = PrivacyLedger()
    model, optimizer, loader = _private(ledger, seed=3)
    _train(model, optimizer, loader, 2)
    state = optimizer.state_dict()
    saved = _saved(state)
    noise_state = optimizer.generator.get_state().numpy().tobytes()
    sampler_state = loader.batch_sampler.generator.get_state().numpy().tobytes()
    assert noise_state not in saved and sampler_state not in saved
    assert state["noise_generator_state"] is None
    assert state["sampler"] == {"generator_state": None}
    # what an opted-in checkpoint holds, for contrast: both states, byte for byte
    optimizer.enable_bit_for_bit_resume()
    opted_in = _saved(optimizer.state_dict())
    assert noise_state in opted_in and sampler_state in opted_in
    assert [r.checkpoint for r in provenance_of(ledger.notes)] == ["excluded", "included"]


def test_an_epoch_sampler_checkpoint_holds_neither_its_state_nor_its_epoch():
    sampler = ShuffleBatchSampler(population_size=17, batch_size=4, seed=1)
    next(iter(sampler))
    saved = _saved(sampler.state_dict())
    assert sampler.generator.get_state().numpy().tobytes() not in saved
    assert sampler.state_dict() == {"generator_state": None, "epoch": None}


def test_resuming_a_default_checkpoint_draws_fresh_os_states_and_records_it(tmp_path, caplog):
    path = tmp_path / "run.dpl"
    ledger = PrivacyLedger(path)
    model, optimizer, loader = _private(ledger, seed=3)
    _train(model, optimizer, loader, 2)
    state = optimizer.state_dict()
    ledger.close()

    ledger = PrivacyLedger(path, resume=True)
    _, resumed, loader = _private(ledger, seed=3)  # the same seed: not the same noise
    before = resumed.generator.get_state().clone()
    with caplog.at_level(logging.INFO, logger="dpledger"):
        resumed.load_state_dict(state)
    assert "fresh states drawn from OS entropy" in caplog.text
    assert not torch.equal(resumed.generator.get_state(), before)
    assert loader.batch_sampler.seeding == "os_entropy"
    records = provenance_of(ledger.notes)
    assert [(r.seeding, r.sampler_seeding) for r in records] == [
        ("caller_seed", "caller_seed"),  # the first session (the resumed one as built repeats it)
        ("os_entropy", "os_entropy"),  # after load_state_dict
    ]
    ledger.close()
    on_file = provenance_of(PrivacyLedger.load(path).notes)
    assert on_file == records


def test_the_generator_setter_records_a_caller_generator():
    ledger = PrivacyLedger()
    _, optimizer, _ = _private(ledger)
    optimizer.generator = torch.Generator().manual_seed(0)
    assert provenance_of(ledger.notes)[-1].seeding == "caller_generator"


def test_secure_noise_records_the_grids_sensitivity_and_a_secure_provenance():
    from dpledger.adapters.torch.backend import TorchSecureNoise
    from dpledger.mechanisms import DPConfig

    ledger = PrivacyLedger()
    model = small_cnn()
    model, optimizer, loader = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DATA,
        sampling_probability=0.2,
        config=DPConfig(l2_norm_bound=1.0, noise_multiplier=1.0, secure_noise=True),
        ledger=ledger,
    )
    _train(model, optimizer, loader, 1)
    d = sum(p.numel() for p in model.parameters())
    (query,) = [e for e in ledger.events() if hasattr(e, "noise_stddev")]
    assert query.l2_norm_bound == 1.0 + 2.0**-30 * d**0.5
    (record,) = provenance_of(ledger.notes)
    assert record.secure_sampler and record.seeding == "os_entropy"
    noisy = TorchSecureNoise().add_gaussian_noise(
        torch.linspace(-1, 1, 100, dtype=torch.float64), stddev=1.0, generator=None
    )
    steps = noisy * 2.0**30
    assert torch.equal(steps, torch.round(steps))


def test_a_distributed_sampler_seeded_by_rank_0_from_the_os_says_os_entropy():
    from dpledger.adapters.torch import DistributedPoissonBatchSampler

    def make(seed):
        return DistributedPoissonBatchSampler(
            population_size=40, sampling_probability=0.2, rank=0, world_size=2, seed=seed
        )

    assert make(None).seeding == "os_entropy"
    assert make(3).seeding == "caller_seed"
