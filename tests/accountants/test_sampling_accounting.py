"""Accounting for every sampling scheme: who certifies what, checked against independent
references, and who refuses what before computing."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import dp_accounting
import pytest

from dpledger import PrivacyLedger, SamplingEvent
from dpledger.accountants import make_accountant
from dpledger.errors import UnsupportedLedgerError, UnsupportedSamplingError
from dpledger.ledger.steps import CompressedLedger, StepRun
from tests.gdp_oracle import gaussian_epsilon

N = 60_000
DELTA = 1e-5
DATA = Path(__file__).resolve().parents[1] / "ledger" / "data"


def ledger_of(events, *, sigma: float = 1.1, neighboring: str = "add_remove") -> PrivacyLedger:
    ledger = PrivacyLedger(neighboring=neighboring)
    for event in events:
        ledger.record_sample(event=event)
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=sigma)
    return ledger


def epochs_of(build, per_epoch: int, epochs: int, steps: int | None = None):
    total = per_epoch * epochs if steps is None else steps
    return [build(epoch_start=t % per_epoch == 0) for t in range(total)]


# ------------------------------------------------------------------ epoch-based schemes
def test_balls_in_bins_is_one_gaussian_per_epoch_under_add_remove() -> None:
    """Reference: the analytical Gaussian mechanism (Balle & Wang 2018) with μ = √E / z, the
    no-amplification bound (each record in one batch per epoch)."""
    events = epochs_of(lambda **kw: SamplingEvent.balls_in_bins(10, 1000, **kw), 10, 15)
    ledger = ledger_of(events)
    exact = gaussian_epsilon(math.sqrt(15) / 1.1, DELTA)
    pld = make_accountant("pld").epsilon(ledger, delta=DELTA)
    rdp = make_accountant("rdp").epsilon(ledger, delta=DELTA)
    assert pld.epsilon == pytest.approx(exact, rel=1e-9)  # closed form inside the accountant
    assert exact <= rdp.epsilon <= exact * 1.1  # RDP conversion is looser, never below
    assert "without amplification" in pld.details["sampling_note"]
    assert pld.details["sampling"] == ["balls_in_bins(num_batches=10, n=1000)"]


@pytest.mark.slow
def test_shuffle_under_replace_one_is_a_gaussian_with_twice_the_sensitivity() -> None:
    """Reference: dp-accounting's PLD of GaussianDpEvent(z / 2) composed E times (replace-one
    moves a clipped sum by 2S), an implementation independent of ours."""
    events = epochs_of(lambda **kw: SamplingEvent.shuffle(100, 1000, **kw), 10, 4)
    ledger = ledger_of(events, neighboring="replace_one")
    ours = make_accountant("pld").epsilon(ledger, delta=DELTA).epsilon
    reference = dp_accounting.pld.PLDAccountant()
    reference.compose(dp_accounting.GaussianDpEvent(1.1 / 2), 4)
    assert ours == pytest.approx(reference.get_epsilon(DELTA), rel=1e-3)


def test_a_partial_epoch_costs_a_whole_epoch_and_the_curve_follows_epochs() -> None:
    events = epochs_of(lambda **kw: SamplingEvent.shuffle(100, 1000, **kw), 10, 2, steps=13)
    ledger = ledger_of(events, neighboring="replace_one")
    curve = make_accountant("pld").epsilon_curve(ledger, delta=DELTA, steps=[1, 10, 11, 13])
    one = gaussian_epsilon(2 / 1.1, DELTA)
    two = gaussian_epsilon(2 * math.sqrt(2) / 1.1, DELTA)
    assert [r.epsilon for r in curve] == pytest.approx([one, one, two, two], rel=1e-9)


def test_the_epoch_takes_the_smallest_noise_of_its_steps() -> None:
    ledger = PrivacyLedger()
    for t, sigma in enumerate([2.0, 0.9, 3.0]):
        ledger.record_sample(event=SamplingEvent.balls_in_bins(3, 30, epoch_start=t == 0))
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=sigma)
    eps = make_accountant("pld").epsilon(ledger, delta=DELTA).epsilon
    assert eps == pytest.approx(gaussian_epsilon(1 / 0.9, DELTA), rel=1e-9)


# ------------------------------------------------------------------ truncated Poisson
@pytest.mark.slow
def test_truncated_poisson_through_dp_accountings_pld() -> None:
    """References: with a cap the sample can never reach (max_batch_size = n) the truncated
    PLD is the Poisson PLD, so ε equals dp-accounting's Poisson ε; a tight cap can only cost
    more; and our wiring equals dp-accounting's PLDAccountant fed the same event."""
    q, steps = 0.01, 200
    uncapped = ledger_of([SamplingEvent.truncated_poisson(q, 1000, 1000)] * steps)
    capped = ledger_of([SamplingEvent.truncated_poisson(q, 1000, 12)] * steps)
    poisson = dp_accounting.pld.PLDAccountant()
    poisson.compose(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(1.1)), steps
    )
    pld = make_accountant("pld")
    assert pld.epsilon(uncapped, delta=DELTA).epsilon == pytest.approx(
        poisson.get_epsilon(DELTA), rel=2e-3
    )
    ours = pld.epsilon(capped, delta=DELTA).epsilon
    assert ours > poisson.get_epsilon(DELTA)
    references = []
    for event in capped.to_dp_events():  # the removed and the added neighbour
        reference = dp_accounting.pld.PLDAccountant()
        references.append(reference.compose(event).get_epsilon(DELTA))
    assert ours == pytest.approx(max(references), rel=2e-3)


