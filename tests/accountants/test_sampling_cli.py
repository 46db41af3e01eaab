"""The CLI shows a ledger's sampling: ``info`` lists the kinds, ``epsilon`` says who certifies
them, why the others refuse, and for shuffled batches the gap to the Poisson ε."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dpledger import PrivacyLedger, SamplingEvent
from dpledger.accountants.prv import PrvAccountant
from dpledger.accountants.sampling_report import GapRelation, shuffle_gap
from dpledger.accountants.shuffle_bound import shuffle_epsilon_lower_bound
from dpledger.cli import main
from dpledger.ledger.steps import CompressedLedger


def shuffled(path: Path, neighboring: str, *, epochs: int = 3) -> Path:
    with PrivacyLedger(path, neighboring=neighboring) as ledger:
        for t in range(10 * epochs):
            ledger.record_sample(event=SamplingEvent.shuffle(100, 1000, epoch_start=t % 10 == 0))
            ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=0.8)
    return path


def test_info_lists_the_sampling_kinds(tmp_path: Path, capsys) -> None:
    path = shuffled(tmp_path / "s.dpl", "replace_one")
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert (
        "shuffle(b=100, n=1000): 30 steps, 3 epochs (unit record; analysed under replace_one)"
        in out
    )
    # the runs table: one row for the three epochs of one shape, not an epoch-start row plus
    # the rest for every epoch
    assert (
        "  {:>12}  {:>16}  {:>10}  shuffle (3 epochs of 10 steps)\n".format("0.1", "0.8", 30) in out
    )
    assert "epoch start" not in out
    assert main(["info", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["sampling"] == [
        {
            "sampling": "shuffle(b=100, n=1000)",
            "scheme": "shuffle",
            "unit": "record",
            "relations": ["replace_one"],
            "steps": 30,
            "epochs": 3,
        }
    ]
    assert info["runs"][0]["epoch_start"] is True and info["runs"][1]["epoch_start"] is False


def test_fifteen_epochs_and_a_partial_one_are_two_rows_in_info_and_the_report(
    tmp_path: Path, capsys
) -> None:
    from dpledger.report.build import build_report

    path = tmp_path / "s.dpl"
    with PrivacyLedger(path, neighboring="replace_one") as ledger:
        for t in range(10 * 15 + 4):
            ledger.record_sample(event=SamplingEvent.shuffle(100, 1000, epoch_start=t % 10 == 0))
            ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=0.8)
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    table = out[out.index("runs ") : out.index("queries ")].splitlines()[2:]
    assert [line.split()[-7:] for line in table] == [
        ["150", "shuffle", "(15", "epochs", "of", "10", "steps)"],
        ["4", "shuffle", "(1", "epoch", "of", "4", "steps)"],
    ]
    runs = build_report(path, delta=1e-5, accountants=("rdp",), curve_points=1).runs
    assert [(r["first_step"], r["last_step"], r["epochs"], r["steps_per_epoch"]) for r in runs] == [
        (1, 150, 15, 10),
        (151, 154, 1, 4),
    ]


def test_epsilon_names_who_certifies_and_why_the_others_refuse(tmp_path: Path, capsys) -> None:
    path = shuffled(tmp_path / "s.dpl", "replace_one")
    assert main(["epsilon", str(path), "--delta", "1e-5"]) == 0
    out = capsys.readouterr().out
    assert (
        "prv         refused: the prv accountant has no valid analysis of steps sampled by "
        "'shuffle'" in out
    )
    assert "pld " in out and "upper_bound" in out
    assert "sampling: this ledger's steps were sampled by shuffle(b=100, n=1000)" in out
    assert "Compared under replace-one" in out and "Chua et al. lower bound" in out


def test_an_add_remove_shuffle_ledger_gets_no_epsilon_but_the_gap(tmp_path: Path, capsys) -> None:
    path = shuffled(tmp_path / "s.dpl", "add_remove")
    assert main(["epsilon", str(path), "--delta", "1e-5", "--json"]) == 2  # nothing certified
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert all("error" in row for row in rows)
    assert "analysed under replace_one only" in rows[0]["error"]
    notes = rows[0]["sampling_notes"]
    assert "under zero-out the Poisson ε is NOT a valid guarantee" in notes[1]


def test_the_gap_matches_its_parts(tmp_path: Path) -> None:
    ledger = PrivacyLedger.load(shuffled(tmp_path / "s.dpl", "replace_one", epochs=4))
    gap = shuffle_gap(ledger.compressed(), delta=1e-5)
    assert gap is not None and (gap.steps, gap.epochs) == (40, 4)
    assert gap.lower_bound is not None and gap.relation is GapRelation.REPLACE_ONE
    assert gap.lower_bound.epsilon == shuffle_epsilon_lower_bound(
        batches_per_epoch=10, epochs=4, noise_multiplier=0.8, delta=1e-5, neighboring="replace_one"
    )
    poisson = CompressedLedger.from_runs([(0.1, 0.8, 40)], neighboring="replace_one")
    assert gap.poisson_epsilon.epsilon == PrvAccountant().epsilon(poisson, delta=1e-5).epsilon
    assert gap.refutes_poisson and gap.lower_bound.epsilon > gap.poisson_epsilon.epsilon
    # the printed lower bound never exceeds the computed one, the Poisson ε is never below its own
    shown = float(gap.describe().split("at least ")[1].split(" ")[0])
    assert shown <= gap.lower_bound.epsilon
    shown_poisson = float(gap.describe().split("ε would be ")[1].split(" ")[0])
    assert shown_poisson >= gap.poisson_epsilon.epsilon


def test_poisson_ledgers_print_no_sampling_notes(tmp_path: Path, capsys) -> None:
    path = tmp_path / "p.dpl"
    with PrivacyLedger(path) as ledger:
        ledger.record_sample(sampling_probability=0.01, population_size=1000)
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.0)
    assert main(["epsilon", str(path), "--delta", "1e-5"]) == 0
    assert "sampling:" not in capsys.readouterr().out


@pytest.mark.parametrize("z", [[0.8, 0.9]])
def test_no_lower_bound_when_the_noise_varies(tmp_path: Path, z) -> None:
    ledger = PrivacyLedger()
    for t in range(20):
        ledger.record_sample(event=SamplingEvent.shuffle(100, 1000, epoch_start=t % 10 == 0))
        ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=z[t // 10])
    gap = shuffle_gap(ledger.compressed(), delta=1e-5)
    assert gap is not None and gap.lower_bound is None and gap.noise_multiplier == 0.8
    assert "no lower bound" in gap.describe() and not gap.refutes_poisson
