"""The record-independence probe: models that mix records are refused before anything is recorded,
models that keep records apart train exactly as without the probe."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.utils.data import TensorDataset

from dpledger import PrivacyLedger
from dpledger.adapters.torch import DPOptimizer, make_private, probe_record_independence
from dpledger.adapters.torch.record_probe import _changed_record_zero
from dpledger.errors import (
    InvalidParameterError,
    RecordDependenceError,
    RecordMixingLayerError,
    RecordProbeError,
    UnsupportedLayerError,
)

B, D, C = 8, 6, 3


# ---------------------------------------------------------------- models that mix records


class MeanCentre(nn.Module):
    def forward(self, x):
        return x - x.mean(0, keepdim=True)


class FunctionalBatchNorm(nn.Module):
    def forward(self, x):
        return F.batch_norm(x, None, None, training=True)


class BatchDistances(nn.Module):
    def forward(self, x):
        weights = torch.softmax(-torch.cdist(x, x), dim=1)  # (B, B) distances between records
        return weights @ x  # each record smoothed with its neighbours in the batch


class SoftmaxOverBatch(nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=0)


class SequenceFirstAttention(nn.Module):
    """Batch-first data fed to an attention that expects (T, B, d): it attends over the batch."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(D, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=False)
        self.head = nn.Linear(8, C)

    def forward(self, x):  # x: (B, T, D)
        h = self.embed(x)
        h, _ = self.attn(h, h, h)
        return self.head(h.mean(1))


class CentredInOwnForward(nn.Module):
    """Mixing written in the model's own forward, between two children."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D, 8)
        self.fc2 = nn.Linear(8, C)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(h - h.mean(0))


class ParametrisedBatchNorm(nn.Module):
    """F.batch_norm with its own affine parameters inside a custom module."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return F.batch_norm(x, None, None, self.weight, self.bias, training=True)


def mlp_around(layer):
    return nn.Sequential(nn.Linear(D, D), nn.Tanh(), layer, nn.Linear(D, C))


MIXING = {
    "mean_centring": (lambda: mlp_around(MeanCentre()), "2", "MeanCentre", (B, D)),
    "functional_batch_norm": (lambda: mlp_around(FunctionalBatchNorm()), "2", None, (B, D)),
    "cdist_over_batch": (lambda: mlp_around(BatchDistances()), "2", None, (B, D)),
    "softmax_over_dim0": (lambda: mlp_around(SoftmaxOverBatch()), "2", None, (B, D)),
    "attention_over_batch": (SequenceFirstAttention, "attn", "MultiheadAttention", (B, 5, D)),
    "centring_in_own_forward": (CentredInOwnForward, "", "CentredInOwnForward", (B, D)),
    "parametrised_batch_norm": (
        lambda: mlp_around(ParametrisedBatchNorm(D)),
        "2",
        "ParametrisedBatchNorm",
        (B, D),
    ),
}


def _wrap(model, **kwargs):
    kwargs.setdefault("l2_norm_bound", 1.0)
    kwargs.setdefault("noise_multiplier", 1.0)
    kwargs.setdefault("sampling_probability", 0.1)
    kwargs.setdefault("population_size", 100)
    kwargs.setdefault("seed", 0)
    kwargs.setdefault("ledger", PrivacyLedger())
    return DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, **kwargs)


def _batch(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    y = torch.randint(0, C, (shape[0],), generator=g)
    return x, y


@pytest.mark.parametrize("case", sorted(MIXING))
def test_mixing_model_is_refused_at_the_first_forward_naming_the_module(case):
    make, name, type_name, shape = MIXING[case]
    torch.manual_seed(0)
    model = make()
    dp = _wrap(model)
    x, y = _batch(shape)
    with pytest.raises(RecordDependenceError) as info:
        F.cross_entropy(model(x), y).backward()
    assert info.value.layer_name == name
    if type_name is not None:
        assert info.value.layer_type == type_name
    assert isinstance(info.value, RecordMixingLayerError)
    assert "mixes the records" in str(info.value)
    assert dp.ledger.num_steps == 0 and dp.ledger.num_events == 0
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(RecordDependenceError):  # refused again: nothing was marked as probed
        model(x)


def test_mixing_in_the_models_own_forward_names_the_first_child_with_mixed_input():
    torch.manual_seed(0)
    model = CentredInOwnForward()
    _wrap(model)
    with pytest.raises(RecordDependenceError, match=r"'fc2' \(Linear\) already receives mixed"):
        model(_batch((B, D))[0])


def test_mixing_model_is_refused_through_make_private_with_virtual_batches():
    torch.manual_seed(0)
    model = mlp_around(MeanCentre())
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(200, D, generator=g), torch.randint(0, C, (200,), generator=g))
    model, dp, loader = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        sampling_probability=0.2,
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        seed=0,
        max_physical_batch_size=8,
    )
    with pytest.raises(RecordDependenceError):
        for x, y in loader:
            dp.zero_grad()
            F.cross_entropy(model(x), y).backward()
            dp.step()
    assert dp.ledger.num_events == 0