INTERVAL = 1e-3


def truncated_reference(q: float, n: int, cap: int, sigma: float, steps: int) -> Any:
    """dp-accounting's PLD accountant fed ``steps`` truncated subsampled Gaussian steps whose
    data set (the one containing the differing record) has n records."""
    reference = dp_accounting.pld.PLDAccountant(value_discretization_interval=INTERVAL)
    event = dp_accounting.TruncatedSubsampledGaussianDpEvent(
        dataset_size=n, sampling_probability=q, truncated_batch_size=cap, noise_multiplier=sigma
    )
    return reference.compose(event, steps)


@pytest.mark.slow
def test_truncated_poisson_covers_the_added_and_the_removed_record() -> None:
    """dp-accounting's truncated PLD takes the size of the data set that contains the differing
    record: n for the neighbour with a record removed, n + 1 for the one with a record added.
    The ledger's ε (and δ) is the larger of the two (q = 0.2, n = 50, cap 10, z = 1, T = 50:
    dataset_size n gives 28.53, n + 1 gives 28.97). A coarse grid (1e-3) on both sides keeps it
    fast."""
    q, n, cap, sigma, steps = 0.2, 50, 10, 1.0, 50
    ledger = ledger_of([SamplingEvent.truncated_poisson(q, n, cap)] * steps, sigma=sigma)
    removed = truncated_reference(q, n, cap, sigma, steps)
    added = truncated_reference(q, n + 1, cap, sigma, steps)
    pld = make_accountant("pld", value_discretization_interval=INTERVAL)
    ours = pld.epsilon(ledger, delta=DELTA).epsilon
    worst = max(removed.get_epsilon(DELTA), added.get_epsilon(DELTA))
    assert ours >= worst * (1 - 1e-9) and ours == pytest.approx(worst, rel=1e-3)
    eps = 0.5 * ours
    ours_delta = pld.delta(ledger, epsilon=eps).delta
    worst_delta = max(removed.get_delta(eps), added.get_delta(eps))
    assert ours_delta >= worst_delta * (1 - 1e-9) and ours_delta == pytest.approx(
        worst_delta, rel=1e-3
    )
    assert added.get_epsilon(DELTA) > removed.get_epsilon(DELTA) * 1.01
    with pytest.raises(UnsupportedLedgerError, match="distributions"):
        pld.distribution(ledger.compressed())
    assert len(pld.distributions(ledger.compressed())) == 2


# ------------------------------------------------------------------ refusals
REFUSALS = {
    # scheme builder, relation -> accountants that refuse it
    "fixed": (lambda: SamplingEvent.fixed_size(10, 1000), "replace_one", {"prv", "gdp"}),
    "truncated": (
        lambda: SamplingEvent.truncated_poisson(0.01, 1000, 20),
        "add_remove",
        {"rdp", "prv", "gdp"},
    ),
    "bins": (lambda: SamplingEvent.balls_in_bins(10, 1000), "add_remove", {"prv", "gdp"}),
    "shuffle": (lambda: SamplingEvent.shuffle(10, 1000), "replace_one", {"prv", "gdp"}),
}


@pytest.mark.parametrize(
    ("kind", "accountant"),
    [(kind, name) for kind in sorted(REFUSALS) for name in sorted(REFUSALS[kind][2])],
)
def test_accountants_refuse_schemes_they_have_no_analysis_of(kind, accountant) -> None:
    build, relation, _ = REFUSALS[kind]
    ledger = ledger_of([build()] * 3, neighboring=relation)
    with pytest.raises(UnsupportedSamplingError) as info:
        make_accountant(accountant).epsilon(ledger, delta=DELTA)
    assert info.value.accountant == accountant
    assert info.value.scheme == build().scheme.value


