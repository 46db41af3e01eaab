"""Calibration: round trips to 0.1%, the ε ≤ target guarantee, unreachable targets, inputs."""

from __future__ import annotations

import math

import pytest

from dpledger.accountants.base import Accountant, ResultKind
from dpledger.accountants.calibration import (
    calibrate_noise_multiplier,
    calibrate_sampling_probability,
    calibrate_steps,
    steps_per_epoch,
)
from dpledger.accountants.gdp import GdpAccountant
from dpledger.accountants.pld import PldAccountant
from dpledger.accountants.rdp import RdpAccountant
from dpledger.errors import InvalidParameterError
from dpledger.ledger.steps import CompressedLedger

DELTA = 1e-5


def _eps(acc: Accountant, q: float, z: float, t: int) -> float:
    return acc.epsilon(CompressedLedger.from_runs([(q, z, t)]), delta=DELTA).epsilon


@pytest.mark.parametrize("z0", [0.8, 1.1, 2.5, 7.0])
def test_noise_multiplier_round_trip(z0: float) -> None:
    q, t = 0.01, 1000
    target = _eps(RdpAccountant(), q, z0, t)
    result = calibrate_noise_multiplier(
        target_epsilon=target, delta=DELTA, sampling_probability=q, steps=t, accountant="rdp"
    )
    assert result.parameter == "noise_multiplier" and result.kind is ResultKind.UPPER_BOUND
    assert result.value == pytest.approx(z0, rel=1e-3)
    # the guarantee, checked with a fresh accountant, and the boundary within 0.1%
    assert _eps(RdpAccountant(), q, result.value, t) <= target
    assert _eps(RdpAccountant(), q, result.value / 1.001, t) > target
    assert result.epsilon <= target and result.noise_multiplier == result.value


def test_noise_multiplier_round_trip_with_pld() -> None:
    acc = PldAccountant(value_discretization_interval=1e-3)
    target = _eps(acc, 0.05, 1.3, 100)
    result = calibrate_noise_multiplier(
        target_epsilon=target, delta=DELTA, sampling_probability=0.05, steps=100, accountant=acc
    )
    assert result.value == pytest.approx(1.3, rel=1e-3)
    assert _eps(acc, 0.05, result.value, 100) <= target
    assert result.accountant == "pld"


@pytest.mark.parametrize("q0", [1e-3, 0.02, 0.3])
def test_sampling_probability_round_trip(q0: float) -> None:
    z, t = 1.2, 500
    target = _eps(RdpAccountant(), q0, z, t)
    result = calibrate_sampling_probability(
        target_epsilon=target, delta=DELTA, noise_multiplier=z, steps=t, accountant="rdp"
    )
    assert result.value == pytest.approx(q0, rel=1e-3)
    assert _eps(RdpAccountant(), result.value, z, t) <= target
    assert _eps(RdpAccountant(), result.value * 1.001, z, t) > target


@pytest.mark.parametrize("t0", [1, 37, 1000, 25_000])
def test_steps_round_trip_is_exact(t0: int) -> None:
    q, z = 0.01, 1.0
    target = _eps(RdpAccountant(), q, z, t0)
    result = calibrate_steps(
        target_epsilon=target,
        delta=DELTA,
        noise_multiplier=z,
        sampling_probability=q,
        accountant="rdp",
    )
    assert result.value == t0 and isinstance(result.value, int)
    assert _eps(RdpAccountant(), q, z, t0 + 1) > target


def test_whole_bracket_meeting_the_target() -> None:
    full = calibrate_sampling_probability(
        target_epsilon=50.0, delta=DELTA, noise_multiplier=1.0, steps=10
    )
    assert full.value == 1.0 and full.warnings == ()
    capped = calibrate_steps(
        target_epsilon=5.0,
        delta=DELTA,
        noise_multiplier=5.0,
        sampling_probability=0.001,
        max_steps=1000,
    )
    assert capped.value == 1000 and capped.warnings
    low = calibrate_noise_multiplier(
        target_epsilon=5.0, delta=DELTA, sampling_probability=0.01, steps=10, bracket=(2.0, 9.0)
    )
    assert low.value == 2.0 and "below the bracket" in low.warnings[0]


def test_unreachable_targets_raise_typed_errors() -> None:
    with pytest.raises(InvalidParameterError, match="target_epsilon"):
        calibrate_noise_multiplier(
            target_epsilon=0.01,
            delta=DELTA,
            sampling_probability=0.5,
            steps=1000,
            bracket=(0.5, 2.0),
        )
    with pytest.raises(InvalidParameterError, match="target_epsilon"):
        calibrate_sampling_probability(
            target_epsilon=0.1, delta=DELTA, noise_multiplier=0.5, steps=1000, bracket=(0.1, 1.0)
        )
    with pytest.raises(InvalidParameterError, match="target_epsilon"):
        calibrate_steps(
            target_epsilon=0.01, delta=DELTA, noise_multiplier=0.5, sampling_probability=1.0
        )
    with pytest.raises(InvalidParameterError, match="target_epsilon"):
        calibrate_noise_multiplier(
            target_epsilon=1e-9, delta=DELTA, sampling_probability=1.0, steps=10**6
        )


