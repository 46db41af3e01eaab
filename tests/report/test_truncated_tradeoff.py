"""The trade-off view of a truncated-Poisson ledger: dp-accounting's truncated PLD counts the data
set that contains the differing record, so the neighbour with a record removed (n records) and
the one with a record added (n + 1) have different PLDs; the view takes the larger δ of the two at
every ε (the pessimistic envelope), and the attacker's TPR is computed from it."""

from __future__ import annotations

import functools
from pathlib import Path

import dp_accounting
import numpy as np
import pytest

from dpledger.accountants.pld import PldAccountant
from dpledger.ledger import PrivacyLedger, SamplingEvent
from dpledger.report import build, build_report, tradeoff
from dpledger.report import tradeoff_view as tradeoff_view_module
from dpledger.report.contents import AccountantRow
from dpledger.report.tradeoff_view import tradeoff_view

Q, N, CAP, SIGMA, STEPS = 0.2, 50, 10, 1.0, 50
DELTA = 1e-5
INTERVAL = 1e-2  # dp-accounting's truncated PLD at the default 1e-4 has a million points


@pytest.fixture(autouse=True)
def _coarse_pld(monkeypatch: pytest.MonkeyPatch) -> None:
    """The report's PLD accountant on a coarser grid (its δ(ε) stays an upper bound), so that
    both the report and dp-accounting build the truncated PLDs in well under a second."""
    coarse = functools.partial(PldAccountant, value_discretization_interval=INTERVAL)
    monkeypatch.setattr(tradeoff_view_module, "PldAccountant", coarse)
    monkeypatch.setattr(
        build, "make_accountant", lambda name, **kw: coarse(**kw) if name == "pld" else None
    )


def _ledger() -> PrivacyLedger:
    ledger = PrivacyLedger()
    for _ in range(STEPS):
        ledger.record_sample(event=SamplingEvent.truncated_poisson(Q, N, CAP))
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=SIGMA)
    return ledger


def _reference(dataset_size: int) -> dp_accounting.pld.PLDAccountant:
    """dp-accounting's PLD accountant at the report's grid, the differing record in a data set
    of ``dataset_size`` records."""
    reference = dp_accounting.pld.PLDAccountant(value_discretization_interval=INTERVAL)
    event = dp_accounting.TruncatedSubsampledGaussianDpEvent(
        dataset_size=dataset_size,
        sampling_probability=Q,
        truncated_batch_size=CAP,
        noise_multiplier=SIGMA,
    )
    return reference.compose(event, STEPS)


def test_the_view_is_the_envelope_of_both_neighbours() -> None:
    comp = _ledger().compressed()
    removed, added = _reference(N), _reference(N + 1)
    eps = PldAccountant(value_discretization_interval=INTERVAL).epsilon(comp, delta=DELTA).epsilon
    row = AccountantRow("pld", eps, "upper_bound", "upper bound", upper=eps)
    view = tradeoff_view(comp, DELTA, (row,))
    assert view.unavailable is None and view.accountant == "pld"
    assert "the neighbour with a record removed and the one with a record added" in view.basis

    def envelope(e: np.ndarray) -> np.ndarray:
        e = np.asarray(e, dtype=float).ravel()
        return np.array([max(removed.get_delta(float(x)), added.get_delta(float(x))) for x in e])

    grid = tradeoff.epsilon_grid(min(max(4.0 * eps, 1.0), 700.0), points=2001)
    deltas = envelope(grid)
    # the neighbour with a record added costs more here: a view from n alone would understate
    removed_only = np.array([removed.get_delta(float(x)) for x in grid])
    assert np.any(deltas > removed_only * (1 + 1e-3))
    expected = tradeoff.true_positive_rate(envelope, tradeoff.REPORTED_FPRS, grid, deltas=deltas)
    for (_, tpr), ref in zip(view.tpr_at_fpr, expected, strict=True):
        assert tpr == pytest.approx(ref, rel=1e-6)


def test_the_report_of_a_truncated_poisson_ledger_has_a_tradeoff_view(tmp_path: Path) -> None:
    path = tmp_path / "truncated.dpl"
    with PrivacyLedger(path) as ledger:
        for _ in range(STEPS):
            ledger.record_sample(event=SamplingEvent.truncated_poisson(Q, N, CAP))
            ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=SIGMA)
    report = build_report(path, delta=DELTA, accountants=["pld"], curve_points=1)
    view = report.tradeoff
    assert view is not None and view.unavailable is None and view.accountant == "pld"
    assert len(view.tpr_at_fpr) == len(tradeoff.REPORTED_FPRS)
