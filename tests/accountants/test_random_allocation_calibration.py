"""Noise calibration for balls-in-bins runs with the amplification of random allocation."""

from __future__ import annotations

import pytest

from dpledger.accountants import calibrate_noise_multiplier, make_accountant
from dpledger.accountants.random_allocation import random_allocation_epsilon
from dpledger.errors import InvalidParameterError


@pytest.mark.slow
def test_balls_in_bins_calibration_meets_the_target_at_the_boundary() -> None:
    """Reference: the certified bound itself at the returned z (≤ target) and 0.2% below it
    (> target); and the no-amplification calibration (rdp accountant, each epoch one Gaussian)
    needs a far larger z for the same plan."""
    result = calibrate_noise_multiplier(
        target_epsilon=2.0, delta=1e-5, num_batches=20, epochs=3, population_size=1000
    )
    z = result.value
    assert result.accountant == "random_allocation" and result.kind.value == "upper_bound"
    assert result.steps == 60 and result.sampling_probability == pytest.approx(1 / 20)
    at = random_allocation_epsilon(noise_multiplier=z, num_steps=20, epochs=3, delta=1e-5)
    below = random_allocation_epsilon(
        noise_multiplier=z / 1.002, num_steps=20, epochs=3, delta=1e-5
    )
    assert at <= 2.0 < below
    plain = calibrate_noise_multiplier(
        target_epsilon=2.0, delta=1e-5, num_batches=20, epochs=3, accountant="rdp"
    )
    assert plain.value > 2.0 * z


def test_exactly_one_sampling_is_planned() -> None:
    with pytest.raises(InvalidParameterError) as info:
        calibrate_noise_multiplier(target_epsilon=1.0, delta=1e-5, steps=10)
    assert info.value.parameter == "sampling_probability"
    with pytest.raises(InvalidParameterError) as info:
        calibrate_noise_multiplier(
            target_epsilon=1.0, delta=1e-5, sampling_probability=0.1, num_batches=10, steps=10
        )
    assert info.value.parameter == "sampling_probability"
    with pytest.raises(InvalidParameterError) as info:
        calibrate_noise_multiplier(target_epsilon=1.0, delta=1e-5, num_batches=0, steps=10)
    assert info.value.parameter == "num_batches"
    with pytest.raises(InvalidParameterError) as info:
        calibrate_noise_multiplier(
            target_epsilon=1.0, delta=1e-5, num_batches=10, steps=10, population_size=5
        )
    assert info.value.parameter == "num_batches"


@pytest.mark.slow
def test_make_private_calibrates_balls_in_bins_with_amplification() -> None:
    """make_private(sampling="balls_in_bins", target_epsilon=...) plans k = ⌈n / b⌉ batches
    per epoch and gets the amplified z of calibrate_noise_multiplier; the run's ledger then
    meets the target by the random_allocation accountant."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, TensorDataset

    from dpledger import PrivacyLedger
    from dpledger.adapters.torch import make_private

    data = TensorDataset(torch.randn(40, 3), torch.randint(0, 2, (40,)))
    model = torch.nn.Linear(3, 2)
    ledger = PrivacyLedger()
    model, dp, loader = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(data, batch_size=10),
        sampling="balls_in_bins",
        l2_norm_bound=1.0,
        target_epsilon=4.0,
        delta=1e-3,
        epochs=2,
        ledger=ledger,
    )
    want = calibrate_noise_multiplier(
        target_epsilon=4.0, delta=1e-3, num_batches=4, epochs=2, population_size=40
    )
    assert dp.noise_multiplier == want.value
    for _ in range(2):
        for x, y in loader:
            dp.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            dp.step()
    result = make_accountant("random_allocation").epsilon(ledger, delta=1e-3)
    assert result.epsilon <= 4.0
