"""The report's content on a ledger with known q, z and steps, against the accountants' own
numbers; the HTML, Markdown and JSON twins hold the same numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy.special import ndtr, ndtri

from dpledger.accountants.base import make_accountant
from dpledger.accountants.pld import PldAccountant
from dpledger.errors import InvalidParameterError
from dpledger.ledger import PrivacyLedger
from dpledger.report import build_report, render_html, render_markdown, tradeoff
from dpledger.report.build import PrivacyReport, load_audit
from dpledger.report.sections import shown_epsilon
from tests.report.conftest import BIAS, DELTA, KERNEL, STEPS, Z_EFF, Q

POINTS = 5


@pytest.fixture(scope="module")
def report(shared_ledger: Path) -> PrivacyReport:
    return build_report(shared_ledger, delta=DELTA, curve_points=POINTS)


@pytest.mark.slow
def test_verification_of_an_intact_closed_ledger(
    report: PrivacyReport, shared_ledger: Path
) -> None:
    v = report.verification
    assert v.intact and v.closed and not v.altered and v.ok and v.warnings == ()
    assert v.head_hash == PrivacyLedger.load(shared_ledger).head_hash
    assert v.num_steps == STEPS and v.num_events == 3 * STEPS
    assert v.expected_head is None and v.head_matches is None


def test_header_samplers_queries_and_runs(report: PrivacyReport) -> None:
    assert report.header["neighboring"] == "add_remove"
    assert report.header["metadata"] == {"model": "cnn", "dataset": "mnist"}
    assert report.samplers == (
        {
            "sampling": "poisson",
            "scheme": "poisson",
            "unit": "record",
            "sampling_probabilities": [Q],
            "steps": STEPS,
        },
    )
    queries = {q["label"]: q for q in report.sum_queries}
    for label, (c, sigma) in (("dense/kernel", KERNEL), ("dense/bias", BIAS)):
        assert queries[label]["l2_norm_bound"] == c and queries[label]["noise_stddev"] == sigma
        assert queries[label]["noise_multiplier"] == sigma / c
        assert queries[label]["count"] == STEPS
    (run,) = report.runs
    assert run["count"] == STEPS and run["sampling_probability"] == Q
    assert run["noise_multiplier"] == pytest.approx(Z_EFF, rel=1e-15)
    assert (run["first_step"], run["last_step"]) == (1, STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rdp", "prv", "gdp", "pld"])
def test_each_accountant_row_is_the_accountants_own_answer(
    report: PrivacyReport, shared_ledger: Path, name: str
) -> None:
    ledger = PrivacyLedger.load(shared_ledger)
    own = make_accountant(name).epsilon(ledger, delta=DELTA)
    row = next(r for r in report.accountants if r.accountant == name)
    assert row.refused is None
    assert (row.epsilon, row.kind, row.lower, row.upper) == (
        own.epsilon,
        own.kind.value,
        own.lower,
        own.upper,
    )
    steps = [t for t, _ in row.curve]
    assert steps == [STEPS * (i + 1) // POINTS for i in range(POINTS)]
    curve = make_accountant(name).epsilon_curve(ledger, delta=DELTA, steps=steps)
    assert [e for _, e in row.curve] == [r.epsilon for r in curve]


def test_the_scheme_specific_accountant_is_left_out_of_a_poisson_ledger(
    report: PrivacyReport,
) -> None:
    assert [r.accountant for r in report.accountants] == ["rdp", "prv", "gdp", "pld"]


def test_the_claim_is_the_smallest_upper_bound(report: PrivacyReport) -> None:
    bounds = {r.accountant: r.epsilon for r in report.answered if r.kind == "upper_bound"}
    best = report.smallest_upper_bound
    assert best is not None and best.epsilon == min(bounds.values())
    assert report.to_dict()["claim"]["epsilon"] == best.epsilon


@pytest.mark.slow
def test_the_tradeoff_comes_from_the_pld_profile(
    report: PrivacyReport, shared_ledger: Path
) -> None:
    view = report.tradeoff
    assert view is not None and view.accountant == "pld" and view.unavailable is None
    distribution = PldAccountant().distribution(PrivacyLedger.load(shared_ledger).compressed())
    pld_eps = next(r.epsilon for r in report.accountants if r.accountant == "pld")

    def delta_of(eps: np.ndarray) -> np.ndarray:
        return np.array([distribution.get_delta_for_epsilon(float(e)) for e in eps])

    grid = tradeoff.epsilon_grid(4 * pld_eps, points=201)
    coarse = tradeoff.true_positive_rate(delta_of, tradeoff.REPORTED_FPRS, grid, refine=False)
    alphas = [a for a, _ in view.tpr_at_fpr]
    assert alphas == list(tradeoff.REPORTED_FPRS)
    for (alpha, tpr), lower in zip(view.tpr_at_fpr, coarse, strict=True):
        # a finer grid and the refinement can only lower the TPR (each ε is a valid bound)
        assert alpha <= tpr <= lower
    # (ε, δ)-DP at the reported δ bounds the TPR: TPR ≤ e^ε α + δ.
    for alpha, tpr in view.tpr_at_fpr:
        assert tpr <= np.exp(pld_eps) * alpha + DELTA


def test_the_twins_hold_the_same_numbers(report: PrivacyReport) -> None:
    data = json.loads(json.dumps(report.to_dict()))
    markdown = render_markdown(report)
    page = render_html(report)
    for row, twin in zip(report.accountants, data["accountants"], strict=True):
        assert twin["epsilon"] == row.epsilon and twin["kind"] == row.kind
        shown = shown_epsilon(row.epsilon, row.kind)
        assert f"| {row.accountant} | {shown} |" in markdown
        assert f"<td>{row.accountant}</td><td>{shown}</td>" in page
    assert report.tradeoff is not None
    twins = data["tradeoff"]["tpr_at_fpr"]
    for (alpha, tpr), twin in zip(report.tradeoff.tpr_at_fpr, twins, strict=True):
        assert twin == [alpha, tpr]
    assert (
        data["verification"]["head_hash"] in markdown and data["verification"]["head_hash"] in page
    )


def test_json_keys_are_stable(report: PrivacyReport) -> None:
    data = report.to_dict()
    assert sorted(data) == [
        "accountants",
        "audit",
        "claim",
        "correlated_releases",
        "delta",
        "findings",
        "format",
        "format_version",
        "generated",
        "header",
        "intent",
        "intent_text",
        "noise_provenance",
        "population_sizes",
        "runs",
        "samplers",
        "sampling_notes",
        "shuffle_gap",
        "sum_queries",
        "tradeoff",
        "verification",
    ]
    assert sorted(data["accountants"][0]) == [
        "accountant",
        "confidence",
        "curve",
        "curve_unavailable",
        "epsilon",
        "kind",
        "kind_label",
        "lower",
        "refused",
        "seconds",
        "upper",
        "upper_confidence",
        "warnings",
    ]


def test_the_html_is_self_contained(report: PrivacyReport) -> None:
    page = render_html(report)
    assert "http://" not in page and "https://" not in page and "<script" not in page
    assert page.count('src="data:image/png;base64,') == 2


def test_the_approximation_is_labelled_no_guarantee(report: PrivacyReport) -> None:
    gdp = next(r for r in report.accountants if r.accountant == "gdp")
    assert gdp.kind == "approximation" and "no guarantee" in (gdp.kind_label or "")


@pytest.mark.slow
def test_an_audit_is_shown_beside_the_claim(shared_ledger: Path, tmp_path: Path) -> None:
    audit_file = tmp_path / "audit.json"
    audit_file.write_text(json.dumps({"lower_bound": 0.25, "delta": 1e-5, "confidence": 0.95}))
    audit = load_audit(str(audit_file))
    report = build_report(
        shared_ledger, delta=DELTA, curve_points=1, audit=audit, audit_source=str(audit_file),
        accountants=["rdp"],
    )  # fmt: skip
    assert report.audit is not None and report.audit.lower_bound == 0.25
    assert report.audit.claimed_epsilon == report.accountants[0].epsilon
    assert report.audit.refutes_claim is False
    assert "Consistent" in render_markdown(report)


@pytest.mark.parametrize(
    "content", ["[1]", "{}", '{"lower_bound": -1}', '{"lower_bound": true}', "not json",
                '{"lower_bound": 1, "delta": 2}']
)  # fmt: skip
def test_a_bad_audit_file_is_refused(tmp_path: Path, content: str) -> None:
    path = tmp_path / "audit.json"
    path.write_text(content)
    with pytest.raises(InvalidParameterError) as info:
        load_audit(str(path))
    assert info.value.parameter == "audit"


@pytest.mark.parametrize(
    "content",
    [b"[" * 100_000 + b"]" * 100_000, b'{"lower_bound": 1, "method": "\xff"}',
     b'{"lower_bound": Infinity}', b'{"lower_bound": 1e400}', b'{"lower_bound": NaN}',
     b'{"lower_bound": 1' + b"0" * 400 + b"}", b'{"epsilon_lower_bound": -Infinity}',
     b'{"lower_bound": 1, "delta": Infinity}', b'{"lower_bound": 1, "method": {"a": 1}}',
     b" " * (2**20 + 1)],
)  # fmt: skip
def test_an_audit_file_that_is_no_finite_lower_bound_is_refused(
    tmp_path: Path, content: bytes
) -> None:
    """Deep nesting, bytes that are not UTF-8, an infinite or overflowing lower bound, a file
    over 1 MiB: a typed error naming ``audit``, never an internal error nor a bound of ∞."""
    path = tmp_path / "audit.json"
    path.write_bytes(content)
    with pytest.raises(InvalidParameterError) as info:
        load_audit(str(path))
    assert info.value.parameter == "audit"


@pytest.mark.slow
def test_a_huge_epsilon_gives_a_finite_tradeoff(tmp_path: Path) -> None:
    """20 Poisson steps at q = 0.9, z = 0.3, with no PLD row to size the grid: the ε grid once
    reached 1024 > 709, where e^ε overflows in dp-accounting's δ(ε) and the TPR came out NaN.
    The grid now stops at MAX_GRID_EPSILON (leaving out lines of larger ε only overstates the
    TPR, by at most e^−700): every TPR is a number in [α, 1]."""
    from dpledger.report.tradeoff_view import MAX_GRID_EPSILON

    path = tmp_path / "leaky.dpl"
    with PrivacyLedger(path) as ledger:
        for _ in range(20):
            ledger.record_sample(sampling_probability=0.9)
            ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=0.3)
    report = build_report(path, delta=DELTA, accountants=["rdp"], curve_points=1)
    view = report.tradeoff
    assert view is not None and view.unavailable is None and view.accountant in ("pld", "prv")
    assert f"in [0, {MAX_GRID_EPSILON:.4g}]" in view.basis
    for alpha, tpr in (*view.tpr_at_fpr, *view.curve):
        assert math.isfinite(tpr) and alpha - 1e-12 <= tpr <= 1.0
    assert "nan" not in render_markdown(report).lower()


@pytest.mark.slow
def test_a_curve_over_the_work_budget_keeps_the_epsilon(
    shared_ledger: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An accountant that refuses the curve (here: over its budget) still answered ε at δ: the
    row keeps its ε and says why it has no curve, naming the option that asks for fewer
    points."""
    from dpledger.errors import ComputationBudgetError

    def over_budget(self, ledger, *, delta, steps):  # type: ignore[no-untyped-def]
        raise ComputationBudgetError(
            parameter="value_discretization_interval", value=1e-4, estimated_bytes=2**40,
            budget_bytes=2**28, suggestion="a coarser grid", accountant="pld",
        )  # fmt: skip

    monkeypatch.setattr(PldAccountant, "epsilon_curve", over_budget)
    report = build_report(shared_ledger, delta=DELTA, accountants=["pld"], curve_points=3)
    (row,) = report.accountants
    own = PldAccountant().epsilon(PrivacyLedger.load(shared_ledger), delta=DELTA)
    assert row.refused is None and row.epsilon == own.epsilon and row.curve == ()
    assert row.curve_unavailable is not None and "--curve, now 3" in row.curve_unavailable
    assert "pld: no curve: " in render_markdown(report)


