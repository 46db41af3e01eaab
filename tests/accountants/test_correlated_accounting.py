"""Accounting for correlated-noise releases, against independent references.

References, each named in its test:

* the closed form of μ-GDP: a Gaussian mechanism with μ = Δ/σ is (ε, δ)-DP exactly for
  δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) (Dong, Roth & Su 2019, Corollary 2.13), solved for ε
  with ``scipy.optimize.brentq``;
* dp-accounting's ``SingleEpochTreeAggregationDpEvent`` (its RDP accountant implements TF
  Privacy's tree accounting, Kairouz et al. 2021, appendix D: sensitivity √⌈log2(T + 1)⌉);
* dp-accounting's PLD accountant on ``PrivacyLedger.to_dp_event()``, which holds a
  ``GaussianDpEvent`` or, with amplification, a ``MixtureOfGaussiansDpEvent``
  (Choquette-Choo et al. 2024);
* dp-accounting's RDP accountant on k Poisson-subsampled Gaussians (Choquette-Choo et al. 2023,
  "Amplified Banded Matrix Factorization", section 4).
"""

from __future__ import annotations

import math

import dp_accounting
import pytest

from dpledger import PrivacyLedger
from dpledger.accountants.base import ResultKind, make_accountant
from dpledger.accountants.correlated import equivalent_runs, expand_correlated
from dpledger.errors import UnsupportedLedgerError, UnsupportedSamplingError
from dpledger.ledger.steps import CompressedLedger
from dpledger.mechanisms.correlated import (
    ParticipationSchema,
    optimize_banded_toeplitz,
    tree_factorization,
)
from dpledger.mechanisms.correlated.release import release_event
from tests.gdp_oracle import gaussian_epsilon

DELTA = 1e-5
PLD_GRID = 1e-4  # dp-accounting's default value_discretization_interval


def ledger_with(*events, neighboring: str = "add_remove") -> PrivacyLedger:  # type: ignore[no-untyped-def]
    led = PrivacyLedger(neighboring=neighboring)
    for e in events:
        led.record_correlated_release(e)
    return led


def tree_release(num_steps: int = 100, sigma: float = 4.0, clip: float = 1.0):  # type: ignore[no-untyped-def]
    return release_event(
        tree_factorization(num_steps, honaker=True),
        ParticipationSchema.single(num_steps=num_steps),
        l2_norm_bound=clip,
        noise_stddev=sigma,
    )


def amplified_release(q: float = 0.05):  # type: ignore[no-untyped-def]
    fact = optimize_banded_toeplitz(num_steps=600, bands=6)
    schema = ParticipationSchema.cyclic(num_steps=600, period=12)
    return release_event(fact, schema, l2_norm_bound=0.5, noise_stddev=1.1, sampling_probability=q)


@pytest.mark.parametrize("name", ["gdp", "pld", "prv", "rdp"])
def test_unamplified_release_is_one_gaussian(name: str) -> None:
    """Reference: the μ-GDP closed form with μ = sens(C)·S/σ, sens = √⌈log2(T + 1)⌉ for the
    tree. GDP and PLD are exact for one Gaussian (to the root finder's tolerance); PRV is within
    its reported error bounds; RDP is a looser valid bound, never below the exact value."""
    event = tree_release(100, sigma=4.0, clip=2.0)
    mu = math.sqrt(math.ceil(math.log2(101))) * 2.0 / 4.0
    assert event.gaussian_mu == pytest.approx(mu, rel=1e-15)
    exact = gaussian_epsilon(mu, DELTA)
    result = make_accountant(name).epsilon(ledger_with(event), delta=DELTA)
    assert result.kind is ResultKind.UPPER_BOUND
    if name in ("gdp", "pld"):
        assert result.value == pytest.approx(exact, rel=1e-9)
    elif name == "prv":
        assert result.lower is not None and result.upper is not None
        assert result.lower - 1e-9 <= exact <= result.upper + 1e-9
    else:
        assert result.value >= exact


def test_tree_rdp_matches_tf_privacy_tree_accounting() -> None:
    """Reference: dp-accounting's RDP of ``SingleEpochTreeAggregationDpEvent(z, T)`` (TF
    Privacy's formula: RDP α·⌈log2(T + 1)⌉/(2z²), Kairouz et al. 2021, appendix D), same orders
    and conversion, so the two ε agree to rounding."""
    for t, z in [(100, 4.0), (1000, 10.0), (7, 1.5)]:
        ours = make_accountant("rdp").epsilon(ledger_with(tree_release(t, sigma=z)), delta=DELTA)
        oracle = dp_accounting.rdp.RdpAccountant(
            neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_SPECIAL
        )
        oracle.compose(dp_accounting.SingleEpochTreeAggregationDpEvent(z, t))
        assert ours.value == pytest.approx(oracle.get_epsilon(DELTA), rel=1e-9)


