"""``dpledger check module:function``."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from dpledger.checks.commands import load_object  # noqa: E402
from dpledger.cli import main  # noqa: E402
from dpledger.errors import InvalidParameterError  # noqa: E402

STEPS = "tests.checks.torch_steps"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.statistical
def test_correct_step_exits_zero_and_prints_the_report(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "curves.png"
    code = main(["check", f"{STEPS}:correct_mse_step", "--plot", str(plot), "--threads", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "OK: 4 pass" in out and "[        PASS] noise_magnitude" in out
    assert plot.stat().st_size > 1000 and f"plot written to {plot}" in out


@pytest.mark.statistical
def test_buggy_step_exits_one_with_json(capsys):
    code = main(
        [
            "check",
            f"{STEPS}:clip_mean_mse_step",
            "--json",
            "--model",
            f"{STEPS}:small_mlp",
            "--checks",
            "clipping_applied,per_example_clipping",
        ]
    )
    data = json.loads(capsys.readouterr().out)
    assert code == 1
    assert data["failed"] == ["per_example_clipping"]
    assert [r["name"] for r in data["results"]] == ["clipping_applied", "per_example_clipping"]


def test_strict_turns_inconclusive_into_exit_one(capsys):
    args = [
        "check",
        f"{STEPS}:correct_ce_step",
        "--loss",
        "cross_entropy",
        "--labels",
        "hard",
        "--checks",
        "clipping_applied,per_example_clipping",
    ]
    assert main(args) == 0
    assert "[INCONCLUSIVE] per_example_clipping" in capsys.readouterr().out
    assert main([*args, "--strict"]) == 1


@pytest.mark.slow
def test_stateful_step_factory(capsys):
    code = main(["check", f"{STEPS}:correct_adam_mse", "--stateful", "--lr", "0.001"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "[     SKIPPED] noise_magnitude" in out


@pytest.mark.parametrize(
    "spec", ["nomodule_xyz:f", f"{STEPS}:missing", f"{STEPS}", f"{STEPS}:BUGS", ":f"]
)
def test_bad_step_spec_exits_two(spec, capsys):
    assert main(["check", spec]) == 2
    assert "error: STEP=" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args",
    [
        ["--checks", "nope"],
        ["--input-shape", "0"],
        ["--input-shape", "a"],
        ["--denominator", "-3"],
        ["--denominator", "mean"],
        ["--loss", "hinge"],
    ],
)
def test_bad_options_are_usage_errors(args):
    with pytest.raises(SystemExit) as info:
        main(["check", f"{STEPS}:correct_mse_step", *args])
    assert info.value.code == 2


def test_bad_thread_count_exits_two(capsys):
    assert main(["check", f"{STEPS}:correct_mse_step", "--threads", "0"]) == 2
    assert "--threads=0" in capsys.readouterr().err


def test_load_object_follows_dotted_attributes():
    assert load_object("json:decoder.JSONDecoder", parameter="p") is json.decoder.JSONDecoder
    with pytest.raises(InvalidParameterError) as info:
        load_object("json:__name__", parameter="--model")
    assert info.value.parameter == "--model"
