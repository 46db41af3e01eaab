"""The noise-provenance record: its checks, its note, and what info, epsilon and report say."""

from __future__ import annotations

import json
import logging

import pytest

from dpledger import PrivacyLedger
from dpledger.accountants import RdpAccountant, ResultKind, make_accountant
from dpledger.cli import main
from dpledger.errors import InvalidParameterError
from dpledger.ledger.provenance import (
    PROVENANCE_KEY,
    NoiseProvenance,
    note_noise_provenance,
    provenance_of,
    seeding_of,
)
from dpledger.report.build import build_report

OS = NoiseProvenance(entry_point="numpy.sampled_step", generator="g", seeding="os_entropy")
SEEDED = NoiseProvenance(
    entry_point="torch.DPOptimizer",
    generator="torch.Generator(cpu)",
    seeding="caller_seed",
    sampler_seeding="os_entropy",
)


def _ledger(path, record: NoiseProvenance | None) -> None:
    with PrivacyLedger(path) as ledger:
        if record is not None:
            note_noise_provenance(ledger, record)
        for _ in range(20):
            ledger.record_sample(sampling_probability=0.01, population_size=1000)
            ledger.record_sum_query(l2_norm_bound=1.0, noise_stddev=1.1)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seeding", "seed=0"),
        ("seeding", None),
        ("sampler_seeding", "fixed"),
        ("checkpoint", "maybe"),
        ("secure_sampler", 1),
        ("generator", ""),
        ("entry_point", 3),
        ("state_location", ""),
    ],
)
def test_a_bad_field_is_a_typed_error_naming_it(field, value):
    fields = {"entry_point": "e", "generator": "g", "seeding": "os_entropy", field: value}
    with pytest.raises(InvalidParameterError, match=field):
        NoiseProvenance(**fields)


def test_seeding_of_what_the_caller_gave():
    assert seeding_of(generator=None, seed=None) == "os_entropy"
    assert seeding_of(generator=None, seed=0) == "caller_seed"
    assert seeding_of(generator=object(), seed=None) == "caller_generator"


def test_the_record_round_trips_through_a_file_once_per_change(tmp_path):
    path = tmp_path / "run.dpl"
    with PrivacyLedger(path) as ledger:
        note_noise_provenance(ledger, OS)
        note_noise_provenance(ledger, OS)  # the same again: no second line
        note_noise_provenance(ledger, SEEDED)
    loaded = PrivacyLedger.load(path)
    assert provenance_of(loaded.notes) == (OS, SEEDED)
    assert len(loaded.notes) == 2
    assert loaded.notes[0][PROVENANCE_KEY]["schema"] == 1
    # a record of an unknown schema, or another note, is not misread
    assert provenance_of([{PROVENANCE_KEY: {"schema": 2}}, {"intent": {}}, "x"]) == ()


def test_a_ledger_that_cannot_take_a_note_logs_the_record(tmp_path, caplog):
    ledger = PrivacyLedger(tmp_path / "run.dpl")
    ledger.close()
    with caplog.at_level(logging.WARNING, logger="dpledger"):
        note_noise_provenance(ledger, SEEDED)
    assert "could not be recorded" in caplog.text and "caller_seed" in caplog.text
    with pytest.raises(InvalidParameterError, match="record"):
        note_noise_provenance(ledger, {"seeding": "os_entropy"})


def test_an_old_ledger_says_not_recorded_and_keeps_its_epsilon(tmp_path, capsys):
    old, new = tmp_path / "old.dpl", tmp_path / "new.dpl"
    _ledger(old, None)
    _ledger(new, OS)
    eps = [RdpAccountant().epsilon(PrivacyLedger.load(p), delta=1e-5).epsilon for p in (old, new)]
    assert eps[0] == eps[1]
    assert main(["info", str(old)]) == 0
    assert "noise         not recorded" in capsys.readouterr().out
    assert main(["info", "--json", str(old)]) == 0
    assert json.loads(capsys.readouterr().out)["noise_provenance"] == "not recorded"
    assert main(["epsilon", str(old), "--delta", "1e-5", "--accountant", "rdp", "--strict"]) == 0
    captured = capsys.readouterr()
    assert "noise: not recorded" in captured.out and "warning" not in captured.err
    assert main(["epsilon", str(new), "--delta", "1e-5", "--accountant", "rdp"]) == 0
    assert "seeded by os_entropy" in capsys.readouterr().out


