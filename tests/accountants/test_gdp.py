"""GDP accountant: closed forms, the CLT, the certified lower bound and its warning."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_mechanism
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
from scipy.optimize import brentq

from dpledger.accountants.base import ResultKind
from dpledger.accountants.gdp import GdpAccountant, gdp_delta, gdp_epsilon, gdp_mu
from dpledger.accountants.rdp import RdpAccountant
from dpledger.errors import InvalidParameterError, UnsupportedLedgerError
from dpledger.ledger.dp_event import compressed_to_dp_event
from dpledger.ledger.steps import CompressedLedger

DELTA = 1e-5


def _ledger(
    *triples: tuple[float, float, int], neighboring: str = "add_remove"
) -> CompressedLedger:
    return CompressedLedger.from_runs(triples, neighboring=neighboring)


def _gaussian_epsilon_oracle(standard_deviation: float, delta: float) -> float:
    """ε of a Gaussian mechanism (sensitivity 1) from dp-accounting's exact privacy loss."""
    loss = privacy_loss_mechanism.GaussianPrivacyLoss(standard_deviation)
    if loss.get_delta_for_epsilon(0.0) <= delta:
        return 0.0
    return brentq(lambda e: loss.get_delta_for_epsilon(e) - delta, 0.0, 1e4, xtol=1e-13)


# --------------------------------------------------------------------------- exact cases
@pytest.mark.parametrize("z", [0.5, 1.0, 3.0, 20.0])
def test_single_full_batch_step_is_exactly_mu_gdp_with_mu_one_over_z(z: float) -> None:
    result = GdpAccountant().epsilon(_ledger((1.0, z, 1)), delta=DELTA)
    assert result.details["mu"] == pytest.approx(1.0 / z, rel=1e-15)
    assert result.kind is ResultKind.UPPER_BOUND and result.details["exact"]
    assert result.epsilon == pytest.approx(_gaussian_epsilon_oracle(z, DELTA), rel=1e-8, abs=1e-12)
    assert result.lower == result.upper == result.epsilon
    assert gdp_delta(1.0 / z, result.epsilon) <= DELTA


def test_full_batch_steps_compose_exactly() -> None:
    ledger = _ledger((1.0, 2.0, 3), (1.0, 3.0, 2), (0.0, 1.0, 7))
    mu = math.sqrt(3 / 4 + 2 / 9)
    result = GdpAccountant().epsilon(ledger, delta=DELTA)
    assert result.details["mu"] == pytest.approx(mu, rel=1e-14)
    assert result.epsilon == pytest.approx(_gaussian_epsilon_oracle(1.0 / mu, DELTA), rel=1e-8)
    d = GdpAccountant().delta(ledger, epsilon=1.0)
    assert d.kind is ResultKind.UPPER_BOUND
    oracle = privacy_loss_mechanism.GaussianPrivacyLoss(1.0 / mu).get_delta_for_epsilon(1.0)
    assert d.delta == pytest.approx(oracle, rel=1e-9)


# --------------------------------------------------------------------------- CLT
def test_subsampled_steps_use_the_clt_and_are_labelled_approximation() -> None:
    q, z, t = 256 / 60_000, 1.1, 14_062
    result = GdpAccountant().epsilon(_ledger((q, z, t)), delta=DELTA)
    assert result.details["mu"] == pytest.approx(q * math.sqrt(t * math.expm1(1 / z**2)), rel=1e-12)
    assert result.kind is ResultKind.APPROXIMATION and result.upper is None
    assert result.epsilon == pytest.approx(gdp_epsilon(result.details["mu"], DELTA), rel=1e-12)
    # the certified lower bound comes from the PRV accountant; the CLT understates ε here
    assert result.details["lower_bound_method"] == "PRV accountant's certified lower bound"
    assert result.lower is not None and result.lower <= _pld_upper(_ledger((q, z, t)))
    assert result.epsilon < result.lower and len(result.warnings) == 1
    assert GdpAccountant().delta(_ledger((q, z, t)), epsilon=1.0).kind is ResultKind.APPROXIMATION


def test_mixed_ledger_adds_exact_and_clt_parts() -> None:
    ledger = _ledger((1.0, 2.0, 2), (0.01, 1.0, 100))
    mu, exact = gdp_mu(ledger)
    assert not exact
    assert mu == pytest.approx(math.sqrt(2 / 4 + 100 * 0.01**2 * math.expm1(1.0)), rel=1e-14)


