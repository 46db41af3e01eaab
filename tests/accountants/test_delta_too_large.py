"""δ ≥ 1/n is warned about, once per call, by the calibration, the accountants and the CLI."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from dpledger import PrivacyLedger
from dpledger.accountants import RdpAccountant, calibrate_noise_multiplier
from dpledger.cli import main
from dpledger.errors import DeltaTooLargeWarning
from dpledger.validation import delta_too_large_message

MESSAGE = (
    "delta=0.001 is at least 1/n = 1/1000 (population_size=1000): publishing one random record "
    "in the clear is (0, 1/n)-DP, so this δ does not rule out leaking a record; the usual advice "
    "is δ ≪ 1/n, e.g. δ ≤ 1/(10n) = 0.0001"
)


def _ledger(n: int = 1000) -> PrivacyLedger:
    ledger = PrivacyLedger()
    for _ in range(5):
        ledger.record_sample(sampling_probability=0.01, population_size=n)
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0, label="grad")
    return ledger


def test_the_message_names_delta_and_n_and_the_advice() -> None:
    assert delta_too_large_message(1e-3, 1000) == MESSAGE
    assert delta_too_large_message(0.5e-3, 1000) is None
    assert delta_too_large_message(2e-3, 1000) is not None


def test_an_accountant_warns_once_when_the_ledger_knows_n() -> None:
    with pytest.warns(DeltaTooLargeWarning) as caught:
        RdpAccountant().epsilon(_ledger(), delta=1e-3)
    assert [str(w.message) for w in caught] == [MESSAGE]
    assert caught[0].message.delta == 1e-3 and caught[0].message.population_size == 1000
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeltaTooLargeWarning)
        RdpAccountant().epsilon(_ledger(), delta=1e-5)  # δ < 1/n: silent


def test_the_warning_does_not_change_the_number() -> None:
    with pytest.warns(DeltaTooLargeWarning):
        warned = RdpAccountant().epsilon(_ledger(), delta=1e-3).epsilon
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeltaTooLargeWarning)
        assert RdpAccountant().epsilon(_ledger(), delta=1e-3).epsilon == warned


def test_calibration_warns_when_given_n_only() -> None:
    kwargs = {"target_epsilon": 2.0, "delta": 1e-3, "sampling_probability": 0.01, "steps": 100}
    with pytest.warns(DeltaTooLargeWarning) as caught:
        warned = calibrate_noise_multiplier(population_size=1000, **kwargs)
    assert [str(w.message) for w in caught] == [MESSAGE]
    assert caught[0].filename == __file__  # points at the caller
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeltaTooLargeWarning)
        assert calibrate_noise_multiplier(**kwargs).value == warned.value


def test_cli_epsilon_warns_before_the_results(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = tmp_path / "run.dpl"
    with PrivacyLedger(path) as ledger:
        ledger.record_sample(sampling_probability=0.01, population_size=1000)
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0, label="grad")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeltaTooLargeWarning)  # printed, not warned
        assert main(["epsilon", str(path), "--delta", "1e-3", "--accountant", "rdp,pld"]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("dpledger epsilon: warning: delta=0.001 is at least 1/n") == 1
    assert "1 steps" in captured.out


def test_cli_calibrate_warns_with_population_size(capsys: pytest.CaptureFixture) -> None:
    args = ["calibrate", "--target-epsilon", "2", "--delta", "1e-3", "--sampling-probability"]
    args += ["0.01", "--steps", "100", "--population-size", "1000"]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert captured.err == f"dpledger calibrate: warning: {MESSAGE}\n"
    assert captured.out.startswith("noise multiplier: ")
