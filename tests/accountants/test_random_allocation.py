"""The certified bound for random allocation (balls-in-bins batches) with amplification."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpledger import PrivacyLedger, SamplingEvent
from dpledger.accountants import make_accountant
from dpledger.accountants.balls_in_bins import balls_in_bins_delta
from dpledger.accountants.base import ResultKind
from dpledger.accountants.random_allocation import (
    _lognormal_law,
    _mean_law,
    random_allocation_delta,
    random_allocation_epsilon,
)
from dpledger.cli import main
from dpledger.errors import InvalidParameterError, UnsupportedLedgerError, UnsupportedSamplingError

pytestmark = pytest.mark.filterwarnings("ignore::dpledger.errors.DeltaTooLargeWarning")


def bins_ledger(k: int, epochs: int, sigma: float, *, n: int = 10_000, **kw) -> PrivacyLedger:
    ledger = PrivacyLedger(**kw)
    for t in range(k * epochs):
        ledger.record_sample(event=SamplingEvent.balls_in_bins(k, n, epoch_start=t % k == 0))
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=sigma)
    return ledger


# --------------------------------------------------------------------------- references


def test_pull_request_414_reference() -> None:
    """google/differential-privacy pull request 414, python/dp_accounting/dp_accounting/pld/
    pld_privacy_accountant_test.py, ``test_random_allocation_basic``:
    ``RandomAllocationDpEvent(GaussianDpEvent(2.0), num_selected=10, num_steps=100)`` has
    ε(1e-6) = 2.4265 (± 1e-3) and δ(2.4265) = 1e-6 (± 1e-7). That implementation takes ~170 s
    here; the goal is 5 s for both numbers."""
    start = time.perf_counter()
    eps = random_allocation_epsilon(
        noise_multiplier=2.0, num_steps=100, num_selected=10, delta=1e-6
    )
    delta = random_allocation_delta(
        noise_multiplier=2.0, num_steps=100, num_selected=10, epsilon=2.4265
    )
    assert time.perf_counter() - start < 5.0
    assert eps == pytest.approx(2.4265, abs=1e-3)
    assert delta == pytest.approx(1e-6, abs=1e-7)


# random-allocation 1.0.5 (PyPI; Feldman & Shenfeld's accountant): (k batches per epoch, z,
# epochs, δ, its best provable ε, its lower bound on ε or None where it gives none). The best
# bound is the smaller of two published figures for the package: the (1.852, 0.77671,
# 1.4663, 3.9928) and its ``allocation_epsilon_combined`` at discretisation 1e-4 with RDP orders
# 2..60 as run by benchmarks/random_allocation_bench.py (1.6343, 0.77671, 1.4268, 3.3862); the
# lower bounds are its ``allocation_epsilon_lower_bound`` (one epoch), the same in both.
PACKAGE_VALUES = [
    (10, 1.0, 1, 1e-3, 1.6343, 1.1656),
    (100, 1.0, 1, 1e-4, 0.77671, 0.36375),
    (50, 0.8, 1, 1e-3, 1.4268, 0.80774),
    (10, 1.0, 5, 1e-3, 3.3862, None),
]


@pytest.mark.parametrize(("k", "z", "epochs", "delta", "best", "lower"), PACKAGE_VALUES)
def test_against_the_random_allocation_package(k, z, epochs, delta, best, lower) -> None:
    """At or below 1.05× the package's best provable bound, never below its lower bound, in
    seconds (the package takes 3–30 s for each)."""
    start = time.perf_counter()
    eps = random_allocation_epsilon(noise_multiplier=z, num_steps=k, epochs=epochs, delta=delta)
    assert time.perf_counter() - start < 5.0
    assert eps <= 1.05 * best
    if lower is not None:
        assert eps >= lower


def test_one_step_is_the_gaussian_mechanism() -> None:
    """T = 1: every record is in the one step, E epochs are E Gaussian mechanisms, i.e.
    μ-GDP with μ = √E/σ (closed form of Balle & Wang 2018): the bound is at or above it and
    within the grid's second-order error."""
    from dpledger.accountants.gdp import gdp_epsilon

    exact = gdp_epsilon(mu=math.sqrt(10) / 2.0, delta=1e-6)
    eps = random_allocation_epsilon(noise_multiplier=2.0, num_steps=1, epochs=10, delta=1e-6)
    assert exact <= eps <= exact + 2e-3


