"""The shuffle gap compares like with like: Chua et al.'s lower bound on a shuffled run's ε and
the Poisson ε of the same q = b/n, both under the ledger's relation (replace-one, or zero-out for
an add/remove ledger), and the verdict "NOT a valid guarantee" only when that comparison supports
it. The Poisson ε is checked against dp-accounting's PLD accountant under the same relation
(``REPLACE_ONE``; ``REPLACE_SPECIAL``, the zero-out relation, for add/remove ledgers)."""

from __future__ import annotations

import math

import pytest
from dp_accounting import GaussianDpEvent, NeighboringRelation, PoissonSampledDpEvent
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

from dpledger import PrivacyLedger, SamplingEvent
from dpledger.accountants.sampling_report import (
    GapRelation,
    RelationEpsilon,
    ShuffleGap,
    shuffle_gap,
)
from dpledger.accountants.shuffle_bound import shuffle_epsilon_lower_bound
from dpledger.errors import InvalidParameterError, RelationMismatchError
from dpledger.ledger.events import NeighboringRelation as LedgerRelation

DELTA = 1e-5
VERDICT = "NOT a valid guarantee"
ORACLE_RELATION = {
    "replace_one": NeighboringRelation.REPLACE_ONE,
    "add_remove": NeighboringRelation.REPLACE_SPECIAL,  # zero-out
}
GRID = [
    (b, n, z, epochs)
    for b, n in ((256, 60_000), (64, 6_400), (1000, 10_000))
    for z in (1.5, 2.0, 3.0, 5.0)
    for epochs in (1, 5, 20)
]


def shuffled_ledger(b: int, n: int, z: float, epochs: int, neighboring: str) -> PrivacyLedger:
    batches = math.ceil(n / b)
    ledger = PrivacyLedger(neighboring=neighboring)
    for t in range(batches * epochs):
        ledger.record_sample(event=SamplingEvent.shuffle(b, n, epoch_start=t % batches == 0))
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=z)
    return ledger


def oracle_poisson_epsilon(q: float, z: float, steps: int, neighboring: str) -> float:
    """dp-accounting's PLD ε of ``steps`` Poisson-sampled Gaussian steps under the relation."""
    accountant = PLDAccountant(ORACLE_RELATION[neighboring])
    accountant.compose(PoissonSampledDpEvent(q, GaussianDpEvent(z)), steps)
    return float(accountant.get_epsilon(DELTA))


def gap_of(b: int, n: int, z: float, epochs: int, neighboring: str) -> ShuffleGap:
    gap = shuffle_gap(shuffled_ledger(b, n, z, epochs, neighboring).compressed(), delta=DELTA)
    assert gap is not None
    return gap


@pytest.mark.parametrize("neighboring", ["replace_one", "add_remove"])
def test_the_reviewed_setting_gets_no_verdict(neighboring: str) -> None:
    """b = 1000, n = 10,000, z = 5, one epoch, δ = 1e-5: the replace-one lower bound (0.317) is
    below the replace-one Poisson ε (0.442) and the zero-out one (0.195) below the add/remove
    Poisson ε (0.231), so neither ledger is told its Poisson ε is invalid (the replace-one ledger
    was, by comparing 0.317 with the add/remove 0.231)."""
    gap = gap_of(1000, 10_000, 5.0, 1, neighboring)
    relation = GapRelation.of_ledger(LedgerRelation(neighboring))
    assert gap.relation is relation
    assert gap.lower_bound is not None and gap.lower_bound.relation is relation
    assert gap.lower_bound.epsilon == shuffle_epsilon_lower_bound(
        batches_per_epoch=10, epochs=1, noise_multiplier=5.0, delta=DELTA, neighboring=neighboring
    )
    oracle = oracle_poisson_epsilon(0.1, 5.0, 10, neighboring)
    assert gap.poisson_epsilon.epsilon == pytest.approx(oracle, rel=2e-3)
    assert gap.lower_bound.epsilon < oracle
    assert not gap.refutes_poisson
    text = gap.describe()
    assert VERDICT not in text and "does not rule out" in text
    assert f"Compared under {relation.label}" in text


@pytest.mark.slow
def test_the_verdict_follows_the_like_for_like_comparison_over_the_grid() -> None:
    """b/n ∈ {256/60000, 64/6400, 1000/10000}, z ∈ {1.5, 2, 3, 5}, E ∈ {1, 5, 20}, both ledger
    relations: the verdict is printed exactly when the lower bound exceeds dp-accounting's
    Poisson ε under the same relation. The grid has settings of both outcomes, and replace-one
    settings whose lower bound exceeds the add/remove Poisson ε but not the replace-one one (the
    comparison of unlike things would have printed the verdict there)."""
    outcomes = set()
    unlike_only = []
    for b, n, z, epochs in GRID:
        steps = math.ceil(n / b) * epochs
        for neighboring in ("replace_one", "add_remove"):
            gap = gap_of(b, n, z, epochs, neighboring)
            assert gap.lower_bound is not None
            oracle = oracle_poisson_epsilon(b / n, z, steps, neighboring)
            supported = gap.lower_bound.epsilon > oracle
            # the grid keeps a margin of several percent between the two numbers
            assert abs(gap.lower_bound.epsilon - oracle) > 0.02 * oracle
            assert gap.refutes_poisson == supported
            assert (VERDICT in gap.describe()) == supported, (b, n, z, epochs, neighboring)
            outcomes.add(supported)
            if neighboring == "replace_one" and not supported:
                add_remove = oracle_poisson_epsilon(b / n, z, steps, "add_remove")
                if gap.lower_bound.epsilon > add_remove:
                    unlike_only.append((b, n, z, epochs))
    assert outcomes == {True, False}
    assert (1000, 10_000, 5.0, 1) in unlike_only and len(unlike_only) >= 6


def test_epsilons_under_different_relations_are_not_compared() -> None:
    replace = RelationEpsilon(0.317, GapRelation.REPLACE_ONE)
    zero_out = RelationEpsilon(0.231, "zero_out")
    assert zero_out.relation is GapRelation.ZERO_OUT
    with pytest.raises(RelationMismatchError, match="an ε under replace-one") as info:
        replace.exceeds(zero_out)
    assert isinstance(info.value, InvalidParameterError) and info.value.parameter == "other"
    assert replace.exceeds(RelationEpsilon(0.3, "replace_one"))
    assert not replace.exceeds(RelationEpsilon(0.442, "replace_one"))
    with pytest.raises(RelationMismatchError):
        ShuffleGap(
            sampling="shuffle(b=1000, n=10000)",
            steps=10,
            epochs=1,
            noise_multiplier=5.0,
            delta=DELTA,
            poisson_epsilon=zero_out,
            lower_bound=replace,
        )
    with pytest.raises(InvalidParameterError, match="relation='add_remove'"):
        RelationEpsilon(0.2, "add_remove")  # add/remove is not a relation of the gap
