"""A release's recorded sensitivity is recomputed from its parameters before it is accounted.

References: the numbers :func:`release_event` computed from the factorization itself (a genuine
release must replay to exactly them, through a file), and the μ-GDP closed form of one Gaussian
(``tests.gdp_oracle``) for the ε they give. The forgeries are made the way a forger (or a
version with a bug) would: a value edited in the ``correlated_release`` line and the hash chain
recomputed, so that the file verifies.
"""

from __future__ import annotations

import math
from pathlib import Path

import attrs
import pytest

from dpledger import PrivacyLedger
from dpledger.accountants.base import make_accountant
from dpledger.errors import ComputationBudgetError, InvalidParameterError, UnsupportedLedgerError
from dpledger.ledger import CorrelatedReleaseEvent
from dpledger.ledger.correlated import ReleaseMismatchError
from dpledger.ledger.steps import CompressedLedger
from dpledger.mechanisms.correlated import (
    ParticipationSchema,
    optimize_banded_toeplitz,
    optimize_blt,
    tree_factorization,
)
from dpledger.mechanisms.correlated.release import release_event
from dpledger.mechanisms.correlated.strategies import MatrixFactorization, blt_factorization
from dpledger.mechanisms.correlated.verification import verified_release
from tests.gdp_oracle import gaussian_epsilon
from tests.ledger.conftest import content_of, rechain, seal

DELTA = 1e-5
ACCOUNTANTS = ("rdp", "pld", "prv", "gdp")


def genuine_releases() -> dict[str, CorrelatedReleaseEvent]:
    """One release of every strategy, under every participation schema that applies."""
    tree = tree_factorization(32)
    honaker = tree_factorization(32, honaker=True)
    banded = optimize_banded_toeplitz(num_steps=48, bands=4)
    blt = optimize_blt(num_steps=40, buffers=2)
    return {
        "tree_single": release_event(
            tree, ParticipationSchema.single(num_steps=32), l2_norm_bound=1.0, noise_stddev=3.0
        ),
        "honaker_min_sep": release_event(
            honaker,
            ParticipationSchema.min_separation_schema(
                num_steps=32, max_participations=3, min_separation=8
            ),
            l2_norm_bound=0.5,
            noise_stddev=2.0,
            label="model",
        ),
        "banded_cyclic": release_event(
            banded,
            ParticipationSchema.cyclic(num_steps=48, period=8),
            l2_norm_bound=1.0,
            noise_stddev=4.0,
        ),
        "banded_amplified": release_event(
            banded,
            ParticipationSchema.cyclic(num_steps=48, period=6),
            l2_norm_bound=1.0,
            noise_stddev=1.5,
            sampling_probability=0.25,
        ),
        "blt_cyclic": release_event(
            blt,
            ParticipationSchema.cyclic(num_steps=40, period=10),
            l2_norm_bound=2.0,
            noise_stddev=5.0,
        ),
        "blt_min_sep": release_event(
            blt_factorization(12, omega=[-0.3, 0.2], theta=[0.5, 0.9]),
            ParticipationSchema.min_separation_schema(
                num_steps=12, max_participations=3, min_separation=3
            ),
            l2_norm_bound=1.0,
            noise_stddev=2.0,
        ),
    }


def written(path: Path, event: CorrelatedReleaseEvent) -> list[bytes]:
    with PrivacyLedger(path) as led:
        led.record_correlated_release(event)
    return path.read_bytes().splitlines(keepends=True)


def forged(path: Path, lines: list[bytes], old: bytes, new: bytes) -> PrivacyLedger:
    """The file with ``old`` replaced by ``new`` in its release line, re-hashed so it
    verifies."""
    (index,) = [i for i, line in enumerate(lines) if b'"kind":"correlated_release"' in line]
    assert lines[index].count(old) == 1
    lines = list(lines)
    lines[index] = seal(content_of(lines[index]).replace(old, new))
    path.write_bytes(b"".join(rechain(lines, index)))
    return PrivacyLedger.load(path)


def field(name: str, value: float) -> bytes:
    return f'"{name}":{value!r}'.encode()