def test_the_grid_laws_keep_mass_and_mean() -> None:
    """Every approximation is a mean-preserving spread: Q-mass 1 and E_Q[S] = 1 (to rounding)."""
    h = 0.01
    for law in (_lognormal_law(0.9, h), _mean_law(0.9, 37, h)):
        y = np.exp((law.k0 + np.arange(len(law.q))) * h)
        assert float(np.sum(law.q)) + law.zero == pytest.approx(1.0, abs=1e-12)
        assert float(np.sum(law.q * y)) + law.escaped == pytest.approx(1.0, abs=1e-12)


def test_the_excess_is_second_order_in_the_grid_step() -> None:
    """Halving h cuts the bound's excess by about 4 (mean-preserving spreads add a variance of
    order h²), not 2 as rounding every loss up to the grid would: ε(0.02) − ε(0.01) is about 4
    times ε(0.01) − ε(0.005), and all three decrease."""
    e = [
        random_allocation_epsilon(
            noise_multiplier=2.0, num_steps=10, epochs=10, delta=1e-6, grid_step=h
        )
        for h in (0.02, 0.01, 0.005)
    ]
    assert e[0] > e[1] > e[2]
    assert 3.0 < (e[0] - e[1]) / (e[1] - e[2]) < 5.0


# --------------------------------------------------------------------------- against Monte Carlo

MC_GRID = [(4, 1.0, 1, 0.5), (10, 1.0, 1, 1.0), (10, 0.8, 2, 1.5), (50, 1.2, 1, 0.3)]


@pytest.mark.slow
@pytest.mark.parametrize(("k", "z", "epochs", "eps"), MC_GRID)
def test_never_below_the_monte_carlo_lower_confidence_bound(k, z, epochs, eps) -> None:
    """The balls-in-bins Monte-Carlo estimate of δ(ε) (a different computation: sampled losses
    of the same pair) minus 5 standard errors (a one-sided failure probability below 3e-7 for
    the larger of two means) stays below the certified δ(ε)."""
    bound = random_allocation_delta(noise_multiplier=z, num_steps=k, epochs=epochs, epsilon=eps)
    mc = balls_in_bins_delta(eps, z, k, epochs=epochs, samples=200_000, seed=11)
    assert mc.estimate - 5.0 * mc.standard_error <= bound
    # and the bound is not loose against it either: within 5 standard errors above
    assert bound <= mc.estimate + 5.0 * mc.standard_error


# --------------------------------------------------------------------------- properties


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(
    z=st.floats(0.6, 3.0),
    factor=st.floats(1.05, 2.0),
    k=st.integers(2, 60),
    delta=st.sampled_from([1e-3, 1e-5]),
)
def test_monotone_in_sigma(z: float, factor: float, k: int, delta: float) -> None:
    """More noise never gives a larger ε (the log-normal of a larger σ is a contraction)."""
    low = random_allocation_epsilon(noise_multiplier=z, num_steps=k, delta=delta)
    high = random_allocation_epsilon(noise_multiplier=z * factor, num_steps=k, delta=delta)
    assert high <= low


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(z=st.floats(0.6, 3.0), k=st.integers(1, 60), more=st.integers(1, 60))
def test_monotone_in_the_number_of_steps(z: float, k: int, more: int) -> None:
    """More steps per epoch never give a larger ε (the mean of more i.i.d. terms is a
    contraction)."""
    few = random_allocation_epsilon(noise_multiplier=z, num_steps=k, delta=1e-5)
    many = random_allocation_epsilon(noise_multiplier=z, num_steps=k + more, delta=1e-5)
    assert many <= few