class GradientMixer(torch.autograd.Function):
    """Identity forward; the backward adds the batch mean of the output gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g + g.mean(0, keepdim=True)


class BackwardMixer(nn.Module):
    def forward(self, x):
        return GradientMixer.apply(x)


def test_mixing_only_in_the_backward_is_refused_naming_the_parameters():
    torch.manual_seed(0)
    model = mlp_around(BackwardMixer())
    _wrap(model)
    with pytest.raises(RecordDependenceError, match="the backward mixes records") as info:
        model(_batch((B, D))[0])
    assert info.value.layer_name is None
    assert "0.weight" in info.value.parameters


# ---------------------------------------------------------------- models that keep records apart


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(D, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, C)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)).mean(1))


class EmbeddingBagModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.head = nn.Linear(8, C)

    def forward(self, idx):
        return self.head(self.emb(idx).mean(1))


def _cnn():
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(16, C),
    )


CORRECT = {
    "mlp": (lambda: nn.Sequential(nn.Linear(D, 8), nn.ReLU(), nn.Linear(8, C)), (B, D)),
    "cnn_groupnorm": (_cnn, (B, 1, 6, 6)),
    "transformer_encoder": (Encoder, (B, 5, D)),
    "embedding": (EmbeddingBagModel, None),
    "mlp_dropout": (
        lambda: nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, C)),
        (B, D),
    ),
    "layernorm_frozen_batchnorm": (
        lambda: nn.Sequential(
            nn.Linear(D, 8), nn.LayerNorm(8), nn.BatchNorm1d(8).eval(), nn.Linear(8, C)
        ),
        (B, D),
    ),
}


def _inputs(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    if shape is None:
        return torch.randint(0, 20, (B, 7), generator=g), torch.randint(0, C, (B,), generator=g)
    return _batch(shape, seed)


def _train(model, shape, steps, probe):
    dp = _wrap(model, check_record_independence=probe)
    for s in range(steps):
        x, y = _inputs(shape, s)
        dp.zero_grad()
        F.cross_entropy(model(x), y).backward()
        dp.step()
    return dp


@pytest.mark.parametrize("case", sorted(CORRECT))
def test_correct_model_trains_exactly_as_without_the_probe(case):
    make, shape = CORRECT[case]
    results = []
    for probe in (True, False):
        torch.manual_seed(0)
        model = make()
        dp = _train(model, shape, 3, probe)
        results.append(([p.detach().clone() for p in model.parameters()], torch.rand(3)))
        assert dp.ledger.num_steps == 3
        assert (dp._gradients.probed is not None) == probe
    (params_on, rng_on), (params_off, rng_off) = results
    for a, b in zip(params_on, params_off, strict=True):
        assert torch.equal(a, b)  # same dropout masks, same noise: the probe changed nothing
    assert torch.equal(rng_on, rng_off)  # the global generator is where training left it


def test_probe_leaves_gradients_buffers_and_rng_untouched():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(D, 8), nn.BatchNorm1d(8).eval(), nn.Dropout(0.3), nn.Linear(8, C)
    )
    dp = _wrap(model)
    buffers = [b.clone() for b in model.buffers()]
    state = torch.get_rng_state()
    x, _ = _batch((B, D))
    assert probe_record_independence(model, engine=dp.engine, args=(x,)) is True
    assert torch.equal(state, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers(), strict=True))
    assert not dp.engine.has_gradients


def test_batch_of_one_is_not_probed_and_the_next_batch_is():
    torch.manual_seed(0)
    model = mlp_around(MeanCentre())
    dp = _wrap(model)
    x, y = _batch((1, D))
    dp.zero_grad()
    F.cross_entropy(model(x), y).backward()  # one record cannot mix: the step is sound
    dp.step()
    assert dp._gradients.probed is None
    with pytest.raises(RecordDependenceError):
        model(_batch((B, D))[0])
    assert dp.ledger.num_steps == 1


class TrainOnlyCentring(nn.Module):
    def forward(self, x):
        return x - x.mean(0) if self.training else x


def test_probe_runs_again_when_the_model_changes():
    torch.manual_seed(0)
    model = mlp_around(TrainOnlyCentring()).eval()
    dp = _wrap(model)
    x, y = _batch((B, D))
    dp.zero_grad()
    F.cross_entropy(model(x), y).backward()
    dp.step()
    model.train()  # the mode changes the forward: probed again
    with pytest.raises(RecordDependenceError, match="TrainOnlyCentring"):
        model(x)
    model.eval()
    model[2] = MeanCentre()  # a module replaced: probed again
    with pytest.raises(RecordDependenceError, match="MeanCentre"):
        model(x)
    assert dp.ledger.num_steps == 1


def test_probe_runs_once_for_an_unchanged_model(monkeypatch):
    import dpledger.adapters.torch.gradient_source as gradient_source_module

    calls = []
    real = gradient_source_module.probe_record_independence
    monkeypatch.setattr(
        gradient_source_module,
        "probe_record_independence",
        lambda *a, **k: calls.append(1) or real(*a, **k),
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, C))
    dp = _wrap(model)
    for s in range(3):
        x, y = _batch((B, D), s)
        dp.zero_grad()
        F.cross_entropy(model(x), y).backward()
        dp.step()
        with torch.no_grad():
            model(x)  # evaluation forwards do not probe
    assert calls == [1]


def test_switching_the_probe_off_logs_a_warning_and_accepts_the_mixing_model(caplog):
    torch.manual_seed(0)
    model = mlp_around(MeanCentre())
    with caplog.at_level(logging.WARNING, logger="dpledger.adapters.torch.optimizer"):
        dp = _wrap(model, check_record_independence=False)
    assert "check_record_independence=False" in caplog.text
    x, y = _batch((B, D))
    F.cross_entropy(model(x), y).backward()
    dp.step()
    assert dp.ledger.num_steps == 1


def test_bad_arguments():
    model = nn.Sequential(nn.Linear(D, C))
    with pytest.raises(InvalidParameterError, match="check_record_independence"):
        _wrap(model, check_record_independence="yes")
    dp = _wrap(nn.Sequential(nn.Linear(D, C)))
    with pytest.raises(InvalidParameterError, match="max_records"):
        probe_record_independence(
            dp.model, engine=dp.engine, args=(torch.ones(4, D),), max_records=1
        )


def test_forward_error_on_the_probe_slice_is_a_typed_error_naming_the_probe():
    class FixedBatch(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(D, C)

        def forward(self, x):
            return self.fc(x).view(B, C)

    model = FixedBatch()
    dp = _wrap(model)
    with pytest.raises(RecordProbeError, match="check_record_independence=False") as info:
        model(_batch((B, D))[0])
    assert info.value.run == "original"
    assert "record-independence probe" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert dp.ledger.num_events == 0


class Quantised(nn.Module):
    """Pixels in [0, 1) turned into token ids: an input outside [0, 1) indexes out of range."""

    def __init__(self, levels=16):
        super().__init__()
        self.levels = levels
        self.embed = nn.Embedding(levels, 4)
        self.head = nn.Linear(4, C)

    def forward(self, x):
        ids = (x * self.levels).long()
        return self.head(self.embed(ids).mean(1))


def test_probe_perturbs_within_the_inputs_own_values():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    x = torch.rand((B, D), generator=g)
    y = torch.randint(0, C, (B,), generator=g)
    model = Quantised()
    dp = _wrap(model)
    F.cross_entropy(model(x), y).backward()  # the probe runs in this forward
    dp.step()
    assert dp.ledger.num_steps == 1


def test_changed_probe_batch_holds_only_values_the_batch_takes():
    x = torch.rand((B, D), generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, 5, (B, 3), generator=torch.Generator().manual_seed(2))
    (changed_x, changed_ids), other = _changed_record_zero((x[:4], ids[:4]), 4)
    assert other == 1
    assert torch.equal(changed_x[0], x[1]) and torch.equal(changed_ids[0], ids[1])
    assert torch.equal(changed_x[1:], x[1:4]) and torch.equal(changed_ids[1:], ids[1:4])
    same = torch.ones(4, 3)
    same[:, 0] = 2.0
    (rolled,), other = _changed_record_zero((same,), 4)
    assert other is None
    assert sorted(rolled[0].tolist()) == sorted(same[0].tolist())
    assert not torch.equal(rolled[0], same[0])


def test_forward_failing_only_on_the_changed_record_names_the_changed_run():
    class FailsOnACopy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(D, C)

        def forward(self, x):
            if x.shape[0] > 1 and torch.equal(x[0], x[1]):
                raise IndexError("index 17 is out of bounds for dimension 0 with size 16")
            return self.fc(x)

    model = FailsOnACopy()
    _wrap(model)
    with pytest.raises(RecordProbeError, match="record 0 replaced by a copy of record 1") as info:
        model(_batch((B, D))[0])
    assert info.value.run == "changed"
    assert "IndexError: index 17" in str(info.value)
    assert isinstance(info.value.__cause__, IndexError)


def test_generic_path_failure_is_a_typed_error_naming_the_module_without_the_probe():
    torch.manual_seed(0)
    model = mlp_around(ParametrisedBatchNorm(D))
    dp = _wrap(model, check_record_independence=False)
    x, y = _batch((B, D))
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(UnsupportedLayerError, match=r"'2' \(ParametrisedBatchNorm\)"):
        dp.step()
    assert dp.ledger.num_events == 0
