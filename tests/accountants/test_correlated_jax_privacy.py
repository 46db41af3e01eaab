"""BandMF ε, with and without amplification, against JAX Privacy's own accounting.

Reference: JAX Privacy 2.0.0, ``BandMFExecutionPlanConfig(iterations=T, strategy=c,
noise_multiplier=z, sampling_prob=q).plan.dp_event`` (``amplified_bandmf_event``:
``SelfComposed(PoissonSampled(q, Gaussian(z)), ⌈T / b⌉)``, Choquette-Choo et al. 2023,
"Amplified Banded Matrix Factorization", section 4), ε at δ = 1e-5 by dp-accounting's
``PLDAccountant`` (pessimistic, interval 1e-4), as JAX Privacy calibrates with. The values were
computed in a separate environment by ``benchmarks/jax_privacy_reference.py`` and are read from
``data/jax_privacy_bandmf.json`` (no JAX at test time); the file records the versions and JAX
Privacy's definition of every parameter.

The mapping, read from both sources. JAX Privacy's C is the lower-triangular Toeplitz matrix of
the coefficients c (b = len(c) bands); the records split into b groups, step t Poisson-samples
group t mod b with probability q (q = 1: the whole group, no amplification); Z has standard
deviation z·S·‖c‖₂, ‖c‖₂ being C's largest column norm. In dpledger that is
``banded_toeplitz_factorization(T, c)``, ``ParticipationSchema.cyclic(num_steps=T, period=b)``,
S = 1, σ = z·‖c‖₂, and ``sampling_probability=q`` for q < 1, none for q = 1. JAX Privacy's
default relation is zero-out (``REPLACE_SPECIAL``); the file also holds ε under add-or-remove,
the relation of dpledger's ledger, which dp-accounting computes from the same PLD (equal).
(JAX Privacy itself refuses add-or-remove with its equal-split groups and asks for
independent group assignment there, which is what dpledger's ``CyclicScheme`` draws; the file
records that refusal. This test compares ε of the same PLD, not that choice of relation.)
JAX Privacy's optimised strategies have ‖c‖₂ = 1, where σ = z; the file also holds two of them
rescaled to c_0 = 1 (‖c‖₂ ≈ 1.55 and 1.57), same ε in JAX Privacy, so that dpledger's division
by its own largest column norm is tested too.

Tolerance. Both sides discretise a PLD pessimistically with interval h = 1e-4: each of the k
composed losses is rounded up by less than h, so each reported ε lies in
[ε_exact, ε_exact + k·h) (dpledger's ``pld`` module docstring; dp-accounting's
``PLDAccountant``), and two such values differ by less than k·h, k = ⌈T / b⌉. Without sampling
dpledger's PLD accountant uses the μ-GDP closed form (exact), so there
0 ≤ ε_JAX − ε_dpledger < k·h whenever the two sensitivities agree. The RDP accountant is an upper
bound on ε_exact ≥ ε_PLD − k·h.

Where the mapping is not exact: without sampling and T not a multiple of b, C's last column in a
record's cyclic pattern is cut short, and dpledger's exact sensitivity
(√(Σ_j ‖C_j‖²) over the pattern) is below JAX Privacy's √⌈T / b⌉·‖c‖₂; dpledger's ε is then
smaller, and equals the closed form at its own sensitivity (tested).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from dpledger import PrivacyLedger
from dpledger.accountants.base import make_accountant
from dpledger.ledger import CorrelatedReleaseEvent
from dpledger.mechanisms.correlated import ParticipationSchema
from dpledger.mechanisms.correlated.release import release_event
from dpledger.mechanisms.correlated.strategies import banded_toeplitz_factorization
from tests.gdp_oracle import gaussian_epsilon

DATA = json.loads((Path(__file__).parent / "data" / "jax_privacy_bandmf.json").read_text())
DELTA: float = DATA["delta"]
GRID: float = DATA["value_discretization_interval"]
CASES: list[dict[str, Any]] = DATA["cases"]
ROUNDING = 1e-12  # float64 rounding of ε values of order 10


def case_id(case: dict[str, Any]) -> str:
    """T, b, q and z (or the target ε) of a case, for pytest's ids."""
    tail = (
        f"eps{case['target_epsilon']}" if case["target_epsilon"] else f"z{case['noise_multiplier']}"
    )
    scaled = "-c0is1" if case["max_column_norm"] > 1.5 else ""
    return f"T{case['iterations']}-b{case['num_bands']}-q{case['sampling_prob']}-{tail}{scaled}"


def dpledger_release(case: dict[str, Any]) -> CorrelatedReleaseEvent:
    """The release JAX Privacy's parameters describe, in dpledger's terms (module docstring)."""
    t, b, q = case["iterations"], case["num_bands"], case["sampling_prob"]
    norm = math.sqrt(math.fsum(c * c for c in case["strategy"]))
    return release_event(
        banded_toeplitz_factorization(t, case["strategy"]),
        ParticipationSchema.cyclic(num_steps=t, period=b),
        l2_norm_bound=1.0,
        noise_stddev=case["noise_multiplier"] * 1.0 * norm,
        sampling_probability=None if q == 1.0 else q,
    )


def ledger_of(event: CorrelatedReleaseEvent) -> PrivacyLedger:
    led = PrivacyLedger(neighboring="add_remove")
    led.record_correlated_release(event)
    return led


