"""The neighbouring relation a ledger needs for a scheme: refused by name, with the advice."""

from __future__ import annotations

import pytest

from dpledger.errors import InvalidParameterError
from dpledger.ledger import NeighboringRelation, SamplingEvent
from dpledger.sampling.relations import check_ledger_relation, default_relation

ADD_REMOVE, REPLACE_ONE = NeighboringRelation.ADD_REMOVE, NeighboringRelation.REPLACE_ONE


@pytest.mark.parametrize(
    ("event", "relation"),
    [
        (SamplingEvent.poisson(0.1, 100), ADD_REMOVE),
        (SamplingEvent.balls_in_bins(4, 100), ADD_REMOVE),
        (SamplingEvent.fixed_size(10, 100), REPLACE_ONE),
        (SamplingEvent.shuffle(10, 100, epoch_start=True), REPLACE_ONE),
    ],
)
def test_default_relation_is_add_remove_when_the_scheme_allows(event, relation) -> None:
    assert default_relation(event) is relation
    check_ledger_relation(event, relation)  # accepted


@pytest.mark.parametrize("event", [SamplingEvent.fixed_size(10, 100), SamplingEvent.shuffle(3, 9)])
def test_a_relation_without_an_analysis_is_refused_with_the_relation_to_use(event) -> None:
    with pytest.raises(InvalidParameterError, match="neighboring='replace_one'") as info:
        check_ledger_relation(event, ADD_REMOVE)
    assert info.value.parameter == "ledger"
    assert event.describe() in str(info.value) and "add_remove" in str(info.value)
