"""PLD bridge: equal to dp-accounting's PLD accountant, distinct-run grouping, replace-one."""

from __future__ import annotations

import math

import dp_accounting
import pytest
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

from dpledger.accountants.gdp import gdp_epsilon
from dpledger.accountants.pld import PldAccountant
from dpledger.errors import InvalidParameterError, UnsupportedLedgerError
from dpledger.ledger.dp_event import compressed_to_dp_event
from dpledger.ledger.steps import CompressedLedger

DELTA = 1e-5
INTERVAL = 1e-3  # coarser than the default, to keep the tests fast; same code path


def _ledger(
    *triples: tuple[float, float, int], neighboring: str = "add_remove"
) -> CompressedLedger:
    return CompressedLedger.from_runs(triples, neighboring=neighboring)


_ADD_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE


def _oracle(
    ledger: CompressedLedger, relation: dp_accounting.NeighboringRelation = _ADD_REMOVE
) -> PLDAccountant:
    acc = PLDAccountant(neighboring_relation=relation, value_discretization_interval=INTERVAL)
    acc.compose(compressed_to_dp_event(ledger))
    return acc


@pytest.mark.parametrize(
    ("q", "z", "t"), [(0.01, 1.0, 1000), (256 / 60000, 1.1, 500), (0.3, 2.0, 7)]
)
def test_single_run_equals_dp_accounting(q: float, z: float, t: int) -> None:
    ledger = _ledger((q, z, t))
    acc = PldAccountant(value_discretization_interval=INTERVAL)
    oracle = _oracle(ledger)
    assert acc.epsilon(ledger, delta=DELTA).epsilon == pytest.approx(
        oracle.get_epsilon(DELTA),
        rel=1e-9,  # the oracle starts from an identity PLD
    )
    assert acc.delta(ledger, epsilon=1.0).delta == pytest.approx(oracle.get_delta(1.0), rel=1e-9)


def test_repeated_steps_are_grouped_and_agree_with_run_by_run_composition() -> None:
    # (0.01, 1.0) appears in two separate runs: composed once with count 300 here, twice there
    ledger = _ledger((0.01, 1.0, 100), (0.02, 1.5, 50), (0.01, 1.0, 200))
    assert len(ledger.distinct()) == 2
    ours = PldAccountant(value_discretization_interval=INTERVAL).epsilon(ledger, delta=DELTA)
    assert ours.details["distinct_runs"] == 2
    assert ours.epsilon == pytest.approx(_oracle(ledger).get_epsilon(DELTA), rel=1e-6)


def test_full_batch_steps_are_one_exact_gaussian() -> None:
    ledger = _ledger((1.0, 2.0, 3), (1.0, 5.0, 4))
    mu = math.sqrt(3 / 4 + 4 / 25)
    result = PldAccountant().epsilon(ledger, delta=DELTA)
    assert result.details["closed_form_gaussian_mu"] == pytest.approx(mu)
    assert result.epsilon == pytest.approx(gdp_epsilon(mu, DELTA), rel=1e-12)
    # dp-accounting's discretised PLD of the same Gaussians is a (slightly larger) upper bound
    oracle = _oracle(ledger).get_epsilon(DELTA)
    assert result.epsilon <= oracle <= result.epsilon + 10 * INTERVAL
    mixed = _ledger((1.0, 2.0, 3), (0.05, 1.0, 20))
    assert PldAccountant(value_discretization_interval=INTERVAL).epsilon(
        mixed, delta=DELTA
    ).epsilon == pytest.approx(_oracle(mixed).get_epsilon(DELTA), rel=1e-3)


def test_replace_one_full_batch_matches_dp_accounting_and_subsampled_is_refused() -> None:
    ledger = _ledger((1.0, 3.0, 4), neighboring="replace_one")
    oracle = _oracle(ledger, dp_accounting.NeighboringRelation.REPLACE_ONE).get_epsilon(DELTA)
    ours = PldAccountant().epsilon(ledger, delta=DELTA).epsilon
    assert ours == pytest.approx(gdp_epsilon(2.0 / 3.0 * 2.0, DELTA), rel=1e-12)  # μ = 2·√4/3
    assert ours <= oracle <= ours + 10 * INTERVAL
    with pytest.raises(UnsupportedLedgerError, match="replace-one"):
        PldAccountant().epsilon(_ledger((0.1, 3.0, 4), neighboring="replace_one"), delta=DELTA)


def test_distribution_of_a_free_ledger_is_none() -> None:
    assert PldAccountant().distribution(_ledger((0.0, 1.0, 3), (0.5, math.inf, 2))) is None


@pytest.mark.parametrize("interval", [0.0, -1e-4, 2.0, True, "1e-4", math.nan])
def test_bad_interval_is_rejected(interval: object) -> None:
    with pytest.raises(InvalidParameterError, match="value_discretization_interval"):
        PldAccountant(value_discretization_interval=interval)  # type: ignore[arg-type]
