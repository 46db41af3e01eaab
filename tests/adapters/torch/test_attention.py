"""nn.MultiheadAttention: per-example gradients against a float64 loop, training, fallbacks."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from dpledger.adapters.torch import PerExampleGradientEngine
from dpledger.adapters.torch.layer_rules.attention import attention_prefers_per_example
from dpledger.errors import UnsupportedLayerError
from tests.adapters.torch.dp_helpers import assert_dp_step_equals_clipped_loop
from tests.adapters.torch.reference import (
    DEVICES,
    assert_close_dicts,
    loop_per_example_grads,
    squared_norms,
    to_device,
    weighted_sum,
)

B, L, S, E, HEADS = 5, 4, 6, 8, 2


class Probe(nn.Module):
    """One attention layer on batch-first inputs, returning what the loss sees, batch first.

    ``cross``: keys and values come from a second input of other widths (separate projection
    weights); ``padding``: a boolean key padding mask is a model input (one row per record);
    ``mask``: "float" (additive), "bool" or "causal" (``is_causal`` with its mask), shared by
    the records; ``use_weights``: the attention weights enter the loss too; ``keywords``: every
    option is passed by keyword, else positionally.
    """

    def __init__(
        self,
        *,
        batch_first: bool = True,
        bias: bool = True,
        cross: bool = False,
        padding: bool = False,
        mask: str | None = None,
        use_weights: bool = False,
        average: bool = True,
        keywords: bool = True,
    ) -> None:
        super().__init__()
        kv = {"kdim": 5, "vdim": 3} if cross else {}
        self.mha = nn.MultiheadAttention(E, HEADS, bias=bias, batch_first=batch_first, **kv)
        self.cross, self.padding, self.use_weights = cross, padding, use_weights
        self.average, self.keywords, self.mask_kind = average, keywords, mask
        length = S if cross else L
        g = torch.Generator().manual_seed(3)
        if mask == "float":
            self.register_buffer("attn_mask", torch.randn(L, length, generator=g))
        elif mask in ("bool", "causal"):
            m = torch.ones(L, length).triu(1).bool()
            self.register_buffer("attn_mask", m)
        else:
            self.attn_mask = None

    def forward(self, x: torch.Tensor, *more: torch.Tensor) -> torch.Tensor:
        rest = list(more)
        key = value = x
        if self.cross:
            key, value = rest.pop(0), rest.pop(0)
        padding = rest.pop(0) if self.padding else None
        query = x
        if not self.mha.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        options = {
            "key_padding_mask": padding,
            "need_weights": self.use_weights,
            "attn_mask": self.attn_mask,
            "average_attn_weights": self.average,
            "is_causal": self.mask_kind == "causal",
        }
        if self.keywords:
            kw = {k: v for k, v in options.items() if v is not None}
            out, weights = self.mha(query, key, value, **kw)
        else:
            out, weights = self.mha(query, key, value, *options.values())
        if not self.mha.batch_first:
            out = out.transpose(0, 1)
        parts = [out.flatten(1)]
        if self.use_weights:
            parts.append(weights.flatten(1))
        return torch.cat(parts, 1)


CONFIGS = {
    "self-bf": {},
    "self-tf-positional": {"batch_first": False, "keywords": False},
    "nobias-float-mask": {"bias": False, "mask": "float"},
    "cross-padding": {"cross": True, "padding": True},
    "cross-tf-bool-mask": {"cross": True, "batch_first": False, "mask": "bool"},
    "causal-weights": {"mask": "causal", "use_weights": True},
    "weights-per-head-padding": {"use_weights": True, "average": False, "padding": True},
}


def _mean_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(torch.tanh(out), target, reduction="sum") / out.shape[0]


def _setup(config: str, *, batch: int = B):
    options = CONFIGS[config]
    torch.manual_seed(sum(map(ord, config)))
    model = Probe(**options).double()
    g = torch.Generator().manual_seed(7)
    inputs = [torch.randn(batch, L, E, generator=g, dtype=torch.float64)]
    if options.get("cross"):
        inputs.append(torch.randn(batch, S, 5, generator=g, dtype=torch.float64))
        inputs.append(torch.randn(batch, S, 3, generator=g, dtype=torch.float64))
    if options.get("padding"):
        length = S if options.get("cross") else L
        pad = torch.rand(batch, length, generator=g) < 0.4
        pad[:, 0] = False  # every record attends to something
        inputs.append(pad)
    target = torch.randn(model(*inputs).shape, generator=g, dtype=torch.float64)
    return model, tuple(inputs), target


def test_attention_is_registered_and_not_generic(caplog):
    model, _, _ = _setup("cross-padding")
    with caplog.at_level(logging.WARNING, logger="dpledger.adapters.torch.engine"):
        engine = PerExampleGradientEngine(model, loss_reduction="mean")
    assert engine.generic_modules == ()
    assert "generic" not in caplog.text


@pytest.mark.parametrize("strategy", ["auto", "ghost", "per_example"])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("device", DEVICES)
def test_per_example_quantities_match_a_float64_loop(device, config, strategy):
    """On each device against the CPU loop in float64."""
    model, inputs, target = _setup(config)
    want = loop_per_example_grads(model, _mean_loss, inputs, target)
    f = torch.rand(B, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    model = model.to(device)
    inputs, target, f = to_device((inputs, target, f), device)

    engine = PerExampleGradientEngine(model, loss_reduction="mean", strategy=strategy)
    _mean_loss(model(*inputs), target).backward()
    assert_close_dicts(engine.squared_norms(), squared_norms(want))
    assert_close_dicts(engine.clipped_sum(f), weighted_sum(want, f))
    assert_close_dicts(engine.per_example_gradients(), want)


def test_a_partly_frozen_layer_and_an_unused_output():
    model, inputs, target = _setup("self-bf")
    model.mha.in_proj_weight.requires_grad_(False)
    model.mha.out_proj.bias.requires_grad_(False)
    want = loop_per_example_grads(model, _mean_loss, inputs, target)
    assert set(want) == {"mha.in_proj_bias", "mha.out_proj.weight"}
    engine = PerExampleGradientEngine(model, loss_reduction="mean", strategy="ghost")
    _mean_loss(model(*inputs), target).backward()
    assert_close_dicts(engine.squared_norms(), squared_norms(want))
    f = torch.linspace(0.1, 1.0, B, dtype=torch.float64)
    assert_close_dicts(engine.clipped_sum(f), weighted_sum(want, f))


@pytest.mark.parametrize(
    "options",
    [{"dropout": 0.1}, {"add_bias_kv": True}, {"add_zero_attn": True}],
    ids=["dropout", "bias_kv", "zero_attn"],
)
def test_configurations_the_recomputation_does_not_reproduce_take_the_generic_path(options):
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("mha", nn.MultiheadAttention(E, HEADS, batch_first=True, **options))
    engine = PerExampleGradientEngine(model, loss_reduction="mean")
    assert engine.generic_modules == ("mha",)


def test_dropout_on_the_generic_path_still_matches_a_loop_with_the_same_masks():
    """With dropout the layer is exact on the generic path, which replays its random draws."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = nn.MultiheadAttention(E, HEADS, dropout=0.3, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mha(x, x, x, need_weights=False)[0].flatten(1)

    torch.manual_seed(0)
    model = Net().double()
    x = torch.randn(1, L, E, dtype=torch.float64)
    target = torch.randn(1, L * E, dtype=torch.float64)
    torch.manual_seed(11)
    want = loop_per_example_grads(model, _mean_loss, (x,), target)
    engine = PerExampleGradientEngine(model, loss_reduction="mean")
    torch.manual_seed(11)
    _mean_loss(model(x), target).backward()
    assert_close_dicts(engine.per_example_gradients(), want)


