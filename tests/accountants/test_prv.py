"""The PRV accountant: conformance, settings, result kinds, closed forms, fallback, interop."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting import gaussian_mechanism

from dpledger import InvalidParameterError
from dpledger.accountants.base import ResultKind, make_accountant
from dpledger.accountants.prv import PrvAccountant
from dpledger.accountants.prv import accountant as accountant_module
from dpledger.accountants.prv.accountant import PrvNumericalError
from dpledger.accountants.prv.interop import PrvDpAccountant
from dpledger.errors import UnsupportedLedgerError
from dpledger.ledger.steps import CompressedLedger
from tests.accountants.conformance import AccountantConformance

DELTA = 1e-5


def runs(*triples: tuple[float, float, int], neighboring: str = "add_remove") -> CompressedLedger:
    return CompressedLedger.from_runs(triples, neighboring=neighboring)


class TestPrvConformance(AccountantConformance):
    """The shared suite. eps_error = 1e-3 certifies every ε to within 2e-3; the smallest ε the
    suite compares across routes (curve vs single call, monotonicity) is ≈ 0.1, so two certified
    answers for the same ledger may differ by 2e-3/0.1 = 2% relative."""

    make_accountant = staticmethod(lambda: PrvAccountant(eps_error=1e-3))
    rel_tol = 0.02


# ---------------------------------------------------------------------------- settings
@pytest.mark.parametrize("value", [0.0, -0.01, 1.5, math.nan, math.inf, True, "0.01", None])
def test_bad_eps_error_is_rejected(value: object) -> None:
    with pytest.raises(InvalidParameterError, match="eps_error"):
        PrvAccountant(eps_error=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [0.0, -1e-9, 1.0, math.nan, True, "1e-8"])
def test_bad_delta_error_is_rejected(value: object) -> None:
    with pytest.raises(InvalidParameterError, match="delta_error"):
        PrvAccountant(delta_error=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["lower", "", None, 1])
def test_bad_report_is_rejected(value: object) -> None:
    with pytest.raises(InvalidParameterError, match="report"):
        PrvAccountant(report=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [0.0, 1.0, -0.1, math.nan, True, "1e-3"])
def test_bad_bucketing_is_rejected(value: object) -> None:
    with pytest.raises(InvalidParameterError, match="bucketing"):
        PrvAccountant(bucketing=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [0, 1000, 2.0**20, True, None])
def test_bad_max_points_is_rejected(value: object) -> None:
    with pytest.raises(InvalidParameterError, match="max_points"):
        PrvAccountant(max_points=value)  # type: ignore[arg-type]


def test_settings_are_reported_and_registered() -> None:
    acc = make_accountant("prv", eps_error=0.02, bucketing=1e-3)
    assert isinstance(acc, PrvAccountant)
    result = acc.epsilon(runs((0.01, 1.0, 100)), delta=DELTA)
    assert result.settings == {
        "eps_error": 0.02,
        "delta_error": None,
        "report": "upper",
        "bucketing": 1e-3,
        "max_points": 1 << 23,
        "memory_budget": 256 * 2**20,
        "time_budget_s": 60.0,
    }
    assert "eps_error=0.02" in repr(acc)


# ---------------------------------------------------------------------------- results
def test_default_result_is_the_certified_upper_bound() -> None:
    result = PrvAccountant().epsilon(runs((256 / 60000, 1.1, 14062)), delta=DELTA)
    assert result.kind is ResultKind.UPPER_BOUND
    assert result.epsilon == result.upper
    assert result.lower <= result.details["estimate"] <= result.upper
    assert result.upper - result.lower <= 2 * 0.01
    assert result.details["method"] == "prv" and not result.warnings
    for side in ("remove", "add"):
        part = result.details[side]
        assert 0 < part["upper_slack"] <= DELTA * 1e-3
        assert 0 < part["lower_shift"] <= 2 * 0.01


def test_estimate_report() -> None:
    ledger = runs((0.01, 1.0, 1000))
    upper = PrvAccountant().epsilon(ledger, delta=DELTA)
    estimate = PrvAccountant(report="estimate").epsilon(ledger, delta=DELTA)
    assert estimate.kind is ResultKind.ESTIMATE
    assert estimate.epsilon == estimate.details["estimate"] == upper.details["estimate"]
    assert estimate.lower <= estimate.epsilon <= estimate.upper == upper.upper
    d = PrvAccountant(report="estimate").delta(ledger, epsilon=1.0)
    assert d.kind is ResultKind.ESTIMATE and d.lower <= d.delta <= d.upper


def test_delta_query_brackets_the_epsilon_query() -> None:
    """δ(ε_upper) ≤ δ and δ(ε_lower) ≥ δ, by the certified δ bounds."""
    acc = PrvAccountant()
    ledger = runs((0.004, 1.1, 5000), (0.01, 2.0, 300))
    eps = acc.epsilon(ledger, delta=DELTA)
    assert acc.delta(ledger, epsilon=eps.upper).upper <= DELTA * (1 + 1e-3)
    assert acc.delta(ledger, epsilon=eps.lower).lower >= DELTA * (1 - 1e-3)


@pytest.mark.parametrize("z, count", [(0.5, 1), (1.0, 100), (3.0, 100_000), (20.0, 7)])
def test_full_batch_steps_are_exact_gaussian_mechanisms(z: float, count: int) -> None:
    """q = 1 steps compose to one Gaussian mechanism with σ = z/√count (closed form)."""
    result = PrvAccountant().epsilon(runs((1.0, z, count)), delta=DELTA)
    exact = gaussian_mechanism.get_epsilon_gaussian(z / math.sqrt(count), DELTA)
    assert result.details["method"] == "gaussian_closed_form"
    assert result.lower <= exact * (1 + 1e-9) and exact <= result.upper * (1 + 1e-9)
    assert result.upper - result.lower <= 1e-9 * max(1.0, exact)
    d = PrvAccountant().delta(runs((1.0, z, count)), epsilon=result.upper)
    assert d.delta <= DELTA * (1 + 1e-9)


def test_replace_one_full_batch_has_double_sensitivity() -> None:
    """Replacing a record moves a clipped sum by up to 2S: noise multiplier z acts like z/2."""
    result = PrvAccountant().epsilon(runs((1.0, 2.0, 10), neighboring="replace_one"), delta=DELTA)
    exact = gaussian_mechanism.get_epsilon_gaussian(1.0 / math.sqrt(10), DELTA)
    assert result.upper == pytest.approx(exact, rel=1e-9)


def test_bucketing_gives_a_larger_valid_bound_and_reports_the_collapse() -> None:
    zs = np.linspace(0.8, 2.0, 400)
    ledger = CompressedLedger.from_runs([(0.004, float(z), 25) for z in zs])
    plain = PrvAccountant().epsilon(ledger, delta=DELTA)
    bucketed = PrvAccountant(bucketing=1e-2).epsilon(ledger, delta=DELTA)
    assert bucketed.details["distinct_before_bucketing"] == 400
    assert bucketed.details["distinct_after_bucketing"] < 100
    # rounding z down and q up can only increase ε: the bucketed upper bound stays above the
    # plain ledger's certified lower bound, and above its estimate up to the two widths
    assert bucketed.upper >= plain.lower
    assert bucketed.upper >= plain.details["estimate"] - 2 * 0.01


def test_ledger_order_does_not_change_the_answer() -> None:
    a = runs((0.01, 1.2, 300), (0.02, 0.9, 200), (1.0, 4.0, 5))
    b = runs((1.0, 4.0, 5), (0.02, 0.9, 200), (0.01, 1.2, 300))
    acc = PrvAccountant()
    assert acc.epsilon(a, delta=DELTA).upper == pytest.approx(
        acc.epsilon(b, delta=DELTA).upper, abs=1e-12
    )


def test_curve_points_are_certified_and_monotone() -> None:
    acc = PrvAccountant()
    ledger = runs((256 / 60000, 1.1, 14062))
    steps = list(range(0, 14063, 1406))
    curve = acc.epsilon_curve(ledger, delta=DELTA, steps=steps)
    uppers = [r.upper for r in curve]
    assert uppers == sorted(uppers)
    for t, r in zip(steps[1:], curve[1:], strict=True):
        single = acc.epsilon(ledger.prefix(t), delta=DELTA)
        # both are certified intervals for the same number, so they overlap
        assert r.lower <= single.upper and single.lower <= r.upper
        assert r.upper - r.lower <= 2 * 0.01


# ---------------------------------------------------------------------------- fallback
def _exact_subsampled_delta(q: float, z: float, epsilon: float) -> float:
    """δ(ε) of one Poisson-subsampled Gaussian step, add and remove directions (dp-accounting's
    exact privacy loss, no discretisation)."""
    from dp_accounting.pld import privacy_loss_mechanism as plm

    return max(
        plm.GaussianPrivacyLoss(
            standard_deviation=z, sampling_prob=q, adjacency_type=adjacency
        ).get_delta_for_epsilon(epsilon)
        for adjacency in (plm.AdjacencyType.REMOVE, plm.AdjacencyType.ADD)
    )


@pytest.mark.slow
def test_privacy_losses_beyond_the_float_exponent_range_are_kept() -> None:
    """With z = 0.025 a sampled record's privacy loss reaches about 1000 nats, past
    log(float max) ≈ 709.8, where e^ℓ overflows; that mass must not be cut off at 709.8."""
    q, z = 0.01, 0.025
    ledger = CompressedLedger.from_runs([(q, z, 1)])
    result = PrvAccountant().epsilon(ledger, delta=DELTA)
    assert result.kind is ResultKind.UPPER_BOUND
    assert _exact_subsampled_delta(q, z, result.epsilon) <= DELTA
    assert result.lower is not None and _exact_subsampled_delta(q, z, result.lower) > DELTA
    delta = PrvAccountant().delta(ledger, epsilon=1000.0).delta
    assert delta >= _exact_subsampled_delta(q, z, 1000.0)


def test_failed_numerical_check_falls_back_to_a_labelled_rdp_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(*args: object, **kwargs: object) -> object:
        raise PrvNumericalError("forced failure")

    monkeypatch.setattr(PrvAccountant, "_checked_compose", broken)
    ledger = runs((0.01, 1.0, 1000))
    result = PrvAccountant().epsilon(ledger, delta=DELTA)
    assert result.kind is ResultKind.UPPER_BOUND and result.lower is None
    assert result.details["method"] == "rdp_fallback"
    assert any("RDP upper bound" in w and "forced failure" in w for w in result.warnings)
    rdp = dp_accounting.rdp.RdpAccountant(orders=list(range(2, 64)))
    rdp.compose(dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.0)), 1000)
    assert result.upper == pytest.approx(rdp.get_epsilon(DELTA), rel=1e-6)
    with pytest.raises(PrvNumericalError, match="replace-one"):
        PrvAccountant().epsilon(runs((0.01, 1.0, 10), neighboring="replace_one"), delta=DELTA)


def test_tiny_delta_uses_extended_precision_or_says_it_fell_back() -> None:
    """float64 rounding, amplified k-fold by the powers, is ~1e-11 here: δ = 1e-10 needs the
    extended-precision recomposition; δ = 1e-16 is beyond it and falls back, labelled."""
    ledger = runs((256 / 60000, 1.1, 14062))
    result = PrvAccountant().epsilon(ledger, delta=1e-10)
    assert result.details["method"] == "prv"
    assert result.details["remove"]["float_error"] < 1e-11
    pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    pld.compose(
        dp_accounting.PoissonSampledDpEvent(256 / 60000, dp_accounting.GaussianDpEvent(1.1)), 14062
    )
    assert result.lower <= pld.get_epsilon(1e-10) <= result.upper + 1e-3
    tiny = PrvAccountant().epsilon(ledger, delta=1e-16)
    assert tiny.details["method"] in {"prv", "rdp_fallback"}
    if tiny.details["method"] == "rdp_fallback":
        assert tiny.warnings and tiny.kind is ResultKind.UPPER_BOUND
    assert tiny.upper > result.upper


def test_memory_limit_coarsens_the_mesh_and_says_so() -> None:
    """A single step's spectrum is not band-limited, so it needs the full window; a limit
    below that window coarsens the mesh (wider, still certified, interval)."""
    ledger = runs((0.3, 1.0, 1))
    result = PrvAccountant(max_points=1024).epsilon(ledger, delta=DELTA)
    assert result.details["mesh_coarsened"] > 1
    assert any("max_points" in w for w in result.warnings)
    reference = PrvAccountant().epsilon(ledger, delta=DELTA)
    assert result.lower <= reference.upper and reference.lower <= result.upper


# ---------------------------------------------------------------------------- interop
def _poisson(q: float, z: float) -> dp_accounting.DpEvent:
    return dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))


@pytest.mark.slow
def test_dp_accounting_interface_reports_the_upper_bound() -> None:
    acc = PrvDpAccountant()
    acc.compose(dp_accounting.SelfComposedDpEvent(_poisson(0.01, 1.2), 300))
    acc.compose(
        dp_accounting.ComposedDpEvent(
            [_poisson(0.02, 0.9), dp_accounting.NoOpDpEvent(), dp_accounting.GaussianDpEvent(4.0)]
        ),
        2,
    )
    ledger = runs((0.01, 1.2, 300), (0.02, 0.9, 2), (1.0, 4.0, 2))
    ours = PrvAccountant().epsilon(ledger, delta=DELTA)
    assert acc.get_epsilon(DELTA) == pytest.approx(ours.upper, abs=1e-12)
    assert acc.get_delta(1.0) == pytest.approx(
        PrvAccountant().delta(ledger, epsilon=1.0).upper, rel=1e-12
    )
    assert isinstance(acc.ledger, dp_accounting.DpEvent)


def test_dp_accounting_interface_edge_events() -> None:
    acc = PrvDpAccountant()
    assert acc.get_epsilon(DELTA) == 0.0
    acc.compose(dp_accounting.NoOpDpEvent())
    acc.compose(_poisson(0.0, 1.0), 10)  # q = 0 releases nothing
    assert acc.get_epsilon(DELTA) == 0.0
    acc.compose(dp_accounting.NonPrivateDpEvent())
    assert acc.get_epsilon(DELTA) == math.inf and acc.get_delta(1.0) == 1.0
    zero_noise = PrvDpAccountant()
    zero_noise.compose(_poisson(0.1, 0.0))
    assert zero_noise.get_epsilon(DELTA) == math.inf


@pytest.mark.parametrize(
    "event",
    [
        dp_accounting.LaplaceDpEvent(1.0),
        dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.LaplaceDpEvent(1.0)),
        dp_accounting.SampledWithoutReplacementDpEvent(100, 10, dp_accounting.GaussianDpEvent(1)),
        dp_accounting.ComposedDpEvent([_poisson(0.1, 1.0), dp_accounting.LaplaceDpEvent(1.0)]),
        dp_accounting.UnsupportedDpEvent(),
    ],
)
def test_dp_accounting_interface_refuses_other_events(event: dp_accounting.DpEvent) -> None:
    acc = PrvDpAccountant()
    assert not acc.supports(event)
    with pytest.raises(dp_accounting.UnsupportedEventError):
        acc.compose(event)
    assert acc.get_epsilon(DELTA) == 0.0  # nothing was composed


@pytest.mark.slow
def test_dp_accounting_interface_neighboring_relations() -> None:
    replace = PrvDpAccountant(dp_accounting.NeighboringRelation.REPLACE_ONE)
    replace.compose(_poisson(0.01, 1.0), 1000)
    pld = dp_accounting.pld.PLDAccountant(
        dp_accounting.NeighboringRelation.REPLACE_ONE, value_discretization_interval=1e-4
    )
    pld.compose(_poisson(0.01, 1.0), 1000)
    assert pld.get_epsilon(DELTA) <= replace.get_epsilon(DELTA) + 1e-3
    special = PrvDpAccountant(dp_accounting.NeighboringRelation.REPLACE_SPECIAL)
    special.compose(_poisson(0.01, 1.0), 1000)
    plain = PrvDpAccountant()
    plain.compose(_poisson(0.01, 1.0), 1000)
    assert special.get_epsilon(DELTA) == plain.get_epsilon(DELTA)
    assert replace.get_epsilon(DELTA) > plain.get_epsilon(DELTA)


def test_dp_accounting_interface_bad_arguments() -> None:
    with pytest.raises(InvalidParameterError, match="neighboring_relation"):
        PrvDpAccountant("add_remove")  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError, match="report"):
        PrvDpAccountant(report="estimate")
    with pytest.raises(InvalidParameterError, match="eps_error"):
        PrvDpAccountant(eps_error=0.0)


def test_too_many_distinct_steps_need_bucketing() -> None:
    zs = 0.8 + 1e-6 * np.arange(accountant_module.MAX_DISTINCT_STEPS + 1)
    ledger = CompressedLedger.from_runs([(0.004, float(z), 1) for z in zs])
    with pytest.raises(UnsupportedLedgerError, match="bucketing"):
        PrvAccountant().epsilon(ledger, delta=DELTA)
    result = PrvAccountant(bucketing=1e-3).epsilon(ledger, delta=DELTA)
    assert result.details["distinct_after_bucketing"] <= 20  # z spans 0.8 to 0.81


def test_module_exports() -> None:
    assert set(accountant_module.__all__) == {
        "MAX_DISTINCT_STEPS",
        "PrvAccountant",
        "PrvNumericalError",
    }
