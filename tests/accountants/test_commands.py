"""The ``dpledger epsilon`` and ``dpledger calibrate`` commands."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpledger import PrivacyLedger
from dpledger.accountants.gdp import GdpAccountant
from dpledger.accountants.rdp import RdpAccountant
from dpledger.cli import main

REQUIRED = {"accountant", "epsilon", "delta", "kind", "lower", "upper", "seconds", "warnings"}


def _write(path: Path, steps: list[tuple[float, float]], neighboring: str = "add_remove") -> str:
    with PrivacyLedger(path, neighboring=neighboring) as ledger:
        for q, sigma in steps:
            ledger.record_sample(sampling_probability=q, population_size=1000)
            ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=sigma, label="grad")
    return str(path)


@pytest.fixture
def ledger_file(tmp_path: Path) -> str:
    return _write(tmp_path / "run.dpl", [(0.02, 1.0)] * 60 + [(0.02, 1.3)] * 60)


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_epsilon_json_rows_match_the_api(ledger_file: str, capsys: pytest.CaptureFixture) -> None:
    code = main(
        ["epsilon", ledger_file, "--delta", "1e-5", "--accountant", "rdp,gdp,pld", "--json"]
    )
    assert code == 0
    rows = _json_lines(capsys.readouterr().out)
    assert [r["accountant"] for r in rows] == ["rdp", "gdp", "pld"]
    for row in rows:
        assert set(row) >= REQUIRED and row["delta"] == 1e-5 and row["num_steps"] == 120
    ledger = PrivacyLedger.load(ledger_file)
    assert rows[0]["epsilon"] == RdpAccountant().epsilon(ledger, delta=1e-5).epsilon
    assert rows[0]["kind"] == "upper_bound" and rows[0]["upper"] == rows[0]["epsilon"]
    assert rows[1]["kind"] == "approximation"
    assert rows[1]["epsilon"] == GdpAccountant().epsilon(ledger, delta=1e-5).epsilon
    assert rows[2]["kind"] == "upper_bound" and rows[2]["epsilon"] <= rows[0]["epsilon"]


def test_epsilon_table(ledger_file: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["epsilon", ledger_file, "--delta", "1e-5", "--accountant", "rdp,gdp"]) == 0
    out = capsys.readouterr().out
    assert "120 steps" in out and "upper_bound" in out and "approximation" in out
    assert out.splitlines()[1].split()[:2] == ["accountant", "epsilon"]


def test_all_iterates_over_every_accountant(
    ledger_file: str, capsys: pytest.CaptureFixture
) -> None:
    assert main(["epsilon", ledger_file, "--delta", "1e-5", "--json"]) == 0
    captured = capsys.readouterr()
    names = [r["accountant"] for r in _json_lines(captured.out)]
    assert {"rdp", "gdp", "pld"} <= set(names)
    if importlib.util.find_spec("dpledger.accountants.prv") is None:
        assert "prv" not in names and "prv: not available" in captured.err
    else:
        assert "prv" in names


def test_curve_and_plot(ledger_file: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    plot = tmp_path / "curve.png"
    args = ["epsilon", ledger_file, "--delta", "1e-5", "--accountant", "rdp,gdp", "--json"]
    assert main([*args, "--curve", "4", "--plot", str(plot)]) == 0
    rows = _json_lines(capsys.readouterr().out)
    for row in rows:
        steps = [p["steps"] for p in row["curve"]]
        eps = [p["epsilon"] for p in row["curve"]]
        assert steps == [30, 60, 90, 120] and eps == sorted(eps)
        assert eps[-1] == pytest.approx(row["epsilon"], rel=1e-9)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (
        main(["epsilon", ledger_file, "--delta", "1e-5", "--accountant", "rdp", "--curve", "2"])
        == 0
    )
    assert "ε after t steps" in capsys.readouterr().out


def test_the_plot_draws_each_accountant_in_the_reports_style(ledger_file: str) -> None:
    """``--plot`` gives every accountant its own colour, line style and marker (PRV is not
    hidden under PLD) and draws the GDP approximation dashed, as the report does."""
    import matplotlib.pyplot as plt

    from dpledger.accountants import PldAccountant, PrvAccountant
    from dpledger.accountants.commands import epsilon_figure
    from dpledger.accountants.display import ACCOUNTANT_STYLES

    ledger = PrivacyLedger.load(ledger_file)
    accountants = {
        "rdp": RdpAccountant(),
        "prv": PrvAccountant(),
        "pld": PldAccountant(),
        "gdp": GdpAccountant(),
    }
    curves = {
        name: list(acc.epsilon_curve(ledger, delta=1e-5, steps=[60, 120]))
        for name, acc in accountants.items()
    }
    fig = epsilon_figure(curves, 1e-5)
    try:
        lines = {line.get_label().split(":")[0]: line for line in fig.axes[0].get_lines()}
        looks = {
            (line.get_color(), line.get_linestyle(), line.get_marker()) for line in lines.values()
        }
        assert len(looks) == len(accountants)
        for name, line in lines.items():
            assert line.get_marker() == ACCOUNTANT_STYLES[name]["marker"]
        assert lines["gdp"].get_linestyle() == "--"
        assert "no guarantee" in lines["gdp"].get_label()
    finally:
        plt.close(fig)


@pytest.mark.slow
def test_plot_without_matplotlib_is_a_clear_error(
    ledger_file: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code = main(["epsilon", ledger_file, "--delta", "1e-5", "--plot", str(tmp_path / "x.png")])
    assert code == 2 and "matplotlib" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "name"),
    [
        (["--delta", "0"], "--delta=0.0"),
        (["--delta", "1.5"], "--delta=1.5"),
        (["--delta", "nan"], "--delta=nan"),
        (["--delta", "1e-5", "--accountant", "moments"], "--accountant='moments'"),
        (["--delta", "1e-5", "--accountant", ","], "--accountant=','"),
        (["--delta", "1e-5", "--curve", "0"], "--curve=0"),
        (["--delta", "1e-5", "--curve", "1001"], "--curve=1001"),
        (["--delta", "1e-5", "--bucketing", "2"], "--bucketing=2.0"),
        (["--delta", "1e-5", "--bucketing=-inf"], "--bucketing=-inf"),
    ],
)
def test_epsilon_bad_input(
    ledger_file: str, extra: list[str], name: str, capsys: pytest.CaptureFixture
) -> None:
    assert main(["epsilon", ledger_file, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dpledger epsilon: error: {name} is invalid") and err.count("\n") == 1


def test_refusals_are_reported_per_accountant(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = _write(tmp_path / "r.dpl", [(0.1, 1.0)] * 3, neighboring="replace_one")
    assert main(["epsilon", path, "--delta", "1e-5", "--accountant", "rdp,gdp", "--json"]) == 2
    rows = _json_lines(capsys.readouterr().out)
    assert all("replace-one" in r["error"] and r["epsilon"] is None for r in rows)
    full = _write(tmp_path / "f.dpl", [(1.0, 4.0)] * 3, neighboring="replace_one")
    assert main(["epsilon", full, "--delta", "1e-5", "--accountant", "rdp,pld"]) == 0


def test_non_private_ledger_prints_infinity(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = _write(tmp_path / "n.dpl", [(0.1, 1.0), (0.1, 0.0)])
    assert main(["epsilon", path, "--delta", "1e-5", "--accountant", "rdp", "--json"]) == 0
    row = _json_lines(capsys.readouterr().out)[0]
    assert row["epsilon"] == "inf" and row["warnings"]
    assert main(["epsilon", path, "--delta", "1e-5", "--accountant", "rdp"]) == 0
    assert " inf " in capsys.readouterr().out


def test_calibrate_noise_multiplier(capsys: pytest.CaptureFixture) -> None:
    args = ["calibrate", "--target-epsilon", "1", "--delta", "1e-5"]
    assert main([*args, "--sampling-probability", "0.01", "--steps", "1000", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["parameter"] == "noise_multiplier" and out["epsilon"] <= 1.0
    assert out["kind"] == "upper_bound" and out["accountant"] == "prv"
    assert main([*args, "--sampling-probability", "0.01", "--steps", "1000"]) == 0
    assert capsys.readouterr().out.startswith("noise multiplier: ")


def test_calibrate_other_variants(capsys: pytest.CaptureFixture) -> None:
    args = ["calibrate", "--target-epsilon", "2", "--delta", "1e-5", "--json"]
    assert main([*args, "--noise-multiplier", "1.0", "--steps", "500"]) == 0
    q = json.loads(capsys.readouterr().out)
    assert q["parameter"] == "sampling_probability" and 0 < q["value"] < 1
    assert main([*args, "--noise-multiplier", "1.0", "--sampling-probability", "0.01"]) == 0
    t = json.loads(capsys.readouterr().out)
    assert t["parameter"] == "steps" and isinstance(t["value"], int) and t["epsilon"] <= 2.0
    assert main([*args[:-1], "--noise-multiplier", "1.0", "--sampling-probability", "0.01"]) == 0
    assert capsys.readouterr().out.startswith(f"steps: {t['value']}")


@pytest.mark.parametrize(
    ("extra", "name"),
    [
        (["--steps", "10"], "exactly two"),
        (
            ["--steps", "10", "--noise-multiplier", "1", "--sampling-probability", "0.1"],
            "exactly two",
        ),
        (["--steps", "10", "--sampling-probability", "0.1", "--accountant", "all"], "accountant"),
        (
            ["--steps", "10", "--sampling-probability", "0.1", "--accountant", "rdp,pld"],
            "accountant",
        ),
        (
            ["--steps", "10", "--sampling-probability", "0.1", "--accountant", "gdp"],
            "pass --allow-approximation to calibrate",
        ),
        (["--steps", "10", "--sampling-probability", "1.5"], "--sampling-probability=1.5"),
        (["--steps", "10", "--sampling-probability", "0"], "--sampling-probability=0.0"),
        (["--steps", "0", "--sampling-probability", "0.5"], "--steps=0"),
        (["--steps", "10", "--noise-multiplier", "nan"], "--noise-multiplier=nan"),
    ],
)
def test_calibrate_bad_input(extra: list[str], name: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["calibrate", "--target-epsilon", "1", "--delta", "1e-5", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dpledger calibrate: error: ") and err.count("\n") == 1
    assert name in err


def test_calibrate_unreachable_and_approximation(capsys: pytest.CaptureFixture) -> None:
    base = [
        "calibrate",
        "--delta",
        "1e-5",
        "--noise-multiplier",
        "0.5",
        "--sampling-probability",
        "1",
    ]
    assert main([*base, "--target-epsilon", "0.01"]) == 2
    assert "--target-epsilon=0.01 is invalid" in capsys.readouterr().err
    args = ["calibrate", "--target-epsilon", "1", "--delta", "1e-5", "--steps", "100"]
    args += ["--sampling-probability", "0.01", "--accountant", "gdp", "--allow-approximation"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kind"] == "approximation" and out["warnings"]
    assert math.isfinite(out["value"])


def test_printed_bounds_are_rounded_towards_the_safe_side() -> None:
    from dpledger.accountants.commands import _fmt

    assert _fmt(0.72420001, "up") == "0.724201"  # to nearest this would read 0.7242 < ε
    assert _fmt(0.72420099, "down") == "0.724200"
    assert _fmt(0.7242, "up") == "0.7242"  # exact values are shown as they are
    assert _fmt(1.2345601e-300, "up") == "1.23457e-300"  # never rounded to 0 either
    assert _fmt(0.72420001) == "0.7242"


@pytest.mark.slow
def test_epsilon_table_never_shows_less_than_the_upper_bound(
    ledger_file: str, capsys: pytest.CaptureFixture
) -> None:
    assert main(["epsilon", ledger_file, "--delta", "1e-5", "--accountant", "rdp,pld"]) == 0
    table = capsys.readouterr().out
    assert (
        main(["epsilon", ledger_file, "--delta", "1e-5", "--accountant", "rdp,pld", "--json"]) == 0
    )
    rows = {r["accountant"]: r for r in _json_lines(capsys.readouterr().out)}
    for line in table.splitlines():
        words = line.split()
        if words and words[0] in rows and rows[words[0]]["kind"] == "upper_bound":
            assert float(words[1]) >= rows[words[0]]["epsilon"]
            assert float(words[4]) >= rows[words[0]]["upper"]


def _beyond_every_grid(tmp_path: Path) -> str:
    """Three steps with z = 10⁻⁶: no PLD grid fits its memory budget (a refusal) and PRV falls
    back to the RDP bound (a warning)."""
    return _write(tmp_path / "tiny_z.dpl", [(0.01, 1e-6)] * 3)


def test_a_budget_refusal_under_all_is_that_accountants_row(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Exit status as for `dpledger report`: 0 when some accountant answered, 2 when none did."""
    path = _beyond_every_grid(tmp_path)
    assert main(["epsilon", path, "--delta", "1e-7", "--json"]) == 0
    rows = {r["accountant"]: r for r in _json_lines(capsys.readouterr().out)}
    assert rows["pld"]["epsilon"] is None
    assert rows["pld"]["error"].startswith("could not compute: the pld accountant would need")
    assert rows["rdp"]["epsilon"] > 0 and rows["prv"]["kind"] == "upper_bound"
    assert main(["epsilon", path, "--delta", "1e-7"]) == 0
    out = capsys.readouterr().out
    assert "pld         refused: could not compute: the pld accountant would need" in out
    assert main(["epsilon", path, "--delta", "1e-7", "--accountant", "pld,pld", "--json"]) == 2
    assert all("error" in r for r in _json_lines(capsys.readouterr().out))
    # the one accountant asked for: its refusal is the command's error, as before
    assert main(["epsilon", path, "--delta", "1e-7", "--accountant", "pld"]) == 2
    assert capsys.readouterr().err.startswith("dpledger epsilon: error: the pld accountant")


@pytest.mark.slow
def test_the_prv_fallback_warning_is_shown_once_with_its_row(tmp_path: Path) -> None:
    """Run as a user runs it (a subprocess: no test logging handlers), every stderr line is the
    CLI's own, and the fallback's warning appears once, under the prv row."""
    path = _beyond_every_grid(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    result = subprocess.run(
        [sys.executable, "-m", "dpledger", "epsilon", path, "--delta", "1e-7"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert all(line.startswith("dpledger epsilon: ") for line in result.stderr.splitlines())
    both = result.stdout + result.stderr
    assert both.count("PRV numerical check failed") == 1
    lines = result.stdout.splitlines()
    prv = next(i for i, line in enumerate(lines) if line.startswith("prv "))
    assert "warning: PRV numerical check failed" in lines[prv + 1]
