"""Checkpoints: optimizer state, generators and the ledger position travel together."""

from __future__ import annotations

import gc
import itertools
import logging

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch.utils.data import TensorDataset

from dpledger import PrivacyLedger
from dpledger.accountants import RdpAccountant
from dpledger.adapters.torch import make_private
from dpledger.errors import InvalidParameterError, LedgerStateError
from tests.adapters.torch.dp_helpers import batch, small_cnn
from tests.adapters.torch.reference import DEVICES

DATA = TensorDataset(*batch(60, seed=2))


def setup(ledger: PrivacyLedger, seed: int, device: str = "cpu"):
    model = small_cnn().to(device)
    return make_private(
        model,
        torch.optim.Adam(model.parameters(), lr=0.01),
        DATA,
        sampling_probability=0.1,
        l2_norm_bound=1.0,
        noise_multiplier=1.1,
        ledger=ledger,
        seed=seed,
    )


def train(model, optimizer, loader, steps: int, device: str = "cpu") -> None:
    batches = itertools.chain.from_iterable(itertools.repeat(loader))
    for x, y in itertools.islice(batches, steps):
        optimizer.zero_grad()
        F.cross_entropy(model(x.to(device)), y.to(device)).backward()
        optimizer.step()


def save(path, model, optimizer) -> None:
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)


def resume(ledger_path, checkpoint, device: str = "cpu"):
    ledger = PrivacyLedger(ledger_path, resume=True)
    # a different seed: the state overrides it
    model, optimizer, loader = setup(ledger, seed=999, device=device)
    state = torch.load(checkpoint, weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return ledger, model, optimizer, loader


@pytest.mark.parametrize("device", DEVICES)
def test_resumed_run_continues_the_ledger_and_spends_the_same_epsilon(tmp_path, device):
    """Bit for bit on each device: the noise generator's state (a CUDA generator on CUDA)
    travels in the optimizer's state dict."""
    full_ledger = PrivacyLedger(tmp_path / "full.dpl")
    model, optimizer, loader = setup(full_ledger, seed=5, device=device)
    train(model, optimizer, loader, 8, device)
    full_ledger.close()
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}

    path = tmp_path / "run.dpl"
    ledger = PrivacyLedger(path)
    model, optimizer, loader = setup(ledger, seed=5, device=device)
    optimizer.enable_bit_for_bit_resume()  # the explicit opt-in: generator states saved
    train(model, optimizer, loader, 3, device)
    save(tmp_path / "ckpt.pt", model, optimizer)
    del model, optimizer, loader, ledger  # the process ends (no close marker)
    gc.collect()

    ledger, model, optimizer, loader = resume(path, tmp_path / "ckpt.pt", device)
    assert optimizer.steps_taken == 3 and ledger.num_steps == 3
    train(model, optimizer, loader, 5, device)
    ledger.close()

    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), reference[n], rtol=0, atol=0)
    full, resumed = PrivacyLedger.load(tmp_path / "full.dpl"), PrivacyLedger.load(path)
    assert list(resumed.events()) == list(full.events())
    eps_full = RdpAccountant().epsilon(full, delta=1e-5).epsilon
    assert RdpAccountant().epsilon(resumed, delta=1e-5).epsilon == eps_full


def test_steps_recorded_after_the_checkpoint_stay_in_the_ledger(tmp_path, caplog):
    path = tmp_path / "run.dpl"
    ledger = PrivacyLedger(path)
    model, optimizer, loader = setup(ledger, seed=1)
    train(model, optimizer, loader, 3)
    save(tmp_path / "ckpt.pt", model, optimizer)
    train(model, optimizer, loader, 2)  # training went on, then the process died
    ledger.flush()
    del model, optimizer, loader, ledger
    gc.collect()

    with caplog.at_level(logging.WARNING):
        ledger, model, optimizer, loader = resume(path, tmp_path / "ckpt.pt")
    assert "2 steps recorded after this checkpoint" in caplog.text
    assert ledger.num_steps == 5  # never dropped: their noise was drawn
    train(model, optimizer, loader, 1)
    assert ledger.num_steps == 6 and optimizer.steps_taken == 4
    ledger.close()


def released_gradients(model, optimizer, loader, steps: int) -> list[dict]:
    """Train ``steps`` steps; return each step's sample and the gradient it released."""
    out = []
    batches = itertools.chain.from_iterable(itertools.repeat(loader))
    for x, y in itertools.islice(batches, steps):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        out.append({"x": x.clone(), "grads": grads})
    return out


def test_resuming_behind_the_ledger_draws_fresh_noise_and_samples(tmp_path):
    # The steps taken after the checkpoint are in the ledger and their results may have been
    # seen. Replaying their noise (and their Poisson samples) from the checkpoint's generator
    # states would release the same noise twice: the difference of two such releases is free
    # of noise, and the ledger would count them as independent Gaussian steps.
    path = tmp_path / "run.dpl"
    ledger = PrivacyLedger(path)
    model, optimizer, loader = setup(ledger, seed=1)
    optimizer.enable_bit_for_bit_resume()  # even with the states in the checkpoint
    train(model, optimizer, loader, 3)
    save(tmp_path / "ckpt.pt", model, optimizer)
    lost = released_gradients(model, optimizer, loader, 2)
    ledger.flush()
    del model, optimizer, loader, ledger
    gc.collect()

    checkpoint = torch.load(tmp_path / "ckpt.pt", weights_only=False)["optimizer"]
    ledger, model, optimizer, loader = resume(path, tmp_path / "ckpt.pt")
    # Neither generator is restored to the checkpoint's state (so the samples drawn next are not
    # the lost steps' samples; comparing the batches themselves could coincide by chance, e.g.
    # two empty batches).
    sampler = loader.batch_sampler
    assert not torch.equal(
        sampler.state_dict(include_generator_state=True)["generator_state"],
        checkpoint["sampler"]["generator_state"],
    )
    assert not torch.equal(optimizer.generator.get_state(), checkpoint["noise_generator_state"])
    again = released_gradients(model, optimizer, loader, 2)
    for old, new in zip(lost, again, strict=True):
        for n in old["grads"]:  # Gaussian noise: equal only if it was drawn again
            assert not torch.equal(old["grads"][n], new["grads"][n])
    ledger.close()


def test_a_ledger_with_fewer_steps_than_the_checkpoint_is_refused(tmp_path):
    ledger = PrivacyLedger(tmp_path / "run.dpl")
    model, optimizer, loader = setup(ledger, seed=1)
    train(model, optimizer, loader, 2)
    state = optimizer.state_dict()
    assert state["ledger"]["num_steps"] == 2
    assert PrivacyLedger.load(tmp_path / "run.dpl").num_steps == 2  # flushed by state_dict()
    other = PrivacyLedger(tmp_path / "other.dpl")
    _, fresh, _ = setup(other, seed=1)
    with pytest.raises(LedgerStateError, match="holds 0 steps but the checkpoint was taken"):
        fresh.load_state_dict(state)
    with pytest.raises(InvalidParameterError, match="state_dict"):
        fresh.load_state_dict({"optimizer": {}})
    ledger.close()
    other.close()