def test_a_caller_seed_is_a_warning_an_error_under_strict_and_a_report_finding(tmp_path, capsys):
    path = tmp_path / "seeded.dpl"
    _ledger(path, SEEDED)
    assert main(["epsilon", str(path), "--delta", "1e-5", "--accountant", "rdp"]) == 0
    captured = capsys.readouterr()
    assert "only while that seed stays secret" in captured.err
    assert "seeded by caller_seed" in captured.out
    assert main(["epsilon", str(path), "--delta", "1e-5", "--strict"]) == 1
    assert "seed the caller gave" in capsys.readouterr().err
    assert main(["info", str(path)]) == 0
    assert "only while that seed stays secret" in capsys.readouterr().err
    report = build_report(str(path), delta=1e-5, accountants=["rdp"])
    assert any(f.startswith("NOISE: ") and "seed stays secret" in f for f in report.findings)
    assert "caller_seed" in report.noise_provenance[0]


def test_checkpoints_that_carry_the_state_are_flagged(tmp_path, capsys):
    path = tmp_path / "kept.dpl"
    _ledger(
        path,
        NoiseProvenance(
            entry_point="e", generator="g", seeding="os_entropy", checkpoint="included"
        ),
    )
    assert main(["epsilon", str(path), "--delta", "1e-5", "--accountant", "rdp", "--strict"]) == 0
    assert "checkpoints stay secret" in capsys.readouterr().err


def test_numpy_sampled_step_seeds_from_the_os_and_records_it_once():
    import numpy as np

    from dpledger.mechanisms import GaussianSumQuery, sampled_step
    from dpledger.sampling import PoissonSampler

    query = GaussianSumQuery(l2_norm_bound=1.0, noise_stddev=1.0)
    ledger = PrivacyLedger()
    for _ in range(3):  # no generator: a fresh OS-seeded one, recorded once
        with sampled_step(ledger, sampling_probability=0.1, population_size=10) as step:
            step.run(query, np.ones((2, 3)))
    (record,) = provenance_of(ledger.notes)
    assert (record.entry_point, record.seeding) == ("numpy.sampled_step", "os_entropy")
    assert record.generator == "numpy.random.Generator(PCG64)"
    assert ledger.num_steps == 3
    sampler = PoissonSampler(
        population_size=10, sampling_probability=0.5, generator=np.random.default_rng(7)
    )
    with sampled_step(ledger, sampler=sampler) as step:
        step.run(query, np.ones((len(step.indices), 3)))
    record = provenance_of(ledger.notes)[-1]
    assert (record.seeding, record.sampler_seeding) == ("caller_generator", "caller_generator")


def test_a_numpy_correlated_release_records_its_seeding():
    from dpledger.mechanisms.correlated import CorrelatedNoiseRelease, tree_factorization
    from dpledger.sampling.participation import ParticipationSchema

    for seed, seeding in ((None, "os_entropy"), (5, "caller_seed")):
        ledger = PrivacyLedger()
        CorrelatedNoiseRelease(
            ledger,
            tree_factorization(4),
            ParticipationSchema.single(num_steps=4),
            l2_norm_bound=1.0,
            noise_stddev=1.0,
            dim=2,
            seed=seed,
        )
        (record,) = provenance_of(ledger.notes)
        assert (record.entry_point, record.seeding) == ("numpy.CorrelatedNoiseRelease", seeding)


def test_secure_noise_is_reported_as_an_approximation_by_every_accountant(tmp_path, capsys):
    path = tmp_path / "secure.dpl"
    _ledger(
        path,
        NoiseProvenance(entry_point="e", generator="chacha20", seeding="os_entropy",
                        secure_sampler=True),
    )  # fmt: skip
    main(["epsilon", str(path), "--delta", "1e-5", "--accountant", "rdp"])
    captured = capsys.readouterr()
    assert "every accountant reports an approximation" in captured.err
    assert "secure discrete Gaussian" in captured.out
    ledger = PrivacyLedger.load(path)
    for name in ("rdp", "pld", "prv"):
        for result in (
            make_accountant(name).epsilon(ledger, delta=1e-5),
            make_accountant(name).delta(ledger, epsilon=1.0),
            make_accountant(name).epsilon_curve(ledger, delta=1e-5, steps=[1])[0],
        ):
            assert result.kind is ResultKind.APPROXIMATION, (name, result)
            assert result.upper is None and result.lower is None
            assert any("no accountant's analysis is proved" in w for w in result.warnings)


def test_a_ledger_without_secure_noise_keeps_its_upper_bound(tmp_path):
    path = tmp_path / "plain.dpl"
    _ledger(path, NoiseProvenance(entry_point="e", generator="g", seeding="os_entropy"))
    result = make_accountant("rdp").epsilon(PrivacyLedger.load(path), delta=1e-5)
    assert result.kind is ResultKind.UPPER_BOUND