def test_a_scheme_under_a_relation_it_is_not_analysed_under_is_refused() -> None:
    ledger = ledger_of([SamplingEvent.shuffle(10, 1000, epoch_start=True)] * 3)
    for name in ("rdp", "pld"):
        with pytest.raises(UnsupportedSamplingError, match="replace_one"):
            make_accountant(name).epsilon(ledger, delta=DELTA)


def test_mixed_units_are_refused_and_user_level_poisson_is_accounted_per_user() -> None:
    user = ledger_of([SamplingEvent.poisson(0.01, 5000, unit="user")] * 100)
    record = ledger_of([SamplingEvent.poisson(0.01, 5000)] * 100)
    for name in ("rdp", "pld", "prv"):
        per_user = make_accountant(name).epsilon(user, delta=DELTA)
        assert per_user.epsilon == make_accountant(name).epsilon(record, delta=DELTA).epsilon
        assert per_user.details["unit"] == "user"
    mixed = ledger_of([SamplingEvent.poisson(0.01, 5000, unit="user"), SamplingEvent.poisson(0.01)])
    with pytest.raises(UnsupportedSamplingError, match="mixes units"):
        make_accountant("rdp").epsilon(mixed, delta=DELTA)


@pytest.mark.slow
def test_bucketing_never_turns_a_scheme_into_poisson() -> None:
    ledger = ledger_of([SamplingEvent.truncated_poisson(0.01, 1000, 12)] * 50)
    bucketed = make_accountant("pld", bucketing=1e-2).epsilon(ledger, delta=DELTA)
    plain = make_accountant("pld").epsilon(ledger, delta=DELTA)
    assert bucketed.epsilon >= plain.epsilon - 1e-3
    with pytest.raises(UnsupportedSamplingError):
        make_accountant("rdp", bucketing=1e-2).epsilon(ledger, delta=DELTA)


@pytest.mark.parametrize(
    ("q", "n", "cap", "sigma", "larger"),
    # (the pair whose larger data set has n records, the one with n + 1): neither is always
    # the larger, so neither alone may stand for the ledger
    [(0.5, 10, 1, 2.0, 0), (0.05, 10, 3, 2.0, 1)],
)
def test_to_dp_events_of_truncated_poisson_needs_both_neighbours(q, n, cap, sigma, larger) -> None:
    """Oracle: dp-accounting's PLD accountant on each event of ``to_dp_events()`` (dataset_size
    n, then n + 1). At q = 0.5, n = 10, cap 1, z = 2 the removed record's pair has the larger ε
    (1.78 against 1.68); at q = 0.05, cap 3 the added record's (0.248 against 0.228). So a
    single exported event, at n or at n + 1, would understate some ledger's ε: ``to_dp_event``
    refuses, and the largest ε over ``to_dp_events`` is the PLD accountant's."""
    ledger = ledger_of([SamplingEvent.truncated_poisson(q, n, cap)], sigma=sigma)
    with pytest.raises(UnsupportedSamplingError, match="to_dp_events"):
        ledger.to_dp_event()
    events = ledger.to_dp_events()
    sizes = [e.events[0].dataset_size for e in events]
    assert sizes == [n, n + 1]
    eps = []
    for event in events:
        reference = dp_accounting.pld.PLDAccountant(value_discretization_interval=COARSE)
        eps.append(reference.compose(event).get_epsilon(DELTA))
    assert eps[larger] > eps[1 - larger] * 1.02
    pld = make_accountant("pld", value_discretization_interval=COARSE)
    ours = pld.epsilon(ledger, delta=DELTA).epsilon
    assert ours >= max(eps) * (1 - 1e-9) and ours == pytest.approx(max(eps), rel=1e-3)


COARSE = 1e-2


# ------------------------------------------------------------------ old files, same ε
def test_the_committed_version_1_file_gives_the_epsilon_of_its_runs() -> None:
    """The format-1 example file replays to exactly the ε of the same runs built by hand, for
    every accountant; and RDP agrees with dp-accounting's RDP on them."""
    loaded = PrivacyLedger.load(DATA / "example.dpl")
    assert loaded.header.format_version == 1
    runs = CompressedLedger.from_runs(
        [(r.sampling_probability, r.noise_multiplier, r.count) for r in loaded.runs()]
    )
    assert all(r.sampling is None for r in loaded.runs())
    for name in ("rdp", "pld", "prv", "gdp"):
        acc = make_accountant(name)
        assert acc.epsilon(loaded, delta=DELTA).epsilon == acc.epsilon(runs, delta=DELTA).epsilon
    reference = dp_accounting.rdp.RdpAccountant(orders=list(range(2, 65)))
    reference.compose(loaded.to_dp_event())
    ours = make_accountant("rdp", orders=list(range(2, 65))).epsilon(loaded, delta=DELTA)
    assert ours.epsilon == pytest.approx(reference.get_epsilon(DELTA), rel=1e-6)


