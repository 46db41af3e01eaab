"""The framework-free checks both adapters run when a DP step is built."""

from __future__ import annotations

import pytest

from dpledger import PrivacyLedger
from dpledger.errors import InvalidParameterError, LedgerStateError
from dpledger.ledger import NeighboringRelation, SamplingEvent
from dpledger.mechanisms import DPConfig
from dpledger.mechanisms.construction_checks import (
    check_bias_callback,
    check_ledger,
    check_switch,
    config_with_noise,
    ledger_location,
    step_ledger,
)


def test_the_config_must_carry_a_noise_multiplier():
    config = config_with_noise(None, calibrate="x", l2_norm_bound=1.0, noise_multiplier=1.1)
    assert config == DPConfig(l2_norm_bound=1.0, noise_multiplier=1.1)
    assert config_with_noise(config, calibrate="x") is config
    target = DPConfig(l2_norm_bound=1.0, target_epsilon=2.0, delta=1e-5)
    with pytest.raises(InvalidParameterError, match="make_private calibrates") as info:
        config_with_noise(target, calibrate="make_private calibrates")
    assert info.value.parameter == "target_epsilon"
    with pytest.raises(InvalidParameterError) as info:
        config_with_noise(config, calibrate="x", clipping="global")
    assert info.value.parameter == "clipping"


def test_switches_and_callbacks():
    assert check_switch("check_record_independence", False) is False
    for bad in (1, None, "yes"):
        with pytest.raises(InvalidParameterError) as info:
            check_switch("check_record_independence", bad)
        assert info.value.parameter == "check_record_independence"
    assert check_bias_callback(None) is None and check_bias_callback(print) is print
    with pytest.raises(InvalidParameterError) as info:
        check_bias_callback("print")
    assert info.value.parameter == "bias_callback"


def test_the_ledger_is_open_and_on_rank_zero(tmp_path):
    assert check_ledger(None) is None and check_ledger(None, rank=3) is None
    ledger = PrivacyLedger()
    assert check_ledger(ledger) is ledger and ledger_location(ledger) == "(in memory)"
    with pytest.raises(InvalidParameterError) as info:
        check_ledger(ledger, rank=1)
    assert info.value.parameter == "ledger"
    with pytest.raises(InvalidParameterError) as info:
        check_ledger("run.dpl")
    assert info.value.parameter == "ledger"
    on_file = PrivacyLedger(tmp_path / "run.dpl")
    on_file.close()
    with pytest.raises(LedgerStateError, match=r"run\.dpl"):
        check_ledger(on_file)


def test_a_step_ledger_takes_the_relation_its_scheme_is_analysed_under():
    shuffled, poisson = SamplingEvent.shuffle(4, 40), SamplingEvent.poisson(0.1, 40)
    made = step_ledger(None, shuffled)
    assert made is not None and made.neighboring is NeighboringRelation.REPLACE_ONE
    made = step_ledger(None, poisson)
    assert made is not None and made.neighboring is NeighboringRelation.ADD_REMOVE
    assert step_ledger(None, poisson, rank=1) is None  # the other ranks record nothing
    given = PrivacyLedger()
    assert step_ledger(given, poisson) is given
    with pytest.raises(InvalidParameterError, match="replace"):
        step_ledger(given, shuffled)  # add/remove: not analysed for shuffled batches