@pytest.mark.slow
def test_amplified_release_through_the_mixture_of_gaussians_event() -> None:
    """Reference: dp-accounting's PLD accountant (pessimistic, grid 1e-4) on the ledger's
    dp-accounting event, a ``SelfComposedDpEvent`` of a ``MixtureOfGaussiansDpEvent``; our PLD
    accountant discretises the same privacy-loss distribution (as Poisson-subsampled Gaussians),
    so the two agree within one grid step per composition."""
    event = amplified_release()
    led = ledger_with(event)
    dp_ev = led.to_dp_event()
    inner = dp_ev.events[0]
    assert isinstance(inner, dp_accounting.SelfComposedDpEvent)
    assert isinstance(inner.event, dp_accounting.dp_event.MixtureOfGaussiansDpEvent)
    assert inner.count == event.max_participations == 50
    oracle = dp_accounting.pld.PLDAccountant()
    oracle.compose(dp_ev)
    ours = make_accountant("pld").epsilon(led, delta=DELTA)
    assert ours.value == pytest.approx(oracle.get_epsilon(DELTA), abs=PLD_GRID * 50)


def test_amplified_release_rdp_matches_poisson_subsampled_gaussians() -> None:
    """Reference: dp-accounting's RDP accountant on k compositions of
    PoissonSampled(q, Gaussian(σ / (S·max_j ‖C_j‖))) (Choquette-Choo et al. 2023, Amplified
    BandMF, section 4)."""
    event = amplified_release(q=0.02)
    z = event.noise_stddev / (event.l2_norm_bound * event.max_column_norm)
    oracle = dp_accounting.rdp.RdpAccountant()
    oracle.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(z)),
            event.max_participations,
        )
    )
    ours = make_accountant("rdp").epsilon(ledger_with(event), delta=DELTA)
    assert ours.value == pytest.approx(oracle.get_epsilon(DELTA), rel=1e-6)


@pytest.mark.slow
def test_release_composes_with_dp_sgd_steps() -> None:
    """Reference: dp-accounting's PLD accountant on the whole ledger's ``to_dp_event()`` (the
    steps' Poisson-subsampled Gaussians composed with the release's Gaussian)."""
    led = PrivacyLedger()
    for _ in range(30):
        led.record_sample(sampling_probability=0.01, population_size=10_000)
        led.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0)
    led.record_correlated_release(tree_release(64, sigma=6.0))
    oracle = dp_accounting.pld.PLDAccountant()
    oracle.compose(led.to_dp_event())
    ours = make_accountant("pld").epsilon(led, delta=DELTA)
    assert ours.value == pytest.approx(oracle.get_epsilon(DELTA), abs=PLD_GRID * 31)
    alone = make_accountant("pld").epsilon(ledger_with(tree_release(64, sigma=6.0)), delta=DELTA)
    assert ours.value > alone.value


def test_replace_one_doubles_the_sensitivity() -> None:
    """Reference: the μ-GDP closed form with μ = 2·sens(C)·S/σ (a replaced record moves each
    contribution by up to 2S)."""
    event = tree_release(50, sigma=8.0)
    result = make_accountant("pld").epsilon(
        ledger_with(event, neighboring="replace_one"), delta=DELTA
    )
    assert result.value == pytest.approx(gaussian_epsilon(2 * event.gaussian_mu, DELTA), rel=1e-9)


def test_no_noise_is_not_private() -> None:
    event = release_event(
        tree_factorization(8),
        ParticipationSchema.single(num_steps=8),
        l2_norm_bound=1.0,
        noise_stddev=0.0,
    )
    assert equivalent_runs(event)[0].noise_multiplier == 0.0
    assert math.isinf(make_accountant("rdp").epsilon(ledger_with(event), delta=DELTA).value)
    assert isinstance(ledger_with(event).to_dp_event().events[0], dp_accounting.NonPrivateDpEvent)


def test_refusals_are_typed_and_come_before_computing() -> None:
    led = ledger_with(tree_release(16))
    with pytest.raises(UnsupportedLedgerError, match="correlated-noise release"):
        make_accountant("rdp").epsilon_curve(led, delta=DELTA, steps=[1])
    with pytest.raises(UnsupportedLedgerError, match="correlated-noise release"):
        make_accountant("pld").epsilon_curve(led.compressed(), delta=DELTA, steps=[1])
    # an accountant without an analysis of Gaussian (full-batch) mechanisms refuses the release
    with pytest.raises(UnsupportedSamplingError):
        make_accountant("balls_in_bins").epsilon(led, delta=DELTA)


def test_expansion_keeps_the_compressed_ledger_and_runs() -> None:
    """The compressed view given to accountants holds the steps, then the release's runs."""
    event = amplified_release(q=0.1)
    comp = CompressedLedger(correlated=(event,))
    expanded = expand_correlated(comp)
    assert expanded.correlated == ()
    (run,) = expanded.runs
    assert run.sampling_probability == 0.1 and run.count == event.max_participations
    assert run.noise_multiplier == pytest.approx(1.1 / (0.5 * event.max_column_norm), rel=1e-15)
    assert expand_correlated(CompressedLedger()) == CompressedLedger()
