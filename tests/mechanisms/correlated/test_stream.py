"""CorrelatedStream: the bookkeeping of a training run's correlated-noise stream, written once
for both adapters (the release recorded on the first step, each step recorded before its
noise, step T + 1 refused, the state saved and resumed against the ledger's progress).

References: the release event built independently with ``release_event`` from the scheme's
participation; the noise against a second generator ``noise_for`` with the same seed; the
ledger's own ``stream_progress``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from dpledger import PrivacyLedger
from dpledger.errors import InvalidParameterError, LedgerStateError, NoiseStreamEndError
from dpledger.ledger.correlated import NoiseSeedReuseError, NoiseStreamRollbackError
from dpledger.mechanisms.correlated import CorrelatedNoiseSpec, noise_for
from dpledger.mechanisms.correlated.release import release_event
from dpledger.mechanisms.correlated.stream import (
    CorrelatedStream,
    check_noise,
    check_one_group,
    state_from_json,
    state_to_json,
)
from dpledger.mechanisms.gradient_queries import GradientQueries
from dpledger.sampling.cyclic import CyclicScheme

N, PERIOD, T, S, SIGMA, D, SEED = 20, 2, 6, 1.5, 3.0, 4, 7
SPEC = CorrelatedNoiseSpec(strategy="tree_honaker", num_steps=T, period=PERIOD)


def _scheme(seed: int = 0) -> CyclicScheme:
    return CyclicScheme(population_size=N, period=PERIOD, num_steps=T, seed=seed)


def _stream(seed: int = SEED, *, fresh_seed: bool = False) -> CorrelatedStream:
    stream = CorrelatedStream(SPEC, scheme=_scheme(), seed=seed, fresh_seed=fresh_seed)
    stream.start(l2_norm_bound=S, noise_stddev=SIGMA, dim=D, label="w")
    return stream


def _take(stream: CorrelatedStream, ledger: PrivacyLedger, steps: int) -> list[np.ndarray]:
    out = []
    for _ in range(steps):
        stream.record_step(ledger)
        out.append(stream.next_noise())
    return out


def test_the_release_is_recorded_once_then_each_step_before_its_noise() -> None:
    """Reference: the event from release_event with the scheme's participation; the noise of
    a same-seed generator; the ledger's stream_progress after each step."""
    ledger = PrivacyLedger()
    stream = _stream()
    participation = _scheme().participation()
    want = release_event(
        SPEC.factorization(),
        participation.schema,
        l2_norm_bound=S,
        noise_stddev=SIGMA,
        sampling_probability=participation.sampling_probability,
        label="w",
    )
    assert stream.event == want and ledger.correlated_releases == ()
    reference = noise_for(SPEC.factorization(), dim=D, noise_stddev=SIGMA, seed=SEED)
    for t in range(T):
        assert stream.record_step(ledger) == t
        assert ledger.stream_progress(0) == t + 1 and stream.step == t  # recorded, not yet used
        np.testing.assert_array_equal(stream.next_noise(), reference.next())
    assert ledger.correlated_releases == (want,) and stream.release == 0
    with pytest.raises(NoiseStreamEndError, match=f"num_steps={T}"):
        stream.record_step(ledger)
    assert ledger.stream_progress(0) == T


def test_other_values_a_scheme_of_another_spec_and_bad_noise_are_refused() -> None:
    stream = _stream()
    stream.check_values(l2_norm_bound=S, noise_stddev=SIGMA)
    with pytest.raises(InvalidParameterError, match=r"one\s+clip bound"):
        stream.start(l2_norm_bound=S, noise_stddev=2 * SIGMA, dim=D, label="w")
    other = CyclicScheme(population_size=N, period=3, num_steps=T, seed=0)
    with pytest.raises(InvalidParameterError, match="same period"):
        CorrelatedStream(SPEC, scheme=other, seed=0)
    assert check_noise("independent") is None and check_noise(SPEC) is SPEC
    with pytest.raises(InvalidParameterError, match="noise"):
        check_noise("tree")


def test_one_unscaled_group_is_required() -> None:
    sizes = {"a": 3, "b": 2}
    layers = {"a": "l1", "b": "l2"}
    flat = GradientQueries(sizes, l2_norm_bound=S, noise_multiplier=1.0, layers=layers)
    assert check_one_group(flat) == S
    per_layer = GradientQueries(
        sizes, l2_norm_bound=S, noise_multiplier=1.0, groups="per_layer", layers=layers
    )
    with pytest.raises(InvalidParameterError, match="'all'"):
        check_one_group(per_layer, groups="per_layer")
    scaled = GradientQueries(
        sizes, l2_norm_bound=S, noise_multiplier=1.0, scales={"a": 2.0}, layers=layers
    )
    with pytest.raises(InvalidParameterError, match="scales"):
        check_one_group(scaled)