def test_unbatched_inputs_are_refused():
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("mha", nn.MultiheadAttention(E, HEADS))
    engine = PerExampleGradientEngine(model, loss_reduction="mean")
    x = torch.randn(L, E)
    with pytest.raises(UnsupportedLayerError, match="batched inputs"):
        model.mha(x, x, x)
    assert not engine.has_gradients


def test_prefer_per_example_uses_the_linear_criterion():
    # keep G_i iff T²(d_in + d_out) > d_in·d_out and d_in·d_out <= T(d_in + d_out), for all four
    # maps: with E = 8 that is T >= 4 for the query and output maps (d_in = d_out = 8)
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, HEADS, batch_first=True)
    for positions, keep in ((1, False), (3, False), (4, True), (64, True)):
        x = (torch.randn(B, positions, E),) * 3
        assert attention_prefers_per_example(mha, x, ()) is keep, positions
    # cross attention: keys and values of width 5 and 3 at S = 64 positions, queries at L = 4
    cross = nn.MultiheadAttention(E, HEADS, batch_first=True, kdim=5, vdim=3)
    q, kv = torch.randn(B, 4, E), torch.randn(B, 64, 5)
    assert attention_prefers_per_example(cross, (q, kv, kv[..., :3]), ()) is True
    q1 = torch.randn(B, 1, E)
    assert attention_prefers_per_example(cross, (q1, kv, kv[..., :3]), ()) is False


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, E)
        self.mha = nn.MultiheadAttention(E, HEADS, batch_first=True)
        self.head = nn.Linear(E, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.mha(h, h, h, need_weights=False)[0]
        return self.head(h.mean(1))


def test_dp_optimizer_step_equals_a_clipped_per_example_loop():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 11, (9, 7), generator=g), torch.randint(0, 3, (9,), generator=g)
    dp = assert_dp_step_equals_clipped_loop(Classifier, x, y)
    assert dp.engine.generic_modules == ()


def test_float32_under_autocast_computes_in_float32():
    model64, inputs, target = _setup("cross-padding")
    want = squared_norms(loop_per_example_grads(model64, _mean_loss, inputs, target))
    model = Probe(cross=True, padding=True)
    model.load_state_dict({k: v.float() for k, v in model64.state_dict().items()})
    engine = PerExampleGradientEngine(model, loss_reduction="mean")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(*(t.float() if t.is_floating_point() else t for t in inputs))
    assert out.dtype == torch.bfloat16
    _mean_loss(out.float(), target.float()).backward()
    norms = engine.squared_norms()
    assert list(norms) == list(want)
    for n, v in norms.items():
        assert v.dtype == torch.float32, n
        # the step's activations and output gradients are bfloat16 (8 significant bits, relative
        # rounding 2^-8 ≈ 0.004 per value), so the norms agree to a few percent, not to float32
        torch.testing.assert_close(v.double(), want[n], rtol=0.05, atol=1e-6)