@pytest.mark.parametrize("case", sorted(genuine_releases()))
def test_a_genuine_release_of_every_strategy_replays_to_its_own_numbers(
    case: str, tmp_path: Path
) -> None:
    """Reference: the event as release_event computed it from C. After a file round trip the
    check recomputes exactly its numbers (so the ε is the one computed from them), and the
    unamplified ε is the μ-GDP closed form at μ = sens·S/σ."""
    event = genuine_releases()[case]
    written(tmp_path / "r.dpl", event)
    loaded = PrivacyLedger.load(tmp_path / "r.dpl")
    (back,) = loaded.correlated_releases
    assert back == event
    assert verified_release(back, release=0) == event
    result = make_accountant("pld").epsilon(loaded, delta=DELTA)
    if not event.amplified:
        assert result.value == pytest.approx(gaussian_epsilon(event.gaussian_mu, DELTA), rel=1e-9)
        (gaussian,) = loaded.to_dp_event().events
        z = event.noise_stddev / (event.l2_norm_bound * event.sensitivity)
        assert gaussian.noise_multiplier == z


@pytest.mark.parametrize("name", ACCOUNTANTS)
def test_a_forged_smaller_sensitivity_is_refused(name: str, tmp_path: Path) -> None:
    """A tree release whose line claims a sensitivity between max_j ‖C_j‖ and the true one (so
    the line itself is consistent and the file verifies): every accountant refuses it, naming
    the release and both values, where it used to account a smaller ε."""
    event = genuine_releases()["honaker_min_sep"]
    smaller = (event.sensitivity + event.max_column_norm) / 2
    assert event.max_column_norm < smaller < event.sensitivity
    led = forged(
        tmp_path / "f.dpl",
        written(tmp_path / "r.dpl", event),
        field("sensitivity", event.sensitivity),
        field("sensitivity", smaller),
    )
    assert led.correlated_releases[0].sensitivity == smaller  # the file verified
    with pytest.raises(ReleaseMismatchError) as info:
        make_accountant(name).epsilon(led, delta=DELTA)
    err = info.value
    assert (err.release, err.label, err.field) == (0, "model", "sensitivity")
    assert err.recorded == smaller and err.recomputed == event.sensitivity
    assert repr(smaller) in str(err) and repr(event.sensitivity) in str(err)
    assert isinstance(err, UnsupportedLedgerError)
    with pytest.raises(ReleaseMismatchError):
        led.to_dp_event()


def test_a_forged_larger_sensitivity_is_refused_too(tmp_path: Path) -> None:
    """A disagreement either way means the recorded number is not what was computed."""
    event = genuine_releases()["tree_single"]
    # single participation: sensitivity = max column norm; both raised together stay consistent
    bigger = event.sensitivity * 1.5
    lines = written(tmp_path / "r.dpl", event)
    line = content_of(next(x for x in lines if b"correlated_release" in x))
    line = line.replace(
        field("max_column_norm", event.max_column_norm), field("max_column_norm", bigger)
    )
    lines = [seal(line) if b"correlated_release" in x else x for x in lines]
    led = forged(
        tmp_path / "f.dpl",
        lines,
        field("sensitivity", event.sensitivity),
        field("sensitivity", bigger),
    )
    with pytest.raises(ReleaseMismatchError, match="sensitivity"):
        make_accountant("rdp").epsilon(led, delta=DELTA)


def test_within_rounding_the_larger_value_is_used() -> None:
    """A recorded value one rounding step below its recomputation (another BLAS order) is
    accepted, and the accountants get the larger of the two."""
    event = genuine_releases()["banded_cyclic"]
    lower = attrs.evolve(event, sensitivity=math.nextafter(event.sensitivity, 0.0))
    assert verified_release(lower, release=0).sensitivity == event.sensitivity
    off = attrs.evolve(event, sensitivity=event.sensitivity * (1 - 1e-6))
    with pytest.raises(ReleaseMismatchError):
        verified_release(off, release=0)