@pytest.mark.slow
def test_the_tradeoff_falls_back_to_prv_when_the_pld_profile_is_over_budget(
    shared_ledger: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The PLD profile's cost is estimated before it is computed; over the time budget, the
    PRV accountant's certified δ(ε) gives the view, which says why."""
    from dpledger.report import tradeoff_view as view_module

    monkeypatch.setattr(view_module, "SECONDS_PER_PROFILE_POINT", 1.0)
    report = build_report(shared_ledger, delta=DELTA, accountants=["rdp"], curve_points=1)
    view = report.tradeoff
    assert view is not None and view.accountant == "prv" and view.unavailable is None
    assert "would need about" in view.basis


def test_an_altered_ledger_gets_no_number(ledger_file: Path) -> None:
    lines = ledger_file.read_bytes().splitlines(keepends=True)
    lines[5] = lines[5].replace(b'"noise_stddev":1.5,', b'"noise_stddev":3.0,')
    ledger_file.write_bytes(b"".join(lines))
    report = build_report(ledger_file, delta=DELTA)
    v = report.verification
    assert v.altered and not v.intact and v.first_bad_line == 6
    assert v.warnings[0].startswith("VERIFICATION FAILED: line 6")
    assert report.accountants == () and report.tradeoff is None
    markdown = render_markdown(report)
    assert "ε =" not in markdown and "VERIFICATION FAILED" in markdown


@pytest.mark.slow
def test_a_truncated_ledger_is_stated_first(ledger_file: Path) -> None:
    content = ledger_file.read_bytes()
    ledger_file.write_bytes(content[:-10])  # the close marker's line cut short
    lines = content.count(b"\n")
    report = build_report(ledger_file, delta=DELTA, accountants=["rdp"], curve_points=1)
    v = report.verification
    assert not v.intact and v.first_bad_line == lines and not v.closed
    assert v.warnings[0].startswith(f"TRUNCATED: line {lines} is incomplete")
    assert any(w.startswith("NOT CLOSED") for w in v.warnings)
    markdown = render_markdown(report)
    assert markdown.index("TRUNCATED") < markdown.index("ε =")
    page = render_html(report)
    assert page.index('class="alert"') < page.index("Claim:")


def test_a_full_batch_report_has_the_gaussian_tradeoff(tmp_path: Path) -> None:
    # T full-batch steps at noise z are μ-GDP with μ = √T / z: TPR(α) = Φ(Φ⁻¹(α) + μ) exactly.
    steps, z = 4, 4.0
    path = tmp_path / "full.dpl"
    with PrivacyLedger(path) as ledger:
        for _ in range(steps):
            ledger.record_sample(sampling_probability=1.0)
            ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=z)
    report = build_report(path, delta=DELTA, accountants=["pld"], curve_points=1)
    assert report.tradeoff is not None and report.tradeoff.accountant == "pld"
    mu = math.sqrt(steps) / z
    h = PldAccountant().value_discretization_interval
    for alpha, tpr in report.tradeoff.tpr_at_fpr:
        exact = float(ndtr(ndtri(alpha) + mu))
        # The pessimistic PLD rounds each privacy loss up by at most h, so its δ(ε) is at most
        # δ(ε − h) (plus dp-accounting's truncated tail mass, 1e-15): each of its lines is the
        # exact line at ε − h for α e^h, so TPR(α) ≤ Φ(Φ⁻¹(α e^h) + μ) (α e^h < Φ(−μ/2)).
        ceiling = float(ndtr(ndtri(alpha * math.exp(h)) + mu)) + 1e-15
        assert exact - 1e-15 <= tpr <= ceiling + 1e-15


