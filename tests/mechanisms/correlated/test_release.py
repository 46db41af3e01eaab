"""CorrelatedNoiseRelease: the event is recorded first and matches the factorization; each
step is clipped, checked and noised with the stream's noise.

References: the event's values recomputed in the test from C (``numpy.linalg.norm`` of its
columns, ``matrix_hash``); the noise against a second generator with the same seed; clipping
against a float64 per-record loop.
"""

from __future__ import annotations

import numpy as np
import pytest

from dpledger import PrivacyLedger
from dpledger.errors import InvalidParameterError
from dpledger.mechanisms.correlated import (
    CorrelatedNoiseRelease,
    ParticipationSchema,
    noise_for,
    optimize_banded_toeplitz,
    tree_factorization,
)
from dpledger.mechanisms.correlated.release import count_bands
from dpledger.mechanisms.correlated.strategies import matrix_hash
from dpledger.mechanisms.sum_query import SensitivityCheckError


def make(ledger: PrivacyLedger, **kwargs):  # type: ignore[no-untyped-def]
    fact = optimize_banded_toeplitz(num_steps=20, bands=3)
    schema = ParticipationSchema.cyclic(num_steps=20, period=5)
    return fact, CorrelatedNoiseRelease(
        ledger, fact, schema, l2_norm_bound=1.5, noise_stddev=2.0, dim=4, seed=5, **kwargs
    )


def test_the_event_is_recorded_first_and_describes_c() -> None:
    """Reference: column norms and hash of C computed here; k = ⌈20/5⌉ = 4 orthogonal columns
    (3 bands ≤ period 5), so sens = √(Σ of the 4 largest column norms² in one pattern)."""
    led = PrivacyLedger()
    fact, rel = make(led, sampling_probability=0.2, label="w")
    (event,) = led.correlated_releases
    assert event is rel.event
    norms = np.linalg.norm(fact.strategy, axis=0)
    assert event.max_column_norm == pytest.approx(float(norms.max()), rel=1e-15)
    best = max(float(np.sqrt(np.sum(norms[i::5] ** 2))) for i in range(5))
    assert event.sensitivity == pytest.approx(best, rel=1e-12) and event.sensitivity_exact
    assert event.strategy_hash == matrix_hash(fact.strategy)
    assert (event.bands, event.max_participations, event.sampling) == (
        3,
        4,
        "poisson_within_bands",
    )
    assert count_bands(fact.strategy) == 3
    assert led.num_steps == 0 and led.num_events == 1


def test_release_clips_checks_and_adds_the_stream_noise() -> None:
    """Reference: a float64 loop clipping each record to S(1 − ρ) and the same-seed stream."""
    led = PrivacyLedger()
    fact, rel = make(led)
    twin = noise_for(fact, dim=4, noise_stddev=2.0, seed=5)
    rng = np.random.default_rng(0)
    for _ in range(3):
        records = rng.normal(size=(6, 4)) * 3.0
        got = rel.release(records)
        bound = 1.5 * (1 - 2.0**13 * np.finfo(np.float64).eps)
        expected = sum(r * min(1.0, bound / np.linalg.norm(r)) for r in records)
        np.testing.assert_allclose(got, expected + twin.next(), rtol=1e-12, atol=1e-12)
    assert rel.noise.step == 3


def test_release_refuses_bad_records_before_drawing_noise() -> None:
    led = PrivacyLedger()
    _, rel = make(led)
    with pytest.raises(InvalidParameterError, match="records"):
        rel.release(np.ones((3, 5)))
    with pytest.raises(InvalidParameterError, match="records"):
        rel.release(np.full((3, 4), np.nan))
    assert rel.noise.step == 0


def test_sensitivity_check_refuses_an_unclipped_sum(monkeypatch: pytest.MonkeyPatch) -> None:
    """A clipping stage that does nothing (planted here) is caught by the |R|·S check."""
    import dpledger.mechanisms.correlated.release as release_module

    led = PrivacyLedger()
    _, rel = make(led)
    monkeypatch.setattr(release_module, "clip_records", lambda x, **_: [x])
    with pytest.raises(SensitivityCheckError):
        rel.release(np.full((2, 4), 10.0))
    assert rel.noise.step == 0


def test_each_step_is_recorded_before_its_noise_and_a_given_seed_is_not_reused() -> None:
    """A stream step is recorded for every noise vector handed out (release or next_noise);
    a second release in the same ledger is refused with a given seed (its noise could repeat
    the first one's) and taken with a fresh one (seed=None)."""
    from dpledger.ledger.correlated import NoiseSeedReuseError, StreamStepEvent

    led = PrivacyLedger()
    fact, rel = make(led)
    rel.next_noise()
    rel.release(np.ones((2, 4)) * 0.1)
    assert led.stream_progress(0) == 2
    assert list(led.events())[1:] == [StreamStepEvent(0, 0), StreamStepEvent(0, 1)]
    events = list(led.events())
    with pytest.raises(NoiseSeedReuseError):
        make(led)  # seed=5 again
    assert list(led.events()) == events
    schema = ParticipationSchema.cyclic(num_steps=20, period=5)
    second = CorrelatedNoiseRelease(led, fact, schema, l2_norm_bound=1.5, noise_stddev=2.0, dim=4)
    second.next_noise()
    assert second.index == 1 and led.stream_progress(1) == 1


def test_bad_arguments() -> None:
    with pytest.raises(InvalidParameterError, match="ledger"):
        CorrelatedNoiseRelease(
            "ledger",  # type: ignore[arg-type]
            tree_factorization(4),
            ParticipationSchema.single(num_steps=4),
            l2_norm_bound=1.0,
            noise_stddev=1.0,
            dim=2,
            seed=0,
        )
    with pytest.raises(InvalidParameterError, match="strategy"):
        count_bands(tree_factorization(4).strategy)