@pytest.mark.slow
@settings(max_examples=10, deadline=None)
@given(
    z=st.floats(0.5, 3.0),
    k=st.integers(1, 120),
    epochs=st.integers(1, 4),
    delta=st.sampled_from([1e-3, 1e-6]),
)
def test_at_or_below_the_no_amplification_bound(z, k, epochs, delta) -> None:
    """Never above the pld accountant's certified bound without amplification (each epoch one
    Gaussian mechanism), up to that accountant's own discretisation slack (1e-4 per epoch)."""
    ledger = bins_ledger(k, epochs, z)
    amplified = make_accountant("random_allocation").epsilon(ledger, delta=delta).epsilon
    plain = make_accountant("pld").epsilon(ledger, delta=delta).epsilon
    assert amplified <= plain + 1e-4 * epochs


# --------------------------------------------------------------------------- the accountant


def test_the_accountant_reads_the_ledger() -> None:
    """Reference: the functions called with the ledger's k, z and epochs; an epoch cut short
    counts as a whole one."""
    acc = make_accountant("random_allocation")
    result = acc.epsilon(bins_ledger(8, 3, 1.3), delta=1e-5)
    direct = random_allocation_epsilon(noise_multiplier=1.3, num_steps=8, epochs=3, delta=1e-5)
    assert result.kind is ResultKind.UPPER_BOUND and result.epsilon == direct
    assert result.details["epochs"] == 3 and result.details["num_batches"] == [8]
    short = bins_ledger(8, 3, 1.3)
    short.record_sample(event=SamplingEvent.balls_in_bins(8, 10_000, epoch_start=True))
    short.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.3)
    four = random_allocation_epsilon(noise_multiplier=1.3, num_steps=8, epochs=4, delta=1e-5)
    assert acc.epsilon(short, delta=1e-5).epsilon == four
    back = acc.delta(bins_ledger(8, 3, 1.3), epsilon=direct).delta
    assert back == pytest.approx(1e-5, rel=1e-3)


def test_two_noise_levels_compose() -> None:
    """Epochs at two noise multipliers: above each part alone, below the part at the smaller
    noise for all epochs."""
    ledger = bins_ledger(6, 2, 1.0)
    for t in range(6):
        ledger.record_sample(event=SamplingEvent.balls_in_bins(6, 10_000, epoch_start=t == 0))
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=2.0)
    eps = make_accountant("random_allocation").epsilon(ledger, delta=1e-5).epsilon
    part = random_allocation_epsilon(noise_multiplier=1.0, num_steps=6, epochs=2, delta=1e-5)
    worst = random_allocation_epsilon(noise_multiplier=1.0, num_steps=6, epochs=3, delta=1e-5)
    assert part < eps < worst


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(InvalidParameterError, match="noise_multiplier"):
        random_allocation_epsilon(noise_multiplier=0.0, num_steps=4, delta=1e-5)
    with pytest.raises(InvalidParameterError, match="num_steps"):
        random_allocation_epsilon(noise_multiplier=1.0, num_steps=0, delta=1e-5)
    with pytest.raises(InvalidParameterError, match="num_selected"):
        random_allocation_epsilon(noise_multiplier=1.0, num_steps=4, num_selected=5, delta=1e-5)
    with pytest.raises(InvalidParameterError, match="grid_step"):
        random_allocation_epsilon(noise_multiplier=1.0, num_steps=4, delta=1e-5, grid_step=1.0)
    with pytest.raises(InvalidParameterError, match="delta"):
        random_allocation_epsilon(noise_multiplier=1.0, num_steps=4, delta=1.5)
    with pytest.raises(InvalidParameterError, match="epsilon"):
        random_allocation_delta(noise_multiplier=1.0, num_steps=4, epsilon=-1.0)
    with pytest.raises(InvalidParameterError, match="grid_step"):
        make_accountant("random_allocation", grid_step=float("nan"))


def test_other_ledgers_are_refused() -> None:
    acc = make_accountant("random_allocation")
    poisson = PrivacyLedger()
    poisson.record_sample(sampling_probability=0.1)
    poisson.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0)
    with pytest.raises(UnsupportedSamplingError, match="balls-in-bins steps only"):
        acc.epsilon(poisson, delta=1e-5)
    with pytest.raises(UnsupportedLedgerError):
        acc.epsilon(bins_ledger(4, 1, 1.0, neighboring="replace_one"), delta=1e-5)


