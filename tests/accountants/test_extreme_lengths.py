"""Accountants at extreme ledger lengths (up to 10¹⁵ steps): typed refusal or self-consistent.

Every answer must be a typed refusal (:class:`~dpledger.errors.DPLedgerError`) or agree with
itself and with what is known for certain about the same ledger:

* an upper bound ε(δ) maps back to δ(ε) ≤ δ (up to the accountant's own rounding);
* a certified lower bound is never above an upper bound (its own, or another accountant's);
* no upper bound is below the order-½ Rényi lower bound of :func:`renyi_half_epsilon_floor`.

The oracle is independent of every accountant: with the Bhattacharyya coefficient
BC = ∫√(p·q) of one step (BC_T = BC^T for T steps, BC = exp(−D_½/2)), the set A = {p > t·q}
gives P(Aᶜ) ≤ √t·BC and Q(A) ≤ BC/√t (Chernoff), so with √t = e^{ε/2}

    δ(ε) ≥ P(A) − e^ε·Q(A) ≥ 1 − 2·e^{ε/2}·BC^T,

hence any valid (ε, δ) has ε ≥ −2T·log BC + 2·log((1 − δ)/2). BC of the subsampled Gaussian
((1 − q)·N(0, 1) + q·N(1/z, 1) against N(0, 1)) is computed by quadrature of the Hellinger
integrand ½(√p − √q)², written without cancellation.
"""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
import scipy.integrate
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from scipy.stats import norm

from dpledger.accountants import GdpAccountant, PldAccountant, PrvAccountant, RdpAccountant
from dpledger.accountants.base import Accountant, PrivacyResult, ResultKind
from dpledger.errors import ComputationBudgetError, DPLedgerError
from dpledger.ledger import PrivacyLedger
from dpledger.ledger.correlated import CorrelatedReleaseEvent
from dpledger.ledger.steps import CompressedLedger

DELTA = 1e-5
_U = float(np.finfo(float).eps)


def log_bhattacharyya(q: float, z: float) -> float:
    """log BC of one Poisson-subsampled Gaussian step (add/remove, sensitivity 1)."""
    mu = 1.0 / z

    def hellinger(x: float) -> float:
        p_minus_q = q * (norm.pdf(x - mu) - norm.pdf(x))
        root_sum = math.sqrt((1 - q) * norm.pdf(x) + q * norm.pdf(x - mu)) + norm.pdf(x) ** 0.5
        return 0.5 * (p_minus_q / root_sum) ** 2 if root_sum > 0 else 0.0

    parts = [
        scipy.integrate.quad(hellinger, a, b, epsabs=0.0, epsrel=1e-10, limit=200)[0]
        for a, b in ((-math.inf, mu / 2), (mu / 2, math.inf))
    ]
    return math.log1p(-min(sum(parts), 1.0))


def renyi_half_epsilon_floor(q: float, z: float, steps: int, delta: float) -> float:
    """A certified lower bound on ε(δ) of ``steps`` identical steps (module docstring)."""
    return max(0.0, -2.0 * steps * log_bhattacharyya(q, z) + 2.0 * math.log((1 - delta) / 2))


def renyi_half_delta_floor(q: float, z: float, steps: int, epsilon: float) -> float:
    """A certified lower bound on δ(ε): 1 − 2·e^{ε/2}·BC^T."""
    log_term = math.log(2.0) + epsilon / 2 + steps * log_bhattacharyya(q, z)
    return max(0.0, -math.expm1(log_term)) if log_term < 0 else 0.0


def _rounding_slack(result: PrivacyResult) -> float:
    """Relative slack for δ(ε(δ)) ≤ δ: what the two conversions' own float rounding allows.

    Each of ε(δ) and δ(ε) is rounded up by a few ulps of the terms it is computed from; those
    terms have the size of (α − 1)·ε for the RDP conversion at order α (and of ε elsewhere), so
    log δ(ε(δ)) may exceed log δ by ~24·u·(α − 1)·(ε + 1). 10⁻⁶ covers everything else.
    """
    order = float(result.details.get("optimal_order", 2.0))
    return math.expm1(24 * _U * max(order - 1, 1.0) * (abs(result.epsilon) + 1.0)) + 1e-6


def check_consistent(
    acc: Accountant, ledger: CompressedLedger, q: float, z: float, steps: int
) -> PrivacyResult | None:
    """Assert the module's rules for one accountant on one single-run ledger; None if refused."""
    try:
        result = acc.epsilon(ledger, delta=DELTA)
    except DPLedgerError:
        return None  # a typed refusal is an acceptable answer
    eps = result.epsilon
    assert eps >= 0.0 and not math.isnan(eps), result
    if result.lower is not None and result.upper is not None:
        assert result.lower <= result.upper, result
    if result.kind is not ResultKind.UPPER_BOUND:
        return result  # an approximation or estimate promises nothing more
    floor = renyi_half_epsilon_floor(q, z, steps, DELTA)
    assert eps >= floor * (1 - 1e-6) - 1e-9, (result, floor)
    if math.isinf(eps):
        return result
    try:
        back = acc.delta(ledger, epsilon=eps)
    except DPLedgerError:
        return result
    # the δ computation's certified lower bound at ε: above δ would refute the upper bound
    assert (back.lower if back.lower is not None else back.delta) <= DELTA * (
        1 + _rounding_slack(result)
    ), (result, back)
    assert back.delta >= renyi_half_delta_floor(q, z, steps, eps) * (1 - 1e-6), back
    return result


