"""Interop: GDP as a dp-accounting PrivacyAccountant, ledgers from Opacus histories."""

from __future__ import annotations

import math

import dp_accounting
import pytest

from dpledger.accountants.base import ResultKind
from dpledger.accountants.gdp import GdpAccountant, gdp_epsilon
from dpledger.accountants.interop import (
    GdpPrivacyAccountant,
    LedgerBackedPrivacyAccountant,
    ledger_from_opacus_history,
)
from dpledger.accountants.rdp import RdpAccountant
from dpledger.errors import InvalidParameterError
from dpledger.ledger.steps import CompressedLedger

DELTA = 1e-5
Rel = dp_accounting.NeighboringRelation


def _sampled(q: float, z: float) -> dp_accounting.DpEvent:
    return dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))


def test_is_a_dp_accounting_accountant_and_matches_the_ledger_answer() -> None:
    acc = GdpPrivacyAccountant(lower_bound=False)
    assert isinstance(acc, dp_accounting.PrivacyAccountant)
    event = dp_accounting.ComposedDpEvent(
        [
            dp_accounting.SelfComposedDpEvent(_sampled(0.01, 1.0), 100),
            dp_accounting.NoOpDpEvent(),
            dp_accounting.GaussianDpEvent(5.0),
        ]
    )
    acc.compose(event, count=2)
    ledger = CompressedLedger.from_runs([(0.01, 1.0, 100), (1.0, 5.0, 1)] * 2)
    expected = GdpAccountant(lower_bound=False).epsilon(ledger, delta=DELTA)
    assert acc.get_epsilon(DELTA) == pytest.approx(expected.epsilon, rel=1e-14)
    assert acc.last_result is not None and acc.last_result.kind is ResultKind.APPROXIMATION
    assert acc.get_delta(1.0) == pytest.approx(
        GdpAccountant().delta(ledger, epsilon=1.0).delta, rel=1e-14
    )
    assert acc.ledger_view().num_steps == 202


def test_full_batch_gaussians_are_exact_and_non_private_is_infinite() -> None:
    acc = GdpPrivacyAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(2.0), count=4)
    assert acc.get_epsilon(DELTA) == pytest.approx(gdp_epsilon(1.0, DELTA), rel=1e-12)
    assert acc.last_result.kind is ResultKind.UPPER_BOUND
    acc.compose(dp_accounting.NonPrivateDpEvent())
    assert acc.get_epsilon(DELTA) == math.inf
    assert GdpPrivacyAccountant().get_epsilon(DELTA) == 0.0


def test_unsupported_events_raise_dp_accountings_error() -> None:
    acc = GdpPrivacyAccountant()
    laplace = dp_accounting.LaplaceDpEvent(1.0)
    assert not acc.supports(laplace)
    with pytest.raises(dp_accounting.UnsupportedEventError):
        acc.compose(dp_accounting.ComposedDpEvent([_sampled(0.1, 1.0), laplace]))
    with pytest.raises(dp_accounting.UnsupportedEventError):
        acc.compose(dp_accounting.PoissonSampledDpEvent(0.1, laplace))
    assert acc.ledger_view().num_steps == 0  # nothing was composed


def test_replace_one() -> None:
    acc = GdpPrivacyAccountant(neighboring_relation=Rel.REPLACE_ONE)
    with pytest.raises(dp_accounting.UnsupportedEventError):
        acc.compose(_sampled(0.1, 1.0))
    acc.compose(dp_accounting.GaussianDpEvent(4.0))
    assert acc.get_epsilon(DELTA) == pytest.approx(gdp_epsilon(0.5, DELTA), rel=1e-12)
    with pytest.raises(InvalidParameterError, match="neighboring_relation"):
        GdpPrivacyAccountant(neighboring_relation=Rel.REPLACE_SPECIAL)
    with pytest.raises(InvalidParameterError, match="accountant"):
        LedgerBackedPrivacyAccountant("gdp")  # type: ignore[arg-type]


def test_other_accountants_can_back_the_interface() -> None:
    acc = LedgerBackedPrivacyAccountant(RdpAccountant())
    acc.compose(_sampled(0.01, 1.0), count=1000)
    oracle = dp_accounting.rdp.RdpAccountant()
    oracle.compose(_sampled(0.01, 1.0), count=1000)
    assert acc.get_epsilon(DELTA) == pytest.approx(oracle.get_epsilon(DELTA), rel=1e-6)


def test_ledger_from_opacus_history() -> None:
    history = [(1.1, 0.004, 100), (1.1, 0.004, 50), (0.9, 0.01, 7)]  # (z, q, steps)
    ledger = ledger_from_opacus_history(history)
    assert ledger == CompressedLedger.from_runs([(0.004, 1.1, 150), (0.01, 0.9, 7)])
    replace = ledger_from_opacus_history([(2.0, 1.0, 3)], neighboring="replace_one")
    assert replace.neighboring.value == "replace_one"
    for bad in ([(1.0, 0.1)], [None], [(1.0, 2.0, 3)], [(1.0, 0.1, 0)], [(-1.0, 0.1, 3)]):
        with pytest.raises(InvalidParameterError):
            ledger_from_opacus_history(bad)  # type: ignore[arg-type]


@pytest.mark.slow
def test_opacus_history_gives_opacus_rdp_epsilon() -> None:
    opacus_rdp = pytest.importorskip("opacus.accountants.rdp")
    peer = opacus_rdp.RDPAccountant()
    for _ in range(30):
        peer.step(noise_multiplier=1.1, sample_rate=0.004)
    for _ in range(20):
        peer.step(noise_multiplier=0.9, sample_rate=0.01)
    ledger = ledger_from_opacus_history(peer.history)
    assert ledger.num_steps == 50
    ours = RdpAccountant(orders=peer.DEFAULT_ALPHAS).epsilon(ledger, delta=DELTA).epsilon
    assert ours == pytest.approx(peer.get_epsilon(delta=DELTA), rel=1e-6)