def test_dp_event_of_every_scheme() -> None:
    ledger = ledger_of(
        [
            SamplingEvent.fixed_size(10, 1000),
            SamplingEvent.truncated_poisson(0.01, 1000, 20),
            SamplingEvent.shuffle(10, 1000),
        ],
        neighboring="replace_one",
    )
    removed, added = ledger.to_dp_events()
    events = removed.events
    assert isinstance(events[0], dp_accounting.SampledWithoutReplacementDpEvent)
    assert events[0].event.noise_multiplier == pytest.approx(1.1 / 2)
    assert isinstance(events[1], dp_accounting.TruncatedSubsampledGaussianDpEvent)
    assert events[1].dataset_size == 1000 and added.events[1].dataset_size == 1001
    assert isinstance(events[2], dp_accounting.UnsupportedDpEvent)
    assert added.events[0] == events[0] and added.events[2] == events[2]
    assert StepRun(0.01, 1.1, 1, sampling=SamplingEvent.shuffle(10, 1000)).scheme.value == "shuffle"


# ------------------------------------------------------------------ fixed size
def dp_accounting_wor_epsilon(b: int, n: int, z: float, steps: int, orders: list[int]) -> float:
    reference = dp_accounting.rdp.RdpAccountant(
        orders=orders, neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE
    )
    reference.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.SampledWithoutReplacementDpEvent(
                n, b, dp_accounting.GaussianDpEvent(z / 2)
            ),
            steps,
        )
    )
    return reference.get_epsilon(DELTA)


@pytest.mark.parametrize(
    ("b", "n", "z", "steps"), [(256, 60_000, 1.1, 3510), (10, 100, 3.0, 50), (50, 1000, 0.8, 200)]
)
@pytest.mark.slow
def test_fixed_size_rdp_against_dp_accounting(b, n, z, steps) -> None:
    """Reference: dp-accounting's RDP accountant on SampledWithoutReplacementDpEvent (its own
    implementation of Wang, Balle & Kasiviswanathan's bound, under REPLACE_ONE, with the noise
    multiplier relative to the replace-one sensitivity 2S: z / 2), at integer orders.

    Both take, term by term up to order 256, the smaller of Theorem 9's and the
    Gaussian-specific term of Theorem 27 (ours rounded up): equal, in the small z·γ regimes
    such as the MNIST-like setting where Theorem 9's terms are the smaller ones and at z = 3
    with γ = 0.1 where the Gaussian-specific ones are."""
    ledger = ledger_of([SamplingEvent.fixed_size(b, n)] * steps, sigma=z, neighboring="replace_one")
    orders = list(range(2, 257))
    ours = make_accountant("rdp", orders=orders).epsilon(ledger, delta=DELTA).epsilon
    theirs = dp_accounting_wor_epsilon(b, n, z, steps, orders)
    assert ours >= theirs * (1 - 1e-9)
    assert ours == pytest.approx(theirs, rel=1e-6)


def test_fixed_size_of_the_whole_population_is_a_full_batch() -> None:
    """b = n: every step uses every record, a Gaussian mechanism with sensitivity 2S under
    replace-one; reference: the analytical Gaussian closed form."""
    ledger = ledger_of(
        [SamplingEvent.fixed_size(100, 100)] * 4, sigma=3.0, neighboring="replace_one"
    )
    rdp = make_accountant("rdp").epsilon(ledger, delta=DELTA).epsilon
    exact = gaussian_epsilon(2 * math.sqrt(4) / 3.0, DELTA)
    assert exact <= rdp <= exact * 1.15


def test_fixed_size_curve_is_non_decreasing_and_ends_at_the_total() -> None:
    ledger = ledger_of(
        [SamplingEvent.fixed_size(10, 100)] * 30, sigma=2.0, neighboring="replace_one"
    )
    acc = make_accountant("rdp")
    curve = [r.epsilon for r in acc.epsilon_curve(ledger, delta=DELTA, steps=[1, 10, 30])]
    assert curve == sorted(curve)
    assert curve[-1] == acc.epsilon(ledger, delta=DELTA).epsilon