@pytest.mark.slow
def test_refusals_are_reported_with_their_reason_and_prv_gives_the_tradeoff(
    tmp_path: Path,
) -> None:
    path = tmp_path / "replace_one.dpl"
    with PrivacyLedger(path, neighboring="replace_one") as ledger:
        for _ in range(10):
            ledger.record_sample(sampling_probability=0.01)
            ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0)
    report = build_report(path, delta=DELTA, curve_points=2)
    refused = {r.accountant: r.refused for r in report.accountants if r.refused is not None}
    assert set(refused) == {"rdp", "gdp", "pld"}
    assert all("replace-one" in why for why in refused.values())
    assert [r.accountant for r in report.answered] == ["prv"]
    assert report.tradeoff is not None and report.tradeoff.accountant == "prv"
    markdown = render_markdown(report)
    assert (
        "| accountant | refused because |" in markdown and "| rdp | the rdp accountant" in markdown
    )


def test_a_non_private_run_has_infinite_epsilon_and_no_tradeoff(tmp_path: Path) -> None:
    path = tmp_path / "leak.dpl"
    with PrivacyLedger(path) as ledger:
        ledger.record_sample(sampling_probability=0.01)
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=0.0)
    report = build_report(path, delta=DELTA, accountants=["rdp"], curve_points=1)
    assert report.accountants[0].epsilon == math.inf
    assert report.tradeoff is not None and "not differentially private" in (
        report.tradeoff.unavailable or ""
    )
    assert report.to_dict()["accountants"][0]["epsilon"] == "inf"
    markdown = render_markdown(report)
    assert "NOT differentially private: ε = inf" in markdown and "Claim:" not in markdown