def test_amplified_release_column_norm_and_bands_are_checked(tmp_path: Path) -> None:
    """Amplification is accounted with max_j ‖C_j‖ and holds only for C with at most
    ``min_separation`` bands: a smaller column norm (with the sensitivity lowered alike so
    the line stays consistent), or fewer bands recorded than C has, is refused."""
    event = genuine_releases()["banded_amplified"]
    lines = written(tmp_path / "r.dpl", event)
    col = event.max_column_norm * 0.5
    line = content_of(next(x for x in lines if b"correlated_release" in x))
    line = line.replace(field("sensitivity", event.sensitivity), field("sensitivity", col * 2))
    lines = [seal(line) if b"correlated_release" in x else x for x in lines]
    led = forged(
        tmp_path / "f.dpl",
        lines,
        field("max_column_norm", event.max_column_norm),
        field("max_column_norm", col),
    )
    with pytest.raises(ReleaseMismatchError) as info:
        make_accountant("rdp").epsilon(led, delta=DELTA)
    assert info.value.field in ("sensitivity", "max_column_norm")
    fewer = attrs.evolve(event, bands=3)
    with pytest.raises(ReleaseMismatchError) as info:
        make_accountant("rdp").epsilon(CompressedLedger(correlated=(fewer,)), delta=DELTA)
    assert (info.value.field, info.value.recorded, info.value.recomputed) == ("bands", 3, 4)


def test_parameters_that_do_not_give_the_recorded_matrix_are_refused(tmp_path: Path) -> None:
    """Coefficients edited in the line (the sensitivity left as it was): the rebuilt C has
    another hash and another sensitivity; the first disagreement is named."""
    event = genuine_releases()["banded_cyclic"]
    c1 = event.strategy_params["coefficients"][1]
    led = forged(
        tmp_path / "f.dpl",
        written(tmp_path / "r.dpl", event),
        repr(c1).encode() + b",",
        repr(c1 / 2).encode() + b",",
    )
    with pytest.raises(ReleaseMismatchError) as info:
        make_accountant("pld").epsilon(led, delta=DELTA)
    assert info.value.field in ("sensitivity", "max_column_norm", "strategy_hash")


@pytest.mark.parametrize(
    "changes",
    [
        {"strategy": "custom"},
        {"strategy_params": {"num_steps": 32, "extra": 1}},
        {"strategy_params": {"num_steps": 16}},
        {
            "strategy": "banded_toeplitz",
            "strategy_params": {"num_steps": 32, "coefficients": ["a"]},
        },
        {"strategy": "blt", "strategy_params": {"num_steps": 32, "omega": [1.0], "theta": [1.5]}},
    ],
)
def test_a_release_that_cannot_be_rebuilt_is_refused_not_trusted(changes: dict) -> None:  # type: ignore[type-arg]
    event = attrs.evolve(genuine_releases()["tree_single"], **changes)
    with pytest.raises(UnsupportedLedgerError, match=r"release 0.*cannot be checked"):
        make_accountant("rdp").epsilon(CompressedLedger(correlated=(event,)), delta=DELTA)


def test_a_release_too_large_to_rebuild_is_refused_before_allocating() -> None:
    """A line claiming T = 10¹⁵ steps (a valid line; C would need ~10³¹ bytes) is refused with
    the budget error, at once."""
    event = attrs.evolve(
        genuine_releases()["tree_single"],
        num_steps=10**15,
        strategy_params={"num_steps": 10**15},
    )
    with pytest.raises(ComputationBudgetError, match="release 0"):
        make_accountant("rdp").epsilon(CompressedLedger(correlated=(event,)), delta=DELTA)


def test_release_event_refuses_a_factorization_its_parameters_do_not_rebuild() -> None:
    """A hand-made factorization (here the tree's C doubled, B halved: still B·C = A) whose
    kind and parameters name another C would be refused at replay; it is refused before it is
    recorded."""
    tree = tree_factorization(8)
    odd = MatrixFactorization("tree", {"num_steps": 8}, 2 * tree.strategy, tree.decoder / 2)
    with pytest.raises(InvalidParameterError, match="parameters determine its C"):
        release_event(
            odd, ParticipationSchema.single(num_steps=8), l2_norm_bound=1.0, noise_stddev=1.0
        )
