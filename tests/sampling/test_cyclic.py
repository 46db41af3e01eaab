"""The cyclic scheme draws exactly the participation pattern its release records.

References: the cyclic participation of Choquette-Choo et al. 2023 ("Multi-Epoch Matrix
Factorization Mechanisms for Private Machine Learning", section 2) and Poisson sampling within
cyclic bands ("Amplified Banded Matrix Factorization", section 3), checked by brute force over
every record and step; the Bernoulli(q) draws against the binomial distribution's moments.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from dpledger.errors import InvalidParameterError
from dpledger.ledger import PrivacyLedger
from dpledger.mechanisms.correlated import optimize_banded_toeplitz
from dpledger.mechanisms.correlated.release import release_event
from dpledger.sampling import CyclicScheme
from dpledger.sampling.cyclic import CyclicParticipation, CyclicPasses
from dpledger.sampling.participation import ParticipationKind


def _steps_of_every_record(scheme: CyclicScheme) -> list[list[int]]:
    steps: list[list[int]] = [[] for _ in range(scheme.population_size)]
    for t in range(scheme.num_steps):
        for i in scheme.draw(t).tolist():
            steps[i].append(t)
    return steps


def test_the_groups_are_a_seeded_partition() -> None:
    scheme = CyclicScheme(population_size=103, period=7, num_steps=20, seed=3)
    groups = [scheme.group(g) for g in range(7)]
    everyone = np.concatenate(groups)
    assert sorted(everyone.tolist()) == list(range(103))  # disjoint and covering
    for g, members in enumerate(groups):
        assert (scheme.group_of[members] == g).all()
    again = CyclicScheme(population_size=103, period=7, num_steps=20, seed=3)
    other = CyclicScheme(population_size=103, period=7, num_steps=20, seed=4)
    assert all(np.array_equal(a, again.group(g)) for g, a in enumerate(groups))
    assert any(not np.array_equal(a, other.group(g)) for g, a in enumerate(groups))


@pytest.mark.statistical
def test_each_record_joins_a_group_uniformly_and_independently() -> None:
    """Reference: independent uniform assignment. Group sizes are Binomial(n, 1/period): each
    within 5 standard deviations of n/period (a two-sided tail of about 6e-7 per group), and
    the pair counts of two records' groups follow a uniform distribution on period² cells
    (chi-square over 1,000 seeds against its 99.99% quantile)."""
    from scipy import stats

    n, period = 20_000, 7
    sizes = np.bincount(
        CyclicScheme(population_size=n, period=period, num_steps=7, seed=11).group_of,
        minlength=period,
    )
    sd = math.sqrt(n * (1 / period) * (1 - 1 / period))
    assert np.all(np.abs(sizes - n / period) < 5 * sd)
    seeds = 1_000
    pairs = np.zeros((period, period))
    for seed in range(seeds):
        g = CyclicScheme(population_size=10, period=period, num_steps=7, seed=seed).group_of
        pairs[g[0], g[1]] += 1
    chi2 = float(((pairs - seeds / period**2) ** 2 / (seeds / period**2)).sum())
    assert chi2 < stats.chi2.ppf(0.9999, period**2 - 1)


@pytest.mark.parametrize(("n", "period"), [(5, 2), (103, 7), (1000, 3)])
def test_adding_a_record_moves_no_other_record_to_another_group(n: int, period: int) -> None:
    """The add/remove coupling the analysis rests on: with the same seed, the first n records
    keep their groups when an (n + 1)-th record is added (an equal-size split would move
    some of them)."""
    small = CyclicScheme(population_size=n, period=period, num_steps=period, seed=5)
    large = CyclicScheme(population_size=n + 1, period=period, num_steps=period, seed=5)
    assert np.array_equal(small.group_of, large.group_of[:n])


@pytest.mark.parametrize(("n", "period", "steps"), [(10, 3, 10), (12, 4, 4), (9, 9, 20), (5, 1, 3)])
def test_whole_groups_give_exactly_the_cyclic_patterns(n: int, period: int, steps: int) -> None:
    """Brute force: every record's steps are {g, g + period, …} ∩ [0, T) for its group g."""
    scheme = CyclicScheme(population_size=n, period=period, num_steps=steps, seed=0)
    participation = scheme.participation()
    assert isinstance(participation, CyclicParticipation)
    schema, q = participation
    assert q is None
    assert schema.kind is ParticipationKind.CYCLIC
    assert (schema.num_steps, schema.min_separation) == (steps, period)
    assert schema.max_participations == math.ceil(steps / period)
    allowed = set(schema.patterns())
    for i, record_steps in enumerate(_steps_of_every_record(scheme)):
        g = int(scheme.group_of[i])
        assert record_steps == list(range(g, steps, period))
        assert tuple(record_steps) in allowed
        assert all(t % period == g for t in record_steps)
    assert scheme.average_denominator == n / period


