"""The check report: verdicts, plain-text summary, JSON, assertion helper, plots."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from dpledger.checks import CheckReport, CheckResult, Verdict
from dpledger.checks.report import Curve
from dpledger.errors import InvalidParameterError


def result(name, verdict, **kw):
    return CheckResult(name=name, title=f"title of {name}", verdict=verdict, reason="why", **kw)


def sample_report():
    curve = Curve("σ = 0", [0.1, 1.0, 10.0], [-1.0, -2.0, -2.0], "C", "Δloss", log_x=True)
    return CheckReport(
        results=[
            result(
                "a",
                Verdict.PASS,
                statistic_name="slope",
                statistic=-0.5,
                p_value=1e-9,
                alpha=0.01,
                curves=[curve],
                details={"x": np.float64(2.0), "v": [1, math.inf]},
            ),
            result(
                "b",
                Verdict.FAIL,
                statistic_name="relative change",
                statistic=0.0,
                curves=[
                    curve,
                    Curve("pts", [1, 2], [3, 4], "k", "y", style="points", panel="other"),
                ],
            ),
            result("c", Verdict.INCONCLUSIVE),
            result("d", Verdict.SKIPPED),
        ],
        settings={"seed": 3, "loss": "mse"},
    )


def test_summary_lists_every_check_with_its_statistic():
    report = sample_report()
    text = report.summary()
    assert "[        PASS] a: title of a" in text
    assert "slope = -0.5, p = 1e-09 (α = 0.01)" in text
    assert "relative change = 0" in text and "relative change = 0, p" not in text  # no p shown
    assert "[INCONCLUSIVE] c" in text and "[     SKIPPED] d" in text
    assert "FAILED: 1 pass, 1 fail, 1 inconclusive, 1 skipped" in text
    assert "failed checks: b" in text
    assert str(report) == text


def test_verdict_accessors():
    report = sample_report()
    assert report.failed == ("b",) and report.inconclusive == ("c",)
    assert not report.passed
    assert report["a"].passed and report["b"].failed
    assert report.verdicts["d"] is Verdict.SKIPPED
    with pytest.raises(KeyError):
        report["zz"]


def test_assert_passed_raises_with_the_summary():
    report = sample_report()
    with pytest.raises(AssertionError) as info:
        report.assert_passed()
    assert info.value.args[0] == report.summary()
    ok = CheckReport(
        results=[
            result("a", Verdict.PASS),
            result("c", Verdict.INCONCLUSIVE),
            result("d", Verdict.SKIPPED),
        ]
    )
    with pytest.raises(AssertionError):
        ok.assert_passed()
    ok.assert_passed(allow_inconclusive=True)
    assert ok.passed and "OK: 1 pass, 1 inconclusive, 1 skipped" in ok.summary()


def test_to_dict_is_json_with_non_finite_numbers_as_strings():
    data = json.loads(json.dumps(sample_report().to_dict()))
    assert data["failed"] == ["b"]
    first = data["results"][0]
    assert first["details"] == {"x": 2.0, "v": [1, "inf"]}
    assert first["curves"][0]["x"] == [0.1, 1.0, 10.0]
    assert data["results"][2]["p_value"] == "nan"


def test_curve_validates_lengths():
    with pytest.raises(InvalidParameterError, match="as many values as x"):
        Curve("c", [1, 2], [1], "x", "y")
    assert Curve("c", [1, 2], [3, 4], "x", "y") == Curve("c", [1, 2], [3, 4], "x", "y")


def test_plot_draws_one_row_per_check_and_saves(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    path = tmp_path / "report.png"
    fig = sample_report().plot(str(path))
    assert path.stat().st_size > 1000
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert len(visible) == 3  # a: one panel; b: two panels
    assert visible[0].get_xscale() == "log"
    assert "a: pass" in visible[0].get_title()
    only_b = sample_report().plot(checks=["b"])
    assert len([ax for ax in only_b.axes if ax.get_visible()]) == 2
    import matplotlib.pyplot as plt

    plt.close("all")
