"""Tests of the verdict: a lower bound against a claimed ε (number, accountant result, ledger)."""

from __future__ import annotations

import pytest

from dpledger.accountants.base import PrivacyResult, ResultKind, make_accountant
from dpledger.audit.audit_game import run_distinguishing_game
from dpledger.audit.privacy_bounds import (
    BoundMethod,
    ConfusionCounts,
    EpsilonLowerBound,
    clopper_pearson_epsilon_bound,
    gaussian_dp_epsilon_bound,
)
from dpledger.audit.threshold_selection import HeldOutSplit
from dpledger.audit.verdict import AuditVerdict, audit_verdict
from dpledger.errors import InvalidParameterError
from dpledger.ledger import PrivacyLedger
from tests.audit import gaussian_mechanism as gm


def bound(eps: float, *, delta: float = 1e-5, confidence: float = 0.95) -> EpsilonLowerBound:
    return EpsilonLowerBound(
        epsilon=eps, delta=delta, confidence=confidence, method=BoundMethod.CLOPPER_PEARSON
    )


def test_consistent_when_the_lower_bound_does_not_exceed_the_claim():
    v = audit_verdict(bound(0.8), 2.0, claimed_delta=1e-5)
    assert isinstance(v, AuditVerdict)
    assert v.consistent and not v.refuted
    assert v.status == "consistent"
    assert v.lower_bound == 0.8 and v.claimed_epsilon == 2.0
    text = str(v)
    assert text.startswith("consistent")
    assert "0.8" in text and "2" in text and "Clopper–Pearson" in text
    # Equality is not a contradiction.
    assert audit_verdict(bound(2.0), 2.0, claimed_delta=1e-5).consistent


def test_refuted_when_the_lower_bound_exceeds_the_claim():
    v = audit_verdict(bound(4.2, confidence=0.99), 2.0, claimed_delta=1e-6)
    assert v.refuted and not v.consistent
    assert v.status == "claim refuted at confidence 1 − α = 0.99"
    assert str(v).startswith("claim refuted at confidence 1 − α = 0.99")
    assert "4.2" in str(v) and "claimed ε = 2" in str(v)
    assert v.claimed_delta == 1e-6 and v.delta == 1e-5


def test_the_claims_delta_is_required_and_may_not_exceed_the_audits():
    with pytest.raises(InvalidParameterError) as info:
        audit_verdict(bound(1.0), 2.0)
    assert info.value.parameter == "claimed_delta"
    with pytest.raises(InvalidParameterError) as info:
        audit_verdict(bound(1.0, delta=1e-6), 2.0, claimed_delta=1e-5)
    assert info.value.parameter == "claimed_delta"
    for bad in (-1.0, float("nan"), "2", True):
        with pytest.raises(InvalidParameterError) as info:
            audit_verdict(bound(1.0), bad, claimed_delta=1e-5)
        assert info.value.parameter == "claim"
    with pytest.raises(InvalidParameterError) as info:
        audit_verdict(0.5, 2.0, claimed_delta=1e-5)  # type: ignore[arg-type]
    assert info.value.parameter == "bound"


def test_an_accountant_result_as_the_claim():
    upper = PrivacyResult(
        accountant="rdp", quantity="epsilon", epsilon=1.5, delta=1e-5, kind=ResultKind.UPPER_BOUND
    )
    v = audit_verdict(bound(3.0), upper)
    assert v.refuted and v.claim_source == "rdp" and v.claim_kind == "upper_bound"
    assert v.warnings == ()


def test_a_claim_that_is_not_an_upper_bound_is_compared_through_its_certified_upper_bound():
    # A PRV-style estimate below its certified upper bound: a lower bound between the two is
    # consistent with the guarantee, so it must not refute it.
    estimate = PrivacyResult(
        accountant="prv",
        quantity="epsilon",
        epsilon=1.5,
        delta=1e-5,
        kind=ResultKind.ESTIMATE,
        lower=1.4,
        upper=2.5,
    )
    v = audit_verdict(bound(2.0), estimate)
    assert v.consistent and v.claimed_epsilon == 2.5 and v.claim_kind == "estimate"
    assert any("not a valid upper bound" in w for w in v.warnings)
    assert audit_verdict(bound(2.6), estimate).refuted
    # An approximation without a certified upper bound is no guarantee to refute.
    approx = PrivacyResult(
        accountant="gdp", quantity="epsilon", epsilon=1.5, delta=1e-5, kind=ResultKind.APPROXIMATION
    )
    with pytest.raises(InvalidParameterError) as info:
        audit_verdict(bound(3.0), approx)
    assert info.value.parameter == "claim"


def test_a_ledger_replayed_by_an_approximating_accountant_is_refused():
    # Five Poisson-subsampled Gaussian steps: the gdp accountant's central-limit ε lies below a
    # certified lower bound on the true ε, so a valid audit bound between them would otherwise
    # "refute" a correct implementation.
    ledger = PrivacyLedger()
    for _ in range(5):
        ledger.record_sample(sampling_probability=0.5, population_size=1000)
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0, label="sum")
    approx = make_accountant("gdp").epsilon(ledger, delta=1e-5)
    assert approx.kind is ResultKind.APPROXIMATION
    assert approx.lower is not None and approx.epsilon < approx.lower
    valid = bound((approx.epsilon + approx.lower) / 2.0)  # below the true ε: a valid lower bound
    with pytest.raises(InvalidParameterError) as info:
        audit_verdict(valid, ledger, accountant="gdp")
    assert info.value.parameter == "claim"
    assert audit_verdict(valid, ledger, accountant="rdp").consistent