def test_poisson_within_groups_keeps_every_step_in_the_records_pattern() -> None:
    scheme = CyclicScheme(
        population_size=60, period=4, num_steps=30, sampling_probability=0.3, seed=1
    )
    schema, q = scheme.participation()
    assert q == 0.3 and schema.kind is ParticipationKind.CYCLIC and schema.min_separation == 4
    for i, record_steps in enumerate(_steps_of_every_record(scheme)):
        g = int(scheme.group_of[i])
        assert set(record_steps) <= set(range(g, 30, 4))
    assert scheme.average_denominator == pytest.approx(60 / 4 * 0.3, rel=1e-15)


def test_poisson_within_groups_draws_independent_bernoulli_q() -> None:
    """Each scheduled appearance of a record is a Bernoulli(q) draw, independent of the others.

    Over N scheduled appearances the count kept is Binomial(N, q): within 4 standard deviations
    √(N q (1 − q)) of N q. Independence: over the M pairs of consecutive appearances of the same
    record, both kept is Bernoulli(q²) (within 4 √(M q² (1 − q²))), and the same for a record
    and its neighbour in the group at one step (no dependence across records).
    """
    n, period, steps, q = 400, 5, 100, 0.3
    scheme = CyclicScheme(
        population_size=n, period=period, num_steps=steps, sampling_probability=q, seed=7
    )
    kept = np.zeros((n, steps), dtype=bool)
    for t in range(steps):
        kept[scheme.draw(t), t] = True
    scheduled = np.zeros((n, steps), dtype=bool)
    for i in range(n):
        scheduled[i, int(scheme.group_of[i]) :: period] = True
    assert not (kept & ~scheduled).any()
    total = int(scheduled.sum())
    assert total == n * steps // period
    count = int(kept.sum())
    assert abs(count - total * q) <= 4 * math.sqrt(total * q * (1 - q))
    # consecutive appearances of one record
    first = kept[:, : steps - period][scheduled[:, : steps - period]]
    second = kept[:, period:][scheduled[:, period:]]
    pairs = first.size
    both = int((first & second).sum())
    assert abs(both - pairs * q * q) <= 4 * math.sqrt(pairs * q * q * (1 - q * q))
    # two records of one group at the same step
    members = [scheme.group(g) for g in range(period)]
    a = np.concatenate(
        [kept[m[0::2][: len(m) // 2], g::period].ravel() for g, m in enumerate(members)]
    )
    b = np.concatenate(
        [kept[m[1::2][: len(m) // 2], g::period].ravel() for g, m in enumerate(members)]
    )
    together = int((a & b).sum())
    assert abs(together - a.size * q * q) <= 4 * math.sqrt(a.size * q * q * (1 - q * q))


def test_a_draw_depends_only_on_seed_and_step() -> None:
    """Resumed runs and other processes draw the same batch for the same step."""
    kwargs = {"population_size": 50, "period": 3, "num_steps": 12, "sampling_probability": 0.5}
    one = CyclicScheme(**kwargs, seed=11)  # type: ignore[arg-type]
    two = CyclicScheme(**kwargs, seed=11)  # type: ignore[arg-type]
    for t in reversed(range(12)):  # any order
        assert np.array_equal(one.draw(t), two.draw(t))
    assert one == two and hash(one) == hash(two)
    other = CyclicScheme(**kwargs, seed=12)  # type: ignore[arg-type]
    assert other != one
    assert any(not np.array_equal(one.draw(t), other.draw(t)) for t in range(12))


def test_q_equal_one_uses_the_whole_group() -> None:
    scheme = CyclicScheme(
        population_size=20, period=4, num_steps=8, sampling_probability=1.0, seed=0
    )
    for t in range(8):
        assert np.array_equal(scheme.draw(t), scheme.group(t % 4))


def test_the_release_of_the_participation_is_recorded_amplified() -> None:
    """The schema and q of the scheme build the ledger event (amplified BandMF, bands ≤
    period)."""
    scheme = CyclicScheme(
        population_size=40, period=4, num_steps=16, sampling_probability=0.25, seed=0
    )
    schema, q = scheme.participation()
    fact = optimize_banded_toeplitz(num_steps=16, bands=4)
    event = release_event(fact, schema, l2_norm_bound=1.0, noise_stddev=2.0, sampling_probability=q)
    assert event.sampling == "poisson_within_bands"
    assert event.sampling_probability == 0.25
    assert (event.participation, event.min_separation, event.max_participations) == (
        "cyclic",
        4,
        4,
    )
    ledger = PrivacyLedger()
    ledger.record_correlated_release(event)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"population_size": 0, "period": 1, "num_steps": 1, "seed": 0}, "population_size"),
        ({"population_size": 3, "period": 4, "num_steps": 8, "seed": 0}, "period"),
        ({"population_size": 10, "period": 5, "num_steps": 4, "seed": 0}, "period"),
        ({"population_size": 10, "period": 0, "num_steps": 4, "seed": 0}, "period"),
        ({"population_size": 10, "period": 2, "num_steps": 0, "seed": 0}, "num_steps"),
        ({"population_size": 10, "period": 2, "num_steps": 4, "seed": -1}, "seed"),
        ({"population_size": 10, "period": 2, "num_steps": 4, "seed": 1.5}, "seed"),
        (
            {
                "population_size": 10,
                "period": 2,
                "num_steps": 4,
                "seed": 0,
                "sampling_probability": 0,
            },
            "sampling_probability",
        ),
        (
            {
                "population_size": 10,
                "period": 2,
                "num_steps": 4,
                "seed": 0,
                "sampling_probability": 1.5,
            },
            "sampling_probability",
        ),
    ],
)
def test_bad_parameters_are_refused_by_name(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(InvalidParameterError, match=name):
        CyclicScheme(**kwargs)  # type: ignore[arg-type]


def test_a_step_beyond_the_stream_and_a_bad_group_are_refused() -> None:
    scheme = CyclicScheme(population_size=10, period=2, num_steps=4, seed=0)
    with pytest.raises(InvalidParameterError, match="step"):
        scheme.draw(4)
    with pytest.raises(InvalidParameterError, match="step"):
        scheme.draw(-1)
    with pytest.raises(InvalidParameterError, match="index"):
        scheme.group(2)
    assert scheme.describe() == "cyclic(period=2, T=4, n=10)"
    assert "seed=0" in repr(scheme)


def test_a_scheme_state_rebuilds_the_same_draws_and_only_its_seed_may_differ() -> None:
    scheme = CyclicScheme(population_size=12, period=3, num_steps=6, sampling_probability=0.5,
                          seed=4)  # fmt: skip
    state = scheme.state()
    assert state == {"population_size": 12, "period": 3, "num_steps": 6,
                     "sampling_probability": 0.5, "seed": 4}  # fmt: skip
    other_seed = CyclicScheme(**{**state, "seed": 9})
    again = CyclicScheme.from_state(state, like=other_seed)
    assert again == scheme and all(np.array_equal(again.draw(t), scheme.draw(t)) for t in range(6))
    for bad in ({**state, "period": 2}, {**state, "sampling_probability": None}):
        with pytest.raises(InvalidParameterError, match="only its seed may differ") as err:
            CyclicScheme.from_state(bad, like=scheme, name="state['scheme']")
        assert err.value.parameter == "state['scheme']"
    for bad in (None, {**state, "extra": 1}, {"seed": 4}):
        with pytest.raises(InvalidParameterError, match="state"):
            CyclicScheme.from_state(bad, like=scheme)


# ---------------------------------------------------------------------- CyclicPasses


def _passes(num_steps: int = 6, period: int = 2) -> CyclicPasses:
    return CyclicPasses(
        CyclicScheme(population_size=10, period=period, num_steps=num_steps, seed=0)
    )


def test_passes_move_on_by_a_period_until_a_model_drives_them() -> None:
    passes = _passes()
    assert [passes.start_pass() for _ in range(3)] == [0, 2, 4]
    passes.seek(2)
    passes.drive()
    assert passes.start_pass() == 2 and passes.start_pass() == 2  # abandoned passes take no step
    passes.released(2)
    assert passes.next_step == 2  # the pass's last step (3) is not released yet
    passes.released(3)
    assert passes.next_step == 4


def test_a_step_drawn_after_its_release_is_noted_once() -> None:
    passes = _passes()
    passes.drive()
    passes.drawn(0)
    passes.released(0)
    passes.drawn(1)  # drawn before its release: fine
    passes.released(1)
    assert passes.take_stale_draws() == []
    passes.drawn(0)  # a pass started before the previous one ended
    passes.drawn(1)
    passes.drawn(2)
    assert passes.take_stale_draws() == [0, 1] and passes.take_stale_draws() == []
    undriven = _passes()
    undriven.released(3)
    undriven.drawn(0)
    assert undriven.take_stale_draws() == []  # on its own a sampler notes nothing


@pytest.mark.parametrize("step", [1, 8, -2, 2.0, True])
def test_seek_takes_a_multiple_of_the_period_within_the_stream(step: object) -> None:
    with pytest.raises(InvalidParameterError, match="step"):
        _passes().seek(step)


def test_seek_forgets_stale_draws_and_restore_puts_the_pass_back() -> None:
    passes = _passes()
    passes.drive()
    passes.released(1)
    passes.drawn(0)
    passes.seek(4)
    assert passes.take_stale_draws() == [] and passes.next_step == 4
    passes.restore(2)
    assert passes.next_step == 2
    passes.seek(6)  # T itself: the stream is over
    assert passes.next_step == 6


def test_a_stream_of_part_of_a_pass_is_refused() -> None:
    with pytest.raises(InvalidParameterError, match="multiple of period=4"):
        _passes(num_steps=6, period=4)
