"""The tie of each step to a draw: refused before anything is recorded when the sampler drew
nothing or another number of records; epoch starts follow the first recorded step."""

from __future__ import annotations

import pytest

from dpledger.errors import SamplerMismatchError
from dpledger.sampling.draws import Draw, PendingDraws


def test_steps_claim_the_oldest_draw_first() -> None:
    draws = PendingDraws()
    draws.note(3)
    draws.note(5)
    assert len(draws) == 2
    first = draws.claim(3, describe_sampler=lambda: "unused")
    assert first == Draw(3, None, 0) and len(draws) == 1
    PendingDraws.check_size(first, 3)
    assert draws.pop_oldest() == Draw(5, None, 0) and draws.pop_oldest() is None


def test_a_step_without_a_draw_is_refused_and_names_the_sampler() -> None:
    draws = PendingDraws()
    with pytest.raises(SamplerMismatchError, match=r"\(MySampler, poisson\(q=0.1, n=10\)\)"):
        draws.claim(4, describe_sampler=lambda: "MySampler, poisson(q=0.1, n=10)")
    with pytest.raises(SamplerMismatchError, match="drew no batch"):
        draws.claim(0, describe_sampler=lambda: "S")


def test_a_step_of_another_size_is_refused_and_the_draw_is_consumed() -> None:
    draws = PendingDraws()
    draws.note(3)
    draw = draws.claim(2, describe_sampler=lambda: "S")
    with pytest.raises(SamplerMismatchError, match="drew a batch of 3"):
        PendingDraws.check_size(draw, 2)
    assert len(draws) == 0


def test_describe_is_called_only_when_a_step_is_refused() -> None:
    draws = PendingDraws()
    draws.note(1)

    def fail() -> str:
        raise AssertionError("described a sampler on a valid step")

    draws.claim(1, describe_sampler=fail)


def test_a_new_pass_forgets_prefetched_draws() -> None:
    draws = PendingDraws()
    draws.note(1)
    draws.note(2)
    draws.clear()
    assert len(draws) == 0


def test_the_epoch_start_moves_to_the_first_recorded_step() -> None:
    draws = PendingDraws()
    for index in range(3):
        draws.note(2, epoch=1, position=index)
    draws.note(2, epoch=2, position=0)
    draws.pop_oldest()  # the epoch's first batch was skipped
    marks = [draws.starts_epoch(draws.claim(2, describe_sampler=str)) for _ in range(3)]
    assert marks == [True, False, True]
    assert draws.epoch_recorded(2) and not draws.epoch_recorded(1)
    draws.set_recorded_epoch(None)
    assert not draws.epoch_recorded(2)


def test_a_stream_step_claims_its_own_draw_only() -> None:
    draws = PendingDraws()
    draws.note(2, None, 0)
    draws.note(4, None, 1)
    assert draws.claim_step(2, step=0, describe_sampler=lambda: "cyclic") == Draw(2, None, 0)
    with pytest.raises(SamplerMismatchError, match="step 2 of the correlated-noise stream"):
        draws.claim_step(4, step=2, describe_sampler=lambda: "cyclic")
    assert len(draws) == 0  # consumed either way
    draws.note(4, None, 2)
    with pytest.raises(SamplerMismatchError, match="drew a batch of 4"):
        draws.claim_step(3, step=2, describe_sampler=lambda: "cyclic")
    with pytest.raises(SamplerMismatchError, match=r"\(cyclic\) drew no batch"):
        draws.claim_step(3, step=3, describe_sampler=lambda: "cyclic")