def test_a_gaussian_dp_bound_carries_its_assumption_into_the_verdict():
    b = gaussian_dp_epsilon_bound(
        ConfusionCounts(tp=500, fp=0, fn=0, tn=500), delta=1e-5, confidence=0.95
    )
    v = audit_verdict(b, 1.0, claimed_delta=1e-5)
    assert v.refuted
    assert v.assumption == b.assumption
    assert any("Gaussian" in w for w in v.warnings)
    assert "Gaussian-DP" in str(v)
    # A bare number says nothing about the mechanism: the refutation is stated as conditional.
    assert "assuming the mechanism's trade-off curve is Gaussian" in v.status
    assert "assuming the mechanism's trade-off curve is Gaussian" in str(v)


def test_a_full_batch_ledger_satisfies_the_gaussian_dp_assumption():
    # Full-batch Gaussian steps compose to exactly μ-GDP: the Gaussian-DP bound needs no
    # assumption there. A subsampled ledger's trade-off curve is not Gaussian, so the refutation
    # stays conditional on it.
    b = gaussian_dp_epsilon_bound(
        ConfusionCounts(tp=500, fp=0, fn=0, tn=500), delta=1e-5, confidence=0.95
    )
    full, sampled = PrivacyLedger(), PrivacyLedger()
    for ledger, q in ((full, 1.0), (sampled, 0.01)):
        for _ in range(3):
            ledger.record_sample(sampling_probability=q, population_size=1000)
            ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=5.0, label="sum")
    exact = audit_verdict(b, full, accountant="rdp")
    assert exact.refuted and exact.assumption is None and not exact.warnings
    assert "assuming" not in exact.status and "assuming" not in str(exact)
    conditional = audit_verdict(b, sampled, accountant="rdp")
    assert conditional.refuted and conditional.assumption == b.assumption
    assert "assuming" in conditional.status
    # A Clopper–Pearson bound never carries the assumption.
    cp = clopper_pearson_epsilon_bound(
        ConfusionCounts(tp=500, fp=0, fn=0, tn=500), delta=1e-5, confidence=0.95
    )
    assert audit_verdict(cp, sampled, accountant="rdp").assumption is None


class ExactGaussianAccountant:
    """A stand-in accountant: the exact ε of one full-batch Gaussian step, read from the ledger."""

    name = "exact-gaussian"

    def epsilon(self, ledger, *, delta):
        (run,) = ledger.compressed().runs
        eps = gm.true_epsilon(noise_stddev=run.noise_multiplier * gm.CLIP, delta=delta)
        return PrivacyResult(
            accountant=self.name,
            quantity="epsilon",
            epsilon=eps,
            delta=delta,
            kind=ResultKind.UPPER_BOUND,
        )


def one_step_ledger(noise_stddev: float) -> PrivacyLedger:
    ledger = PrivacyLedger()
    ledger.record_sample(sampling_probability=1.0, population_size=len(gm.DATA) + 1)
    ledger.record_sum_query(l2_norm_bound=gm.CLIP, noise_stddev=noise_stddev, label="sum")
    return ledger


def audit(train, seed: int = 0) -> EpsilonLowerBound:
    game = run_distinguishing_game(train, runs_per_side=500, seed=seed)
    return game.epsilon_lower_bound(delta=1e-5, confidence=0.95, selection=HeldOutSplit())


def test_a_ledger_replayed_by_an_accountant_object():
    # The ledger claims σ = 2 (what the correct and the buggy mechanism both record).
    ledger = one_step_ledger(gm.CORRECT_NOISE)
    ok = audit_verdict(audit(gm.noisy_sum), ledger, accountant=ExactGaussianAccountant())
    assert ok.consistent
    assert ok.claim_source == "exact-gaussian"
    assert ok.claimed_epsilon == pytest.approx(1.993, abs=1e-3)
    bad = audit_verdict(audit(gm.buggy_noisy_sum), ledger, accountant=ExactGaussianAccountant())
    assert bad.refuted
    with pytest.raises(InvalidParameterError):
        audit_verdict(bound(1.0), ledger, accountant=object())  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError):
        audit_verdict(bound(1.0), ledger, claimed_delta=1e-6, accountant=ExactGaussianAccountant())
    with pytest.raises(InvalidParameterError) as info:
        audit_verdict(bound(1.0), ledger, accountant="no-such-accountant")
    assert info.value.parameter == "accountant"


def test_a_ledger_replayed_by_make_accountant_rdp():
    ledger = one_step_ledger(gm.CORRECT_NOISE)
    ok = audit_verdict(audit(gm.noisy_sum), ledger, accountant="rdp")
    assert ok.consistent
    assert ok.claim_source == "rdp" and ok.claim_kind == "upper_bound"
    # RDP is a valid upper bound: at least the exact ε of the Gaussian mechanism.
    assert ok.claimed_epsilon >= gm.true_epsilon(noise_stddev=gm.CORRECT_NOISE, delta=1e-5)
    bad = audit_verdict(audit(gm.buggy_noisy_sum), ledger, accountant="rdp")
    assert bad.refuted


def test_a_ledger_claim_needs_a_positive_delta():
    b = clopper_pearson_epsilon_bound(
        ConfusionCounts(tp=10, fp=0, fn=0, tn=10), delta=0.0, confidence=0.9
    )
    with pytest.raises(InvalidParameterError) as info:
        audit_verdict(b, one_step_ledger(2.0), accountant=ExactGaussianAccountant())
    assert info.value.parameter == "delta"