def test_curve_labels_each_prefix() -> None:
    ledger = _ledger((1.0, 3.0, 2), (0.05, 1.0, 10))
    curve = GdpAccountant().epsilon_curve(ledger, delta=DELTA, steps=[1, 2, 3, 12])
    assert [r.kind for r in curve] == [ResultKind.UPPER_BOUND] * 2 + [ResultKind.APPROXIMATION] * 2
    assert curve[1].epsilon == pytest.approx(_gaussian_epsilon_oracle(3.0 / math.sqrt(2), DELTA))


# --------------------------------------------------------------------------- lower bound
def _pld_upper(ledger: CompressedLedger) -> float:
    oracle = PLDAccountant(value_discretization_interval=1e-3)
    oracle.compose(compressed_to_dp_event(ledger))
    return oracle.get_epsilon(DELTA)


def test_understatement_is_flagged_with_its_factor() -> None:
    ledger = _ledger((0.01, 0.6, 1000))
    result = GdpAccountant().epsilon(ledger, delta=DELTA)
    assert result.lower is not None and result.epsilon < result.lower
    assert len(result.warnings) == 1
    factor = result.lower / result.epsilon
    assert (
        f"{factor:.3g}" in result.warnings[0]
        and "below a certified lower bound" in result.warnings[0]
    )
    # the lower bound is below valid upper bounds computed independently
    assert result.lower <= RdpAccountant().epsilon(ledger, delta=DELTA).epsilon
    assert result.lower <= _pld_upper(ledger)


@pytest.mark.parametrize(
    "triples",
    [[(0.2, 0.5, 20)], [(0.5, 0.8, 10)], [(0.1, 0.7, 50)], [(0.05, 1.0, 40), (1.0, 5.0, 2)]],
)
def test_lower_bound_is_below_pld_upper_bound(triples: list) -> None:
    ledger = _ledger(*triples)
    result = GdpAccountant().epsilon(ledger, delta=DELTA)
    assert result.lower is not None and 0.0 <= result.lower <= _pld_upper(ledger)
    assert bool(result.warnings) == (result.epsilon < result.lower)