def test_approximations_need_an_explicit_opt_in() -> None:
    kwargs = {"target_epsilon": 2.0, "delta": DELTA, "sampling_probability": 0.01, "steps": 1000}
    with pytest.raises(InvalidParameterError, match="accountant"):
        calibrate_noise_multiplier(accountant="gdp", **kwargs)
    labelled = calibrate_noise_multiplier(
        accountant=GdpAccountant(lower_bound=False), allow_approximation=True, **kwargs
    )
    assert labelled.kind is ResultKind.APPROXIMATION
    assert any("not a valid upper bound" in w for w in labelled.warnings)
    # full batch: GDP is exact, so no opt-in is needed
    exact = calibrate_noise_multiplier(
        target_epsilon=2.0, delta=DELTA, sampling_probability=1.0, steps=10, accountant="gdp"
    )
    assert exact.kind is ResultKind.UPPER_BOUND and exact.warnings == ()


def test_replace_one_calibration_uses_twice_the_sensitivity() -> None:
    add_remove = calibrate_noise_multiplier(
        target_epsilon=1.0, delta=DELTA, sampling_probability=1.0, steps=10
    )
    replace = calibrate_noise_multiplier(
        target_epsilon=1.0,
        delta=DELTA,
        sampling_probability=1.0,
        steps=10,
        neighboring="replace_one",
    )
    assert replace.value == pytest.approx(2 * add_remove.value, rel=2e-3)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"target_epsilon": 0.0}, "target_epsilon"),
        ({"target_epsilon": -1.0}, "target_epsilon"),
        ({"target_epsilon": math.inf}, "target_epsilon"),
        ({"target_epsilon": math.nan}, "target_epsilon"),
        ({"delta": 0.0}, "delta"),
        ({"delta": 1.0}, "delta"),
        ({"sampling_probability": 0.0}, "sampling_probability"),
        ({"sampling_probability": 1.5}, "sampling_probability"),
        ({"steps": 0}, "steps"),
        ({"steps": 2.5}, "steps"),
        ({"bracket": (2.0, 1.0)}, "bracket"),
        ({"bracket": "ab"}, "bracket"),
        ({"bracket": (0.0, 1.0)}, "bracket"),
        ({"accountant": "moments"}, "accountant"),
        ({"neighboring": "swap"}, "neighboring"),
    ],
)
def test_bad_inputs_are_rejected(kwargs: dict, name: str) -> None:
    args = {"target_epsilon": 1.0, "delta": DELTA, "sampling_probability": 0.01, "steps": 100}
    args.update(kwargs)
    with pytest.raises(InvalidParameterError, match=name):
        calibrate_noise_multiplier(**args)


def test_result_to_dict_is_json_ready() -> None:
    result = calibrate_steps(
        target_epsilon=1.0, delta=DELTA, noise_multiplier=1.0, sampling_probability=0.01
    )
    d = result.to_dict()
    assert d["kind"] == "upper_bound" and d["parameter"] == "steps" and d["value"] == result.steps
    assert d["evaluations"] >= 2 and d["seconds"] >= 0.0


@pytest.mark.parametrize(
    ("q", "t", "target"), [(0.01, 1000, 1.0), (0.1, 30, 3.0), (0.004, 10_000, 8.0)]
)
@pytest.mark.slow
def test_the_default_calibrates_on_prvs_upper_bound_and_an_independent_pld_agrees(
    q: float, t: int, target: float
) -> None:
    from dpledger.accountants.prv import PrvAccountant

    result = calibrate_noise_multiplier(
        target_epsilon=target, delta=DELTA, sampling_probability=q, steps=t
    )
    assert result.accountant == "prv" and result.kind is ResultKind.UPPER_BOUND
    z = result.value
    # the PRV accountant's certified upper bound, recomputed by a fresh accountant
    prv = PrvAccountant().epsilon(CompressedLedger.from_runs([(q, z, t)]), delta=DELTA)
    assert prv.upper is not None and prv.upper <= target
    # an independent oracle: dp-accounting's PLD (connect-the-dots, pessimistic), run directly
    assert _dp_accounting_pld_epsilon(q, z, t) <= target
    # and z is tighter than RDP's: the noise the old default asked for is larger
    rdp = calibrate_noise_multiplier(
        target_epsilon=target, delta=DELTA, sampling_probability=q, steps=t, accountant="rdp"
    )
    assert z < rdp.value


def _dp_accounting_pld_epsilon(q: float, z: float, t: int) -> float:
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant

    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    event = dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z)), t
    )
    accountant.compose(event)
    return float(accountant.get_epsilon(DELTA))


def test_a_run_planned_in_epochs_has_round_one_over_q_steps_each() -> None:
    assert [steps_per_epoch(q) for q in (0.1, 0.3, 0.6, 1.0)] == [10, 3, 2, 1]
    common = {"target_epsilon": 3.0, "delta": 1e-5, "sampling_probability": 0.1}
    rdp = RdpAccountant()
    by_epochs = calibrate_noise_multiplier(**common, epochs=3, accountant=rdp)
    assert by_epochs.steps == 30
    assert by_epochs.value == calibrate_noise_multiplier(**common, steps=30, accountant=rdp).value
    assert calibrate_noise_multiplier(**common, epochs=0.01, accountant=rdp).steps == 1


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({}, "steps"),
        ({"steps": 10, "epochs": 1.0}, "steps"),
        ({"epochs": 0.0}, "epochs"),
        ({"epochs": math.inf}, "epochs"),
    ],
)
def test_the_planned_run_has_exactly_one_length(kwargs: dict, name: str) -> None:
    with pytest.raises(InvalidParameterError) as info:
        calibrate_noise_multiplier(
            target_epsilon=3.0, delta=1e-5, sampling_probability=0.1, **kwargs
        )
    assert info.value.parameter == name
    with pytest.raises(InvalidParameterError) as info:
        steps_per_epoch(0.0)
    assert info.value.parameter == "sampling_probability"
