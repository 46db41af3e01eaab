"""Every registered layer type against an explicit per-example loop, on every engine path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from dpledger.adapters.torch import PerExampleGradientEngine
from dpledger.adapters.torch.layer_rules.conv import conv_norms
from dpledger.adapters.torch.registry import registered_layer_types
from dpledger.errors import InvalidParameterError
from tests.adapters.torch.reference import (
    DEVICES,
    assert_close_dicts,
    loop_per_example_grads,
    squared_norms,
    weighted_sum,
)

B = 4


def _idx(shape, high, *, low=0):
    return torch.randint(low, high, shape, generator=torch.Generator().manual_seed(3))


def _frozen_bn(bn: nn.Module) -> nn.Module:
    with torch.no_grad():
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
    return bn.eval()


# name -> (layer factory, input factory)
CASES = {
    "linear": (lambda: nn.Linear(4, 3), lambda: torch.randn(B, 4)),
    "linear-seq": (lambda: nn.Linear(4, 3), lambda: torch.randn(B, 5, 4)),
    "linear-non-dynamically-quantizable": (
        lambda: nn.modules.linear.NonDynamicallyQuantizableLinear(4, 3),
        lambda: torch.randn(B, 5, 4),
    ),
    "linear-seq2-nobias": (lambda: nn.Linear(4, 3, bias=False), lambda: torch.randn(B, 2, 3, 4)),
    "conv1d-groups-stride": (
        lambda: nn.Conv1d(4, 6, 3, stride=2, padding=1, groups=2),
        lambda: torch.randn(B, 4, 9),
    ),
    "conv1d-dilation-circular": (
        lambda: nn.Conv1d(3, 2, 3, dilation=2, padding=2, padding_mode="circular"),
        lambda: torch.randn(B, 3, 8),
    ),
    "conv2d-stride": (
        lambda: nn.Conv2d(2, 4, 3, stride=(2, 1), padding=1),
        lambda: torch.randn(B, 2, 7, 6),
    ),
    "conv2d-same-reflect-dilation": (
        lambda: nn.Conv2d(2, 3, (2, 3), padding="same", padding_mode="reflect", dilation=(1, 2)),
        lambda: torch.randn(B, 2, 6, 7),
    ),
    "conv2d-depthwise-nobias-valid": (
        lambda: nn.Conv2d(4, 4, 3, groups=4, bias=False, padding="valid"),
        lambda: torch.randn(B, 4, 5, 5),
    ),
    "conv2d-groups-channels-inner": (
        lambda: nn.Conv2d(8, 4, (3, 2), stride=(1, 2), groups=2),
        lambda: torch.randn(B, 8, 5, 6),
    ),
    "embedding": (lambda: nn.Embedding(7, 3), lambda: _idx((B, 6), 7)),
    "embedding-padding-idx": (
        lambda: nn.Embedding(7, 3, padding_idx=0),
        lambda: _idx((B, 2, 3), 7),
    ),
    "layernorm": (lambda: nn.LayerNorm(4), lambda: torch.randn(B, 3, 4)),
    "layernorm-2d-nobias": (lambda: nn.LayerNorm((3, 4), bias=False), lambda: torch.randn(B, 3, 4)),
    "groupnorm": (lambda: nn.GroupNorm(2, 4), lambda: torch.randn(B, 4, 3, 3)),
    "rmsnorm": (lambda: nn.RMSNorm(4), lambda: torch.randn(B, 3, 4)),
    "batchnorm1d-frozen": (lambda: _frozen_bn(nn.BatchNorm1d(3)), lambda: torch.randn(B, 3)),
    "batchnorm2d-frozen": (lambda: _frozen_bn(nn.BatchNorm2d(3)), lambda: torch.randn(B, 3, 2, 2)),
    "batchnorm3d-frozen": (
        lambda: _frozen_bn(nn.BatchNorm3d(2)),
        lambda: torch.randn(B, 2, 2, 1, 2),
    ),
}


def _setup(name: str):
    torch.manual_seed(sum(map(ord, name)))
    make_layer, make_input = CASES[name]
    layer = make_layer().double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    x = make_input()
    if x.is_floating_point():
        x = x.double()
    target = torch.randn(layer(x).shape, dtype=torch.float64)
    return layer, x, target


def _mean_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # Σ over an example's outputs, mean over examples: the per-example loss is the inner sum.
    return F.mse_loss(torch.tanh(out), target, reduction="sum") / out.shape[0]


def test_every_registered_type_has_a_case():
    # tuple outputs: own files
    from tests.adapters.torch.test_recurrent import RECURRENT_TYPES

    covered = {type(CASES[n][0]()) for n in CASES} | RECURRENT_TYPES | {nn.MultiheadAttention}
    assert set(registered_layer_types()) <= covered


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("strategy", ["auto", "ghost", "per_example", "generic"])
@pytest.mark.parametrize("name", list(CASES))
def test_layer_matches_explicit_loop(name, strategy, device):
    """On each device against the CPU loop in float64."""
    layer, x, target = _setup(name)
    want = loop_per_example_grads(layer, _mean_loss, (x,), target)
    f = torch.rand(B, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    layer, x, target, f = layer.to(device), x.to(device), target.to(device), f.to(device)

    engine = PerExampleGradientEngine(layer, loss_reduction="mean", strategy=strategy)
    _mean_loss(layer(x), target).backward()
    assert engine.generic_modules == (("",) if strategy == "generic" else ())
    assert_close_dicts(engine.squared_norms(), squared_norms(want))
    assert_close_dicts(engine.clipped_sum(f), weighted_sum(want, f))
    assert_close_dicts(engine.per_example_gradients(), want)


@pytest.mark.parametrize("method", ["ghost", "per_example"])
@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("conv")])
def test_conv_norm_methods(name, method):
    layer, x, target = _setup(name)
    want = squared_norms(loop_per_example_grads(layer, _mean_loss, (x,), target))
    out = layer(x)
    # the backprops of the summed loss, as the engine passes them
    (b,) = torch.autograd.grad(_mean_loss(out, target) * B, out)
    got = conv_norms(layer, (x,), b, method=method)
    assert_close_dicts({n: got[n] for n in want}, want)


@pytest.mark.parametrize("device", DEVICES)
def test_conv_norms_chunked(monkeypatch, device):
    """One example per chunk, with the budget of the device (CPU or accelerator)."""
    from dpledger.adapters.torch.layer_rules import conv

    layer, x, target = _setup("conv2d-stride")
    want = squared_norms(loop_per_example_grads(layer, _mean_loss, (x,), target))
    layer, x, target = layer.to(device), x.to(device), target.to(device)
    monkeypatch.setattr(conv, "_MAX_CHUNK_ELEMENTS", 1)
    monkeypatch.setattr(conv, "_MAX_CHUNK_ELEMENTS_ACCELERATOR", 1)
    for method in ("ghost", "per_example"):
        out = layer(x)
        (b,) = torch.autograd.grad(_mean_loss(out, target) * B, out)
        got = conv.conv_norms(layer, (x,), b, method=method)
        torch.testing.assert_close(got["weight"].cpu(), want["weight"])
        pe = conv.conv_per_example(layer, (x,), b)
        norms = pe["weight"].flatten(1).square().sum(1)
        torch.testing.assert_close(norms.cpu(), want["weight"])


def test_conv_norms_rejects_unknown_method():

    layer, x, _ = _setup("conv2d-stride")
    with pytest.raises(InvalidParameterError, match="method"):
        conv_norms(layer, (x,), layer(x), method="fast")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["ghost", "per_example"])
@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("linear")])
def test_linear_norm_methods(name, method, monkeypatch, device):
    from dpledger.adapters.torch.layer_rules import linear

    layer, x, target = _setup(name)
    want = squared_norms(loop_per_example_grads(layer, _mean_loss, (x,), target))
    layer, x, target = layer.to(device), x.to(device), target.to(device)
    for budget in (1 << 20, 1):  # one chunk, then one example per chunk
        monkeypatch.setattr(linear, "_MAX_CHUNK_ELEMENTS", budget)
        monkeypatch.setattr(linear, "_MAX_CHUNK_ELEMENTS_ACCELERATOR", budget)
        out = layer(x)
        (b,) = torch.autograd.grad(_mean_loss(out, target) * B, out)
        got = linear.linear_norms(layer, (x,), b, method=method)
        assert_close_dicts({n: got[n] for n in want}, want)
    with pytest.raises(InvalidParameterError, match="method"):
        linear.linear_norms(layer, (x,), b, method="fast")


def test_prefer_per_example_decisions():
    from dpledger.adapters.torch.layer_rules.conv import conv_prefers_per_example
    from dpledger.adapters.torch.layer_rules.linear import linear_prefers_per_example

    # Linear(64, 64): keep G_i iff T²·128 > 4096 (T >= 6) and 4096 <= T·128 (T >= 32)
    wide = nn.Linear(64, 64)
    for t, keep in ((1, False), (5, False), (31, False), (32, True), (500, True)):
        x = torch.zeros(2, t, 64)
        assert linear_prefers_per_example(wide, (x,), x) is keep
    conv1 = nn.Conv2d(1, 16, 8, 2, padding=3)  # 196 positions: materialise, G_i small: keep
    x1 = torch.zeros(2, 1, 28, 28)
    assert conv_prefers_per_example(conv1, (x1,), conv1(x1))
    conv2 = nn.Conv2d(16, 32, 4, 2)  # G_i (8192) larger than input + output (3504): fast path
    x2 = torch.zeros(2, 16, 13, 13)
    assert not conv_prefers_per_example(conv2, (x2,), conv2(x2))