def test_reference_file_is_what_the_tests_assume() -> None:
    """The file holds amplified (b = 1 included), unamplified and calibrated cases at
    T ∈ {64, 256, 1000}, unit-norm strategies and strategies with c_0 = 1 (‖c‖₂ > 1, on which
    JAX Privacy's ε is the same), and JAX Privacy's ε is the same under zero-out and
    add-or-remove."""
    assert DATA["versions"]["jax_privacy"] == "2.0.0"
    assert GRID == 1e-4 and DELTA == 1e-5
    assert DATA["definitions"]["equal_split_under_add_or_remove_one"].startswith("refused")
    assert {c["iterations"] for c in CASES} == {64, 256, 1000}
    assert {c["num_bands"] for c in CASES if c["sampling_prob"] < 1} == {1, 3, 4, 8}
    assert any(c["sampling_prob"] == 1.0 for c in CASES)
    assert any(c["target_epsilon"] for c in CASES)
    rescaled = [c for c in CASES if c["max_column_norm"] > 1.5]
    assert {c["sampling_prob"] < 1.0 for c in rescaled} == {True, False}
    for c in rescaled:
        assert c["strategy"][0] == 1.0
        (unit,) = [
            u
            for u in CASES
            if u["max_column_norm"] == pytest.approx(1.0, abs=1e-6)
            and all(u[key] == c[key] for key in ("iterations", "num_bands", "sampling_prob"))
            and u["noise_multiplier"] == c["noise_multiplier"]
        ]
        assert unit["epsilon_pld_replace_special"] == c["epsilon_pld_replace_special"]
    for c in CASES:
        assert c["epsilon_pld_add_or_remove_one"] == c["epsilon_pld_replace_special"]
        assert c["participations"] == math.ceil(c["iterations"] / c["num_bands"])
        assert len(c["strategy"]) == c["num_bands"]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_release_maps_onto_jax_privacy_parameters(case: dict[str, Any]) -> None:
    """dpledger's release has JAX Privacy's participations ⌈T / b⌉ and largest column norm
    ‖c‖₂, so its amplified equivalent runs are exactly JAX Privacy's event: k Poisson steps
    with rate q and noise multiplier σ/(S·‖c‖₂) = z."""
    event = dpledger_release(case)
    assert event.max_participations == case["participations"]
    assert event.max_column_norm == pytest.approx(case["max_column_norm"], rel=1e-12)
    z = event.noise_stddev / (event.l2_norm_bound * event.max_column_norm)
    assert z == pytest.approx(case["noise_multiplier"], rel=1e-12)
    assert event.amplified == (case["sampling_prob"] < 1.0)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c["sampling_prob"] < 1.0], ids=case_id)
def test_amplified_bandmf_epsilon_matches_jax_privacy(case: dict[str, Any]) -> None:
    """Reference: JAX Privacy's ε of amplified BandMF (b = 1: DP-SGD) on the same T, b, q, z;
    |ε_dpledger − ε_JAX| < k·h (both pessimistic PLDs of the same mechanism, module
    docstring); RDP ≥ ε_exact > PLD − k·h."""
    led = ledger_of(dpledger_release(case))
    k = case["participations"]
    reference = case["epsilon_pld_add_or_remove_one"]
    pld = make_accountant("pld").epsilon(led, delta=DELTA).value
    assert abs(pld - reference) < k * GRID
    rdp = make_accountant("rdp").epsilon(led, delta=DELTA).value
    assert rdp > pld - k * GRID
    assert rdp > reference - k * GRID
    if case["target_epsilon"]:
        # JAX Privacy calibrated z to the target: its ε does not exceed it
        assert reference <= case["target_epsilon"]
        assert pld < case["target_epsilon"] + k * GRID


@pytest.mark.parametrize("case", [c for c in CASES if c["sampling_prob"] == 1.0], ids=case_id)
def test_unamplified_bandmf_epsilon_matches_jax_privacy(case: dict[str, Any]) -> None:
    """Reference: JAX Privacy's ε of BandMF over cyclic fixed batches (q = 1: k composed
    Gaussians with noise multiplier z, i.e. μ = √k / z) and the μ-GDP closed form. When T is
    a multiple of b, dpledger's sensitivity is JAX Privacy's √k·‖c‖₂ and
    0 ≤ ε_JAX − ε_dpledger < k·h; otherwise dpledger's exact sensitivity is smaller, and so is
    its ε (module docstring)."""
    event = dpledger_release(case)
    led = ledger_of(event)
    t, b, k = case["iterations"], case["num_bands"], case["participations"]
    reference = case["epsilon_pld_add_or_remove_one"]
    jax_mu = math.sqrt(k) / case["noise_multiplier"]
    # JAX Privacy's value is its pessimistic PLD of μ-GDP at its μ
    exact_at_jax_mu = gaussian_epsilon(jax_mu, DELTA)
    assert exact_at_jax_mu - ROUNDING <= reference < exact_at_jax_mu + k * GRID
    pld = make_accountant("pld").epsilon(led, delta=DELTA).value
    assert pld == pytest.approx(gaussian_epsilon(event.gaussian_mu, DELTA), rel=1e-9)
    if t % b == 0:
        assert event.gaussian_mu == pytest.approx(jax_mu, rel=1e-12)
        assert pld - ROUNDING <= reference < pld + k * GRID
    else:
        # the record of group 0 enters the last step, where C's column has only c_0
        norm2 = math.fsum(c * c for c in case["strategy"])
        sens = math.sqrt((k - 1) * norm2 + case["strategy"][0] ** 2)
        assert event.sensitivity == pytest.approx(sens, rel=1e-12)
        assert event.gaussian_mu < jax_mu
        assert pld < reference
    rdp = make_accountant("rdp").epsilon(led, delta=DELTA).value
    assert rdp >= pld