def test_correlated_releases_are_listed_with_their_progress(tmp_path: Path) -> None:
    """Reference: the release as recorded (its fields come back as they are) and the stream
    steps recorded for it; a ledger without a release lists none and renders no release
    table."""
    from dpledger.mechanisms.correlated import ParticipationSchema, tree_factorization
    from dpledger.mechanisms.correlated.release import release_event

    event = release_event(
        tree_factorization(16),
        ParticipationSchema.single(num_steps=16),
        l2_norm_bound=0.5,
        noise_stddev=2.0,
        label="model",
    )
    path = tmp_path / "c.dpl"
    with PrivacyLedger(path) as ledger:
        ledger.record_correlated_release(event)
        for t in range(5):
            ledger.record_stream_step(release=0, step=t)
    report = build_report(path, delta=DELTA, curve_points=2, accountants=["rdp"])
    (got,) = report.correlated_releases
    assert got["strategy"] == event.strategy and got["num_steps"] == 16
    assert got["participation"] == "single" and got["max_participations"] == 1
    assert (got["l2_norm_bound"], got["noise_stddev"]) == (0.5, 2.0)
    assert got["sensitivity"] == event.sensitivity and got["steps_taken"] == 5
    assert report.verification.num_events == 6 and report.verification.num_steps == 0
    assert json.loads(json.dumps(report.to_dict()))["correlated_releases"][0]["steps_taken"] == 5
    bound = "" if event.sensitivity_exact else " (bound)"
    row = (
        f"| {event.strategy} (model) | 16 | single (k=1, separation 1) | 0.5 | 2 | "
        f"{event.sensitivity:.6g}{bound} | 5 of 16 steps taken |"
    )
    assert row in render_markdown(report)
    assert "<td>5 of 16 steps taken</td>" in render_html(report)


def test_no_release_table_without_releases(report: PrivacyReport) -> None:
    assert report.correlated_releases == ()
    assert "correlated release" not in render_markdown(report)