def test_the_cli_shows_it_for_balls_in_bins_ledgers(tmp_path: Path, capsys) -> None:
    path = tmp_path / "b.dpl"
    with PrivacyLedger(path) as ledger:
        for t in range(8):
            event = SamplingEvent.balls_in_bins(4, 10_000, epoch_start=t % 4 == 0)
            ledger.record_sample(event=event)
            ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0)
    args = ["epsilon", str(path), "--delta", "1e-5", "--json"]
    assert main([*args, "--accountant", "random_allocation,pld"]) == 0
    rows = {row["accountant"]: row for row in map(json.loads, capsys.readouterr().out.splitlines())}
    row = rows["random_allocation"]
    assert row["kind"] == "upper_bound"
    assert row["epsilon"] == random_allocation_epsilon(
        noise_multiplier=1.0, num_steps=4, epochs=2, delta=1e-5
    )
    assert row["epsilon"] < rows["pld"]["epsilon"]


@pytest.mark.slow
def test_the_report_shows_it_for_balls_in_bins_ledgers(tmp_path: Path, monkeypatch) -> None:
    """dpledger report's default accountants include it on a balls-in-bins ledger, as a
    certified upper bound equal to the accountant's own answer, with its ε curve."""
    from dpledger.report import build, build_report

    def few_draws(name: str, **kwargs):  # the Monte-Carlo row's default draws take a minute
        if name == "balls_in_bins":
            kwargs["samples"] = 2000
        return make_accountant(name, **kwargs)

    monkeypatch.setattr(build, "make_accountant", few_draws)

    path = tmp_path / "b.dpl"
    with PrivacyLedger(path) as ledger:
        for t in range(12):
            event = SamplingEvent.balls_in_bins(4, 10_000, epoch_start=t % 4 == 0)
            ledger.record_sample(event=event)
            ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0)
    report = build_report(path, delta=1e-5, curve_points=3)
    row = next(r for r in report.accountants if r.accountant == "random_allocation")
    own = random_allocation_epsilon(noise_multiplier=1.0, num_steps=4, epochs=3, delta=1e-5)
    assert row.kind == "upper_bound" and row.epsilon == own


@pytest.mark.parametrize(
    "z", [5e-324, 1e-6, 1e-3, pytest.param(0.05, marks=pytest.mark.slow), 50.0, 1e6, 1e300]
)
def test_extreme_noise_gives_a_number_never_above_the_no_amplification_bound(z: float) -> None:
    """At any noise: a number in [0, ∞], never NaN, at most the no-amplification μ-GDP bound
    (μ = √E/z, closed form); below z ≈ 0.01 the grid would be too large and that bound is
    returned (the accountant says so in a warning)."""
    from dpledger.accountants.gdp import gdp_epsilon

    eps = random_allocation_epsilon(noise_multiplier=z, num_steps=20, epochs=2, delta=1e-5)
    plain = gdp_epsilon(math.sqrt(2.0) / z, 1e-5)
    assert not math.isnan(eps) and 0.0 <= eps <= plain
    delta = random_allocation_delta(noise_multiplier=z, num_steps=20, epochs=2, epsilon=1.0)
    assert 0.0 <= delta <= 1.0
    result = make_accountant("random_allocation").epsilon(bins_ledger(20, 2, z), delta=1e-5)
    assert result.epsilon == eps or result.epsilon <= plain
    if z <= 1e-3:
        assert eps == plain and any("no-amplification" in w for w in result.warnings)


def test_a_finer_grid_for_large_noise(monkeypatch) -> None:
    """At z = 50 the log-normal spans about two 0.01 cells, which would keep the bound near
    2h = 0.02 (measured 0.0195 with the finer grid switched off); the grid of τ/20 used instead
    gives 0.0019, 30× below the no-amplification bound (0.0586)."""
    from dpledger.accountants import random_allocation
    from dpledger.accountants.gdp import gdp_epsilon

    eps = random_allocation_epsilon(noise_multiplier=50.0, num_steps=1000, delta=1e-5)
    assert eps < 0.1 * gdp_epsilon(0.02, 1e-5)
    monkeypatch.setattr(random_allocation, "_FINEST_AUTOMATIC_STEP", 0.01)
    coarse = random_allocation_epsilon(noise_multiplier=50.0, num_steps=1000, delta=1e-5)
    assert coarse > 5.0 * eps