def test_a_given_seed_is_not_reused_in_a_ledger_with_a_release() -> None:
    ledger = PrivacyLedger()
    _take(_stream(), ledger, 1)
    with pytest.raises(NoiseSeedReuseError):
        _take(_stream(), ledger, 1)
    assert len(ledger.correlated_releases) == 1
    _take(_stream(seed=8, fresh_seed=True), ledger, 1)
    assert len(ledger.correlated_releases) == 2 and ledger.stream_progress(1) == 1


def test_the_state_continues_the_noise_through_json_bit_for_bit() -> None:
    """Reference: one uninterrupted stream of the same seed."""
    whole = _take(_stream(), PrivacyLedger(), T)
    ledger = PrivacyLedger()
    first = _stream()
    _take(first, ledger, 3)
    saved = json.loads(json.dumps(state_to_json(first.state_dict())))
    resumed = CorrelatedStream(SPEC, scheme=_scheme(), seed=0)
    resumed.load_state_dict(state_from_json(saved), ledger=ledger)
    assert (resumed.step, resumed.release, resumed.seed) == (3, 0, SEED)
    rest = _take(resumed, ledger, T - 3)
    for a, b in zip(whole, whole[:3] + rest, strict=True):
        np.testing.assert_array_equal(a, b)
    assert len(ledger.correlated_releases) == 1 and ledger.stream_progress(0) == T


def test_noise_state_survives_json_exactly() -> None:
    """The saved state (bit generator, step, float64 buffers as bytes) continues the stream
    bit for bit."""
    fact = SPEC.factorization()
    a = noise_for(fact, dim=7, noise_stddev=1.0, seed=3)
    a.next(), a.next(), a.next()
    b = noise_for(fact, dim=7, noise_stddev=1.0, seed=3)
    b.load_state_dict(state_from_json(state_to_json({"noise": a.state_dict()}))["noise"])
    for _ in range(T - 3):
        np.testing.assert_array_equal(a.next(), b.next())


def test_a_state_behind_or_ahead_of_the_ledger_or_without_its_release_is_refused() -> None:
    ledger = PrivacyLedger()
    stream = _stream()
    _take(stream, ledger, 2)
    behind = stream.state_dict()
    _take(stream, ledger, 2)
    fresh = CorrelatedStream(SPEC, scheme=_scheme(), seed=0)
    with pytest.raises(NoiseStreamRollbackError, match=r"steps 2\.\.3 ") as info:
        fresh.load_state_dict(behind, ledger=ledger)
    assert (info.value.checkpoint_step, info.value.ledger_step, info.value.release) == (2, 4, 0)
    assert fresh.step == 0 and fresh.event is None  # nothing changed
    with pytest.raises(InvalidParameterError, match="holds this model's correlated-noise"):
        fresh.load_state_dict(stream.state_dict(), ledger=PrivacyLedger())
    other = PrivacyLedger()
    _take(_stream(), other, 1)
    with pytest.raises(LedgerStateError, match="records only 1 steps"):
        fresh.load_state_dict(stream.state_dict(), ledger=other)
    without_index = {**stream.state_dict(), "release": None}
    fresh.load_state_dict(without_index, ledger=ledger)  # the last matching release
    assert (fresh.release, fresh.step) == (0, 4)
    with pytest.raises(InvalidParameterError, match="spec"):
        fresh.load_state_dict({**behind, "spec": "tree(T=6, period=3)"}, ledger=ledger)


def test_a_loaded_stream_resumes_in_the_ledger_it_is_given() -> None:
    ledger = PrivacyLedger()
    stream = _stream()
    _take(stream, ledger, 2)
    loaded = _stream(seed=SEED)
    loaded.load_state_dict(stream.state_dict(), ledger=None)
    with pytest.raises(InvalidParameterError, match="holds this model's"):
        loaded.resume(PrivacyLedger())
    loaded.resume(ledger)
    assert loaded.release == 0
    _take(loaded, ledger, 1)
    assert ledger.stream_progress(0) == 3
    unstarted = CorrelatedStream(SPEC, scheme=_scheme(), seed=3, fresh_seed=True)
    unstarted.load_state_dict(
        CorrelatedStream(SPEC, scheme=_scheme(), seed=9).state_dict(), ledger=None
    )
    assert (unstarted.seed, unstarted.fresh_seed, unstarted.recorded) == (9, False, False)
