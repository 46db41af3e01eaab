"""make_private and the noise-multiplier calibration for a target ε."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch.utils.data import DataLoader, TensorDataset

from dpledger import PrivacyLedger
from dpledger._version import __version__
from dpledger.accountants import (
    PldAccountant,
    PrvAccountant,
    calibrate_noise_multiplier,
)
from dpledger.adapters.torch import DPOptimizer, make_private
from dpledger.errors import InvalidParameterError
from tests.adapters.torch.dp_helpers import batch, small_cnn

DATA = TensorDataset(*batch(40, dtype=torch.float32))


def test_calibration_matches_the_accountants_api_and_the_run_meets_the_target():
    z = calibrate_noise_multiplier(
        target_epsilon=3.0, delta=1e-5, sampling_probability=0.1, epochs=3
    ).value
    want = calibrate_noise_multiplier(
        target_epsilon=3.0, delta=1e-5, sampling_probability=0.1, steps=30
    ).value
    assert z == want
    model = small_cnn(dtype=torch.float32)
    ledger = PrivacyLedger()
    model, dp, loader = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(DATA, batch_size=7, shuffle=True),  # its batching is replaced
        sampling_probability=0.1,
        l2_norm_bound=1.0,
        target_epsilon=3.0,
        delta=1e-5,
        epochs=3,
        ledger=ledger,
        seed=0,
    )
    assert isinstance(dp, DPOptimizer) and dp.noise_multiplier == z
    assert loader.batch_sampler.sampling_probability == 0.1 and len(loader) == 10
    for _ in range(3):
        for x, y in loader:
            dp.zero_grad()
            F.cross_entropy(model(x), y).backward()
            dp.step()
    assert ledger.num_steps == 30
    # the calibrating accountant (PRV's certified upper bound) and an independent PLD agree
    assert PrvAccountant().epsilon(ledger, delta=1e-5).upper <= 3.0
    assert PldAccountant().epsilon(ledger, delta=1e-5).epsilon <= 3.0


def test_the_same_seed_gives_the_same_run():
    runs = []
    for _ in range(2):
        model = small_cnn(dtype=torch.float32)
        model, dp, loader = make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            DATA,
            sampling_probability=0.2,
            l2_norm_bound=1.0,
            noise_multiplier=1.0,
            seed=4,
        )
        for x, y in loader:
            dp.zero_grad()
            F.cross_entropy(model(x), y).backward()
            dp.step()
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        ({}, "noise_multiplier"),
        ({"noise_multiplier": 1.0, "target_epsilon": 1.0}, "noise_multiplier"),
        ({"target_epsilon": 1.0, "epochs": 1}, "delta"),
        ({"target_epsilon": 1.0, "delta": 2.0, "epochs": 1}, "delta"),
        ({"target_epsilon": 1.0, "delta": 1e-5}, "steps"),
        ({"target_epsilon": 1.0, "delta": 1e-5, "epochs": 1, "steps": 3}, "steps"),
        ({"target_epsilon": 1.0, "delta": 1e-5, "epochs": -1.0}, "epochs"),
        ({"noise_multiplier": 1.0, "sampling_probability": 0.0}, "sampling_probability"),
        ({"noise_multiplier": 1.0, "max_physical_batch_size": 0}, "max_physical_batch_size"),
        ({"noise_multiplier": 1.0, "seed": 1.5}, "seed"),
        ({"noise_multiplier": 1.0, "sampler": None}, "sampler"),
    ],
)
def test_make_private_rejects_bad_input(kwargs, parameter):
    model = small_cnn(dtype=torch.float32)
    kwargs = {"sampling_probability": 0.1, "l2_norm_bound": 1.0, **kwargs}
    with pytest.raises(InvalidParameterError) as info:
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DATA, **kwargs)
    assert info.value.parameter == parameter
    with pytest.raises(InvalidParameterError, match="data"):
        make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            [1, 2],
            sampling_probability=0.1,
            l2_norm_bound=1.0,
            noise_multiplier=1.0,
        )


def test_make_private_warns_when_delta_is_at_least_one_over_n():
    from dpledger.errors import DeltaTooLargeWarning

    model = small_cnn(dtype=torch.float32)
    with pytest.warns(DeltaTooLargeWarning) as caught:
        make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            DATA,
            sampling_probability=0.1,
            l2_norm_bound=1.0,
            target_epsilon=3.0,
            delta=0.05,
            epochs=1,
            seed=0,
        )
    assert [str(w.message).split(":")[0] for w in caught] == [
        "delta=0.05 is at least 1/n = 1/40 (population_size=40)"
    ]
    assert "δ ≤ 1/(10n) = 0.0025" in str(caught[0].message)
    assert caught[0].filename == __file__


def test_calibration_is_recorded_in_the_ledger_metadata(caplog):
    model = small_cnn(dtype=torch.float32)
    with caplog.at_level("INFO", logger="dpledger"):
        _, dp, _ = make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            DATA,
            sampling_probability=0.1,
            l2_norm_bound=1.0,
            target_epsilon=3.0,
            delta=1e-5,
            epochs=3,
            seed=0,
        )
    intent = dp.ledger.header.metadata["intent"]
    assert intent["calibrated_by"] == "prv"
    assert intent["target_epsilon"] == 3.0 and intent["delta"] == 1e-5
    assert intent["noise_multiplier"] == dp.noise_multiplier
    assert (
        intent["noise_multiplier"]
        == calibrate_noise_multiplier(
            target_epsilon=3.0, delta=1e-5, sampling_probability=0.1, epochs=3
        ).value
    )
    assert "calibrated by the prv accountant for ε = 3" in caplog.text
    assert intent["population_size"] == 40 and intent["unit"] == "record"
    assert intent["sampling"] == "poisson" and intent["sampling_probability"] == 0.1
    assert intent["planned_steps"] == 30
    assert intent["versions"] == {"dpledger": __version__, "torch": torch.__version__}


def test_a_ledger_the_user_created_records_the_intent_in_a_note(tmp_path, capsys):
    from dpledger.cli import main

    model = small_cnn(dtype=torch.float32)
    path = tmp_path / "run.dpl"
    given = PrivacyLedger(path, metadata={"model": "cnn"})
    _, dp, loader = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DATA,
        sampling_probability=0.1,
        l2_norm_bound=1.0,
        target_epsilon=3.0,
        delta=1e-5,
        epochs=3,
        ledger=given,
        seed=0,
    )
    assert given.header.metadata == {"model": "cnn"}  # the header is the user's
    assert given.intent["calibrated_by"] == "prv" and given.intent["planned_steps"] == 30
    assert given.intent["noise_multiplier"] == dp.noise_multiplier
    for x, y in loader:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        dp.step()
        break
    given.close()
    assert main(["info", "--json", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["intent"] == given.intent
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "intent        target ε = 3 at δ = 1e-05; noise calibrated by prv" in out
    notes = PrivacyLedger.load(path).notes
    assert notes[0] == {"intent": given.intent}
    assert [list(n) for n in notes[1:]] == [["noise_provenance"]]  # the noise's source
    # a second run on the same ledger finds the intent and records no other note
    make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DATA,
        sampling_probability=0.1,
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        ledger=(again := PrivacyLedger(path, resume=True)),
        seed=0,
    )
    assert len(again.notes) == 2  # the intent and the noise's source, as before
    again.close()


def test_a_dataloader_without_sampling_probability_gives_q_from_its_batch_size(caplog):
    model = small_cnn(dtype=torch.float32)
    with caplog.at_level("INFO", logger="dpledger"):
        _, dp, loader = make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            DataLoader(DATA, batch_size=8, shuffle=True),
            l2_norm_bound=1.0,
            noise_multiplier=1.0,
            seed=0,
        )
    assert loader.batch_sampler.sampling_probability == 8 / 40
    assert (
        "sampling_probability not given: q = batch_size / len(dataset) = 8 / 40 = 0.2"
        in caplog.text
    )
    x, y = next(iter(loader))
    dp.zero_grad()
    F.cross_entropy(model(x), y).backward()
    dp.step()
    assert next(iter(dp.ledger.steps())).sampling_probability == 0.2


@pytest.mark.parametrize(
    ("declared", "loss_reduction", "warned"),
    [("mean", "sum", True), ("sum", "mean", True), ("mean", "mean", False), ("sum", "sum", False)],
)
def test_a_loss_whose_reduction_contradicts_the_declaration_is_warned_about(
    declared, loss_reduction, warned
):
    import warnings

    from dpledger.errors import LossReductionWarning

    model = small_cnn(dtype=torch.float32)
    _, dp, loader = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DATA,
        sampling_probability=0.5,
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        loss_reduction=declared,
        seed=0,
    )
    x, y = next(iter(loader))
    assert len(x) > 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dp.zero_grad()
        dp.backward(F.cross_entropy(model(x), y, reduction=loss_reduction))
        dp.step()
    found = [w.message for w in caught if issubclass(w.category, LossReductionWarning)]
    if not warned:
        assert found == []
        return
    (message,) = found
    assert (message.declared, message.found) == (declared, loss_reduction)
    assert message.loss_function == "NllLossBackward0"
    assert str(message).startswith(
        f"the loss was computed with reduction={loss_reduction!r} (NllLossBackward0, over "
        f"{len(x)} terms, a batch of {len(x)} records) but loss_reduction={declared!r} was declared"
    )
    assert dp.ledger.num_steps == 1  # recorded as ever: the warning changes nothing


def test_a_loader_batch_size_far_from_q_n_is_warned_about():
    import warnings

    from torch.utils.data import DataLoader

    model = small_cnn(dtype=torch.float32)

    def wrap(loader, q):
        return make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            loader,
            sampling_probability=q,
            l2_norm_bound=1.0,
            noise_multiplier=1.0,
            seed=0,
        )

    with pytest.warns(UserWarning, match="batch size given") as caught:
        wrap(DataLoader(DATA, batch_size=4), 0.5)  # q·n = 20 against 4
    assert "q·n = 20 records on average (n = 40)" in str(caught[0].message)
    assert "sampling_probability=4/40 = 0.1" in str(caught[0].message)
    assert caught[0].filename == __file__
    with pytest.warns(UserWarning, match="batch size given"):
        wrap(DataLoader(DATA, batch_size=20), 0.1)  # 4 against 20: small batches too
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrap(DataLoader(DATA, batch_size=4), 0.2)  # q·n = 8: within a factor of 2
        wrap(DataLoader(DATA, batch_size=4), None)  # q = 4/40 from the loader
        wrap(DATA, 0.5)  # a data set: no batch size to compare