def _all_consistent(q: float, z: float, steps: int, *, with_pld: bool) -> None:
    ledger = CompressedLedger.from_runs([(q, z, steps)])
    accountants: list[Accountant] = [
        RdpAccountant(),
        PrvAccountant(eps_error=0.1, memory_budget=32 * 2**20),
        GdpAccountant(lower_bound=False),
    ]
    if with_pld:
        accountants.append(PldAccountant(value_discretization_interval=1e-2))
    results = [check_consistent(acc, ledger, q, z, steps) for acc in accountants]
    uppers = [
        r.upper if r.upper is not None else r.epsilon
        for r in results
        if r is not None and r.kind is ResultKind.UPPER_BOUND
    ]
    lowers = [r.lower for r in results if r is not None and r.lower is not None]
    for lower in lowers:  # a certified lower bound is below every valid upper bound
        for upper in uppers:
            assert lower <= upper * (1 + 1e-9) + 1e-12, (q, z, steps, results)


@pytest.mark.slow
@settings(
    max_examples=25,
    deadline=60_000,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
@given(
    log_q=st.floats(-4.0, 0.0),
    log_z=st.floats(math.log10(0.3), math.log10(64.0)),
    log_t=st.floats(0.0, 15.0),
)
# cells of the grid where PRV's composed window once overflowed (see the test below)
@example(log_q=-2.0, log_z=math.log10(4.0), log_t=15.0)
@example(log_q=-2.0, log_z=0.0, log_t=12.0)
def test_every_accountant_is_consistent_or_refuses_at_extreme_lengths(
    log_q: float, log_z: float, log_t: float
) -> None:
    q, z, steps = 10.0**log_q, 10.0**log_z, int(10.0**log_t)
    _all_consistent(q, z, steps, with_pld=steps <= 1000)


@pytest.mark.parametrize(
    ("q", "z", "steps"),
    [(0.01, 16.0, 10**15), (0.01, 4.0, 10**15), (0.5, 16.0, 10**12), (1e-4, 0.3, 10**12)],
)
def test_prv_at_extreme_lengths_never_certifies_less_than_is_known(
    q: float, z: float, steps: int
) -> None:
    """The cells of the (q, z, T) grid where an int64 overflow of the composed support put the
    whole composed loss into a two-point window: ε = 0 at (0.01, 4, 10¹⁵), a lower bound of
    7.2e8 above RDP's upper bound of 2.15e8 at (0.01, 16, 10¹⁵), δ(1) = 4e-7 there."""
    ledger = CompressedLedger.from_runs([(q, z, steps)])
    prv = PrvAccountant()
    result = prv.epsilon(ledger, delta=DELTA)
    rdp = RdpAccountant().epsilon(ledger, delta=DELTA)
    assert result.kind is ResultKind.UPPER_BOUND
    assert result.epsilon >= renyi_half_epsilon_floor(q, z, steps, DELTA) > 1.0
    assert result.lower is None or result.lower <= rdp.epsilon
    try:
        at_one = prv.delta(ledger, epsilon=1.0)
    except DPLedgerError:
        return
    assert at_one.delta >= renyi_half_delta_floor(q, z, steps, 1.0) > 0.99


def test_renyi_half_floor_matches_the_gaussian_closed_form() -> None:
    """For q = 1 the step is the Gaussian mechanism: BC = exp(−μ²/8) exactly."""
    for z in (0.3, 1.0, 16.0):
        assert log_bhattacharyya(1.0, z) == pytest.approx(-1.0 / (8 * z * z), rel=1e-8)


def test_a_ledger_file_with_one_release_of_1e15_steps_is_refused_not_answered(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A file that verifies, holding a single amplified correlated release whose 10¹⁵ cyclic
    participations expand to the run (q = 0.01, z = 16, 10¹⁵): the file route once reported
    ε = 0. Replay now rebuilds the release's C from its parameters before trusting its recorded
    sensitivity, and a C of 10¹⁵ steps is beyond the work budget, so every accountant refuses it
    with a typed error, before allocating anything, instead of answering."""
    steps = 10**15
    event = CorrelatedReleaseEvent(
        strategy="banded_toeplitz",
        strategy_params={"coefficients": [1.0], "num_steps": steps},
        strategy_hash="0" * 64,
        num_steps=steps,
        participation="cyclic",
        max_participations=steps,
        min_separation=1,
        sampling="poisson_within_bands",
        sampling_probability=0.01,
        bands=1,
        l2_norm_bound=1.0,
        noise_stddev=16.0,
        sensitivity=math.sqrt(steps),
        sensitivity_exact=True,
        max_column_norm=1.0,
    )
    path = tmp_path / "release.dpledger"
    with PrivacyLedger(path) as led:
        led.record_correlated_release(event)
    loaded = PrivacyLedger.load(path)
    assert loaded.compressed().correlated == (event,)
    for accountant in (PrvAccountant(), RdpAccountant(), GdpAccountant()):
        tracemalloc.start()
        try:
            with pytest.raises(ComputationBudgetError, match="num_steps"):
                accountant.epsilon(loaded, delta=DELTA)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20