def _without_prv(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the PRV lower bound fail, as a failed numerical check would."""
    from dpledger.accountants import gdp as gdp_module

    def failing(_ledger: CompressedLedger, _delta: float, **_budgets: float) -> tuple[None, dict]:
        return None, {"lower_bound_prv_failed": "simulated failure"}

    monkeypatch.setattr(gdp_module, "_prv_lower_bound", failing)


def test_lower_bound_can_be_turned_off_or_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = _ledger((0.01, 0.6, 1000))
    off = GdpAccountant(lower_bound=False).epsilon(ledger, delta=DELTA)
    assert off.lower is None and off.warnings == () and "lower_bound_method" not in off.details
    _without_prv(monkeypatch)
    many_steps = _ledger((0.004, 1.0, 3000))
    skipped = GdpAccountant().epsilon(many_steps, delta=DELTA)
    assert skipped.lower is None and "lower_bound_skipped" in skipped.details
    forced = GdpAccountant(lower_bound_interval=5e-3).epsilon(many_steps, delta=DELTA)
    assert forced.details["lower_bound_interval"] == 5e-3
    assert "lower_bound_skipped" not in forced.details and forced.lower is not None
    assert forced.details["lower_bound_prv_failed"] == "simulated failure"


def test_pld_fallback_bound_is_below_pld_upper_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    _without_prv(monkeypatch)
    ledger = _ledger((0.01, 0.6, 1000))
    result = GdpAccountant().epsilon(ledger, delta=DELTA)
    assert result.details["lower_bound_method"].startswith("dp-accounting PLD")
    assert result.lower is not None and result.lower <= _pld_upper(ledger)
    assert result.epsilon < result.lower and len(result.warnings) == 1


@pytest.mark.parametrize(("delta", "certified"), [(1e-13, True), (1e-15, False), (1e-20, False)])
def test_pld_fallback_bound_is_not_claimed_at_dp_accountings_truncation_mass(
    monkeypatch: pytest.MonkeyPatch, delta: float, certified: bool
) -> None:
    """dp-accounting's compositions put their truncated tail mass (1e-15 each by default) at an
    infinite loss even in the optimistic mode, so its δ(ε) is no lower bound for δ near that
    mass: the fallback must stay below a valid upper bound (RDP), or be skipped with a reason."""
    from dp_accounting import rdp

    _without_prv(monkeypatch)
    ledger = _ledger((0.01, 1.0, 100))
    result = GdpAccountant().epsilon(ledger, delta=delta)
    assert result.details["lower_bound_method"].startswith("dp-accounting PLD")
    if certified:
        oracle = rdp.RdpAccountant()
        oracle.compose(compressed_to_dp_event(ledger))
        assert result.lower is not None and 0.0 <= result.lower <= oracle.get_epsilon(delta)
    else:
        assert result.lower is None and result.warnings == ()
        assert "tail mass" in result.details["lower_bound_skipped"]


def test_prv_lower_bound_is_tight_and_certified() -> None:
    """PRV's lower bound lies below, and within its error width of, the PLD upper bound.

    PRV certifies upper − lower ≤ 2·eps_error = 0.02 (default eps_error 0.01) and the PLD upper
    bound at interval 1e-3 lies within 1e-3 of PRV's upper bound in this regime, so
    PLD − lower ≤ 0.021 plus what the optimistic bucketing (relative 1e-3) takes off the bound,
    which the test measures on the same ledger.
    """
    from dpledger.accountants import PrvAccountant
    from dpledger.accountants.bucketing import optimistic_buckets

    ledger = _ledger((0.01, 0.6, 1000))
    result = GdpAccountant().epsilon(ledger, delta=DELTA)
    pld = _pld_upper(ledger)
    assert result.details["lower_bound_method"] == "PRV accountant's certified lower bound"
    exact = PrvAccountant().epsilon(ledger, delta=DELTA).lower
    bucketed = (
        PrvAccountant()
        .epsilon(optimistic_buckets(ledger, relative_precision=1e-3), delta=DELTA)
        .lower
    )
    assert result.lower == bucketed <= exact
    assert pld - 0.021 - (exact - bucketed) <= result.lower <= pld


# --------------------------------------------------------------------------- replace-one
def test_replace_one_full_batch_is_two_over_z_gdp() -> None:
    result = GdpAccountant().epsilon(_ledger((1.0, 4.0, 1), neighboring="replace_one"), delta=DELTA)
    assert result.details["mu"] == pytest.approx(0.5)
    assert result.epsilon == pytest.approx(_gaussian_epsilon_oracle(2.0, DELTA), rel=1e-8)
    with pytest.raises(UnsupportedLedgerError, match="replace-one"):
        GdpAccountant().epsilon(_ledger((0.5, 4.0, 1), neighboring="replace_one"), delta=DELTA)


# --------------------------------------------------------------------------- helpers, inputs
@pytest.mark.parametrize("mu", [1e-3, 0.3, 1.0, 5.0, 40.0])
@pytest.mark.parametrize("delta", [1e-10, 1e-5, 0.1])
def test_gdp_epsilon_inverts_gdp_delta(mu: float, delta: float) -> None:
    eps = gdp_epsilon(mu, delta)
    assert eps >= 0.0 and gdp_delta(mu, eps) <= delta
    if eps > 0:
        assert gdp_delta(mu, eps * (1 - 1e-9) - 1e-12) > delta


def test_gdp_helpers_edge_values() -> None:
    assert gdp_epsilon(0.0, DELTA) == 0.0 and gdp_delta(0.0, 1.0) == 0.0
    assert gdp_epsilon(math.inf, DELTA) == math.inf and gdp_delta(math.inf, 1.0) == 1.0
    assert gdp_delta(1.0, math.inf) == 0.0
    mu, _ = gdp_mu(_ledger((0.5, 0.01, 1)))  # e^{1/z²} overflows: μ = ∞, ε = ∞
    assert (
        mu == math.inf
        and GdpAccountant().epsilon(_ledger((0.5, 0.01, 1)), delta=DELTA).epsilon == math.inf
    )


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"lower_bound": 1}, "lower_bound"),
        ({"lower_bound_interval": 0.0}, "lower_bound_interval"),
        ({"lower_bound_interval": True}, "lower_bound_interval"),
        ({"lower_bound_bucketing": 0.0}, "lower_bound_bucketing"),
        ({"lower_bound_bucketing": None}, "lower_bound_bucketing"),
        ({"bucketing": 1.5}, "bucketing"),
    ],
)
def test_bad_settings_are_rejected(kwargs: dict, name: str) -> None:
    with pytest.raises(InvalidParameterError, match=name):
        GdpAccountant(**kwargs)


def test_settings_are_reported() -> None:
    settings = GdpAccountant(lower_bound=False, bucketing=1e-3).settings()
    assert settings["lower_bound"] is False and settings["bucketing"] == 1e-3
    assert np.isfinite(GdpAccountant().epsilon(_ledger((0.01, 1.0, 10)), delta=DELTA).seconds)
