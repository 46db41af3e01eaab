"""nn.RNN, nn.GRU and nn.LSTM: per-example gradients against a float64 loop, training, refusals."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from dpledger import PrivacyLedger
from dpledger.adapters.torch import DPOptimizer, PerExampleGradientEngine, make_private
from dpledger.adapters.torch.layer_rules.recurrent import recurrent_prefers_per_example
from dpledger.errors import EngineStateError, UnsupportedLayerError
from tests.adapters.torch.dp_helpers import assert_dp_step_equals_clipped_loop
from tests.adapters.torch.reference import (
    DEVICES,
    assert_close_dicts,
    loop_per_example_grads,
    squared_norms,
    to_device,
    weighted_sum,
)

RECURRENT_TYPES = {nn.RNN, nn.GRU, nn.LSTM}
B, T, IN, H = 5, 4, 3, 4

MODES = {
    "rnn-tanh": lambda **kw: nn.RNN(IN, H, nonlinearity="tanh", **kw),
    "rnn-relu": lambda **kw: nn.RNN(IN, H, nonlinearity="relu", **kw),
    "gru": lambda **kw: nn.GRU(IN, H, **kw),
    "lstm": lambda **kw: nn.LSTM(IN, H, **kw),
}

# (num_layers, bidirectional, batch_first, bias, initial state): each option both ways, and
# the options crossed pairwise
CONFIGS = {
    "1-uni-bf-bias": (1, False, True, True, False),
    "1-uni-tf-nobias-hx": (1, False, False, False, True),
    "2-bi-bf-bias-hx": (2, True, True, True, True),
    "2-bi-tf-nobias": (2, True, False, False, False),
    "2-uni-bf-nobias-hx": (2, False, True, False, True),
    "1-bi-tf-bias": (1, True, False, True, False),
    "3-bi-tf-bias-hx": (3, True, False, True, True),
}


class Probe(nn.Module):
    """Runs a recurrent layer on batch-first inputs and returns every output, batch first.

    The optional initial state is passed batch first, (B, layers·directions, H), so that the
    model's inputs have their records along dimension 0 whatever the layer's layout; ``use``
    selects the outputs the loss sees.
    """

    def __init__(self, rnn: nn.RNNBase, use: tuple[str, ...] = ("output", "h_n", "c_n")) -> None:
        super().__init__()
        self.rnn = rnn
        self.use = use

    def forward(self, x: torch.Tensor, *state: torch.Tensor) -> torch.Tensor:
        lstm = isinstance(self.rnn, nn.LSTM)
        if not self.rnn.batch_first:
            x = x.transpose(0, 1)
        hx = None
        if state:
            # contiguous: cuDNN (CUDA) refuses a strided initial state
            hx = (
                tuple(s.transpose(0, 1).contiguous() for s in state)
                if lstm
                else state[0].transpose(0, 1).contiguous()
            )
        out, h_n = self.rnn(x, hx)
        h_n, c_n = h_n if lstm else (h_n, None)
        if not self.rnn.batch_first:
            out = out.transpose(0, 1)
        parts = {"output": out, "h_n": h_n.transpose(0, 1)}
        if c_n is not None:
            parts["c_n"] = c_n.transpose(0, 1)
        return torch.cat([parts[k].flatten(1) for k in self.use if k in parts], 1)


def _mean_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # Σ over an example's outputs, mean over examples: the per-example loss is the inner sum.
    return F.mse_loss(torch.tanh(out), target, reduction="sum") / out.shape[0]


def _setup(mode: str, config: str, *, use=("output", "h_n", "c_n"), batch: int = B):
    layers, bidirectional, batch_first, bias, with_state = CONFIGS[config]
    torch.manual_seed(sum(map(ord, mode + config)))
    rnn = MODES[mode](
        num_layers=layers, bidirectional=bidirectional, batch_first=batch_first, bias=bias
    )
    model = Probe(rnn, use).double()
    g = torch.Generator().manual_seed(7)
    inputs = [torch.randn(batch, T, IN, generator=g, dtype=torch.float64)]
    if with_state:
        states = 2 if mode == "lstm" else 1
        d = layers * (2 if bidirectional else 1)
        inputs += [
            torch.randn(batch, d, H, generator=g, dtype=torch.float64) for _ in range(states)
        ]
    target = torch.randn(model(*inputs).shape, generator=g, dtype=torch.float64)
    return model, tuple(inputs), target


def test_the_recurrent_types_are_registered_and_not_generic(caplog):
    for mode in MODES:
        model, _, _ = _setup(mode, "2-bi-bf-bias-hx")
        with caplog.at_level(logging.WARNING, logger="dpledger.adapters.torch.engine"):
            engine = PerExampleGradientEngine(model, loss_reduction="mean")
        assert engine.generic_modules == ()
        assert "generic" not in caplog.text


@pytest.mark.parametrize("strategy", ["auto", "ghost", "per_example"])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("device", DEVICES)
def test_per_example_quantities_match_a_float64_loop(device, mode, config, strategy):
    """On each device (cuDNN's recurrent kernels on CUDA) against the CPU loop in float64."""
    model, inputs, target = _setup(mode, config)
    want = loop_per_example_grads(model, _mean_loss, inputs, target)
    f = torch.rand(B, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    model = model.to(device)
    inputs, target, f = to_device((inputs, target, f), device)

    engine = PerExampleGradientEngine(model, loss_reduction="mean", strategy=strategy)
    _mean_loss(model(*inputs), target).backward()
    assert_close_dicts(engine.squared_norms(), squared_norms(want))
    assert_close_dicts(engine.clipped_sum(f), weighted_sum(want, f))
    assert_close_dicts(engine.per_example_gradients(), want)


@pytest.mark.parametrize("use", [("output",), ("h_n",), ("c_n",), ("h_n", "c_n")])
@pytest.mark.parametrize("mode", ["gru", "lstm"])
def test_outputs_without_gradient(mode, use):
    if mode == "gru" and "c_n" in use:
        use = ("h_n",) if use == ("c_n",) else ("output", "h_n")
    model, inputs, target = _setup(mode, "2-bi-tf-nobias", use=use)
    want = loop_per_example_grads(model, _mean_loss, inputs, target)
    engine = PerExampleGradientEngine(model, loss_reduction="mean")
    _mean_loss(model(*inputs), target).backward()
    assert_close_dicts(engine.squared_norms(), squared_norms(want))
    assert_close_dicts(engine.per_example_gradients(), want)


@pytest.mark.parametrize("mode", list(MODES))
def test_direct_backward_and_sum_reduction(mode):
    model, inputs, target = _setup(mode, "3-bi-tf-bias-hx")
    want = loop_per_example_grads(model, _mean_loss, inputs, target)
    f = torch.rand(B, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    engine = PerExampleGradientEngine(model, loss_reduction="sum", check_steps=0)
    engine.backward(_mean_loss(model(*inputs), target) * B)
    assert all(p.grad is None for p in model.parameters())
    assert_close_dicts(engine.squared_norms(), squared_norms(want))
    assert_close_dicts(engine.clipped_sum(f), weighted_sum(want, f))


class TwoCalls(nn.Module):
    """One LSTM used twice in a forward (its per-example gradients are the sum of both uses)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(IN, H, num_layers=2, batch_first=True)
        self.head = nn.Linear(H, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, (h, c) = self.rnn(x)
        again, _ = self.rnn(x.flip(1), (h, c))
        return self.head(out + again)


def test_a_layer_called_twice_and_partly_frozen():
    torch.manual_seed(0)
    model = TwoCalls().double()
    model.rnn.weight_hh_l1.requires_grad_(False)
    model.rnn.bias_ih_l0.requires_grad_(False)
    x = torch.randn(B, T, IN, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    target = torch.randn(B, T, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    want = loop_per_example_grads(model, _mean_loss, (x,), target)
    assert "rnn.weight_hh_l1" not in want
    f = torch.rand(B, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    engine = PerExampleGradientEngine(model, loss_reduction="mean")
    _mean_loss(model(x), target).backward()
    assert_close_dicts(engine.squared_norms(), squared_norms(want))
    assert_close_dicts(engine.clipped_sum(f), weighted_sum(want, f))
    assert_close_dicts(engine.per_example_gradients(), want)


class Seq2Seq(nn.Module):
    """An encoder GRU whose h_n is the decoder LSTM's initial state (gradient flows into it)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.GRU(IN, H, num_layers=2, bidirectional=True)
        self.bridge = nn.Linear(H, H)
        self.decoder = nn.LSTM(IN, H, num_layers=2, batch_first=True)
        self.head = nn.Linear(H, 2)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        _, h = self.encoder(src.transpose(0, 1))  # time-major inside the model
        h = h.view(2, 2, *h.shape[1:]).sum(1).transpose(0, 1)  # (B, layers, H)
        h0 = torch.tanh(self.bridge(h)).transpose(0, 1).contiguous()
        out, _ = self.decoder(tgt, (h0, torch.zeros_like(h0)))
        return self.head(out)


def test_an_initial_state_computed_by_other_layers():
    torch.manual_seed(0)
    model = Seq2Seq().double()
    g = torch.Generator().manual_seed(1)
    src = torch.randn(B, T + 1, IN, generator=g, dtype=torch.float64)
    tgt = torch.randn(B, T, IN, generator=g, dtype=torch.float64)
    target = torch.randn(B, T, 2, generator=g, dtype=torch.float64)
    want = loop_per_example_grads(model, _mean_loss, (src, tgt), target)
    f = torch.rand(B, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    engine = PerExampleGradientEngine(model, loss_reduction="mean")
    _mean_loss(model(src, tgt), target).backward()
    assert engine.generic_modules == ()
    assert_close_dicts(engine.squared_norms(), squared_norms(want))
    assert_close_dicts(engine.clipped_sum(f), weighted_sum(want, f))


def test_empty_batch_gives_zeros():
    model, inputs, target = _setup("lstm", "2-bi-bf-bias-hx", batch=0)
    engine = PerExampleGradientEngine(model, loss_reduction="sum")
    _mean_loss(model(*inputs), target).backward()
    assert engine.batch_size == 0
    for n, v in engine.squared_norms().items():
        assert v.shape == (0,), n


def test_float32_and_autocast_compute_in_float32():
    model64, inputs, target = _setup("lstm", "2-bi-tf-nobias")
    want = squared_norms(loop_per_example_grads(model64, _mean_loss, inputs, target))
    model = Probe(nn.LSTM(IN, H, num_layers=2, bidirectional=True, bias=False))
    model.load_state_dict({k: v.float() for k, v in model64.state_dict().items()})
    engine = PerExampleGradientEngine(model, loss_reduction="mean")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(*(t.float() for t in inputs))
    assert out.dtype == torch.bfloat16
    _mean_loss(out.float(), target.float()).backward()
    norms = engine.squared_norms()
    for n, v in norms.items():
        assert v.dtype == torch.float32, n
        # the step's activations and output gradients are bfloat16 (8 significant bits, relative
        # rounding 2^-8 ≈ 0.004 per value), so the norms agree to a few percent, not to float32
        torch.testing.assert_close(v.double(), want[n], rtol=0.05, atol=1e-6)


def test_prefer_per_example_uses_the_linear_criterion():
    # every affine map: d_out = 4·64; keep G_i iff T²(d_in + d_out) > d_in·d_out and
    # d_in·d_out <= T(d_in + d_out)
    lstm = nn.LSTM(64, 64, batch_first=True)
    for t, keep in ((1, False), (40, False), (52, True), (400, True)):
        x = torch.zeros(2, t, 64)
        assert recurrent_prefers_per_example(lstm, (x,), (x,)) is keep


# ---------------------------------------------------------------- training end to end


class Classifier(nn.Module):
    """Embedding → LSTM → Linear on the last hidden state."""

    def __init__(self, vocab: int = 11, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 6)
        self.lstm = nn.LSTM(6, 5, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(10, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(tokens))
        return self.head(out[:, -1])


def _tokens(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 11, (n, 7), generator=g), torch.randint(0, 3, (n,), generator=g)


def test_dp_optimizer_step_equals_a_clipped_per_example_loop():
    x, y = _tokens(9)
    assert_dp_step_equals_clipped_loop(Classifier, x, y)


def test_make_private_trains_an_lstm_classifier_with_a_ledger():
    from torch.utils.data import TensorDataset

    data = TensorDataset(*_tokens(60, seed=3))
    torch.manual_seed(0)
    model = Classifier()
    ledger = PrivacyLedger()
    model, dp, loader = make_private(
        model,
        torch.optim.Adam(model.parameters(), lr=0.01),
        data,
        sampling_probability=0.2,
        l2_norm_bound=1.0,
        noise_multiplier=1.0,
        ledger=ledger,
        seed=0,
    )
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        for x, y in loader:
            dp.zero_grad()
            F.cross_entropy(model(x), y).backward()
            dp.step()
    assert ledger.num_steps == 2 * len(loader) == 10
    for p, p0 in zip(model.parameters(), before, strict=True):
        assert torch.isfinite(p).all() and not torch.equal(p, p0)


# ---------------------------------------------------------------- refusals


def test_projections_are_refused_at_construction():
    torch.manual_seed(0)
    model = Probe(nn.LSTM(IN, H, proj_size=2, batch_first=True))
    with pytest.raises(UnsupportedLayerError, match="proj_size"):
        PerExampleGradientEngine(model, loss_reduction="mean")


def test_inter_layer_dropout_in_training_is_refused():
    torch.manual_seed(0)
    rnn = nn.GRU(IN, H, num_layers=2, dropout=0.3, batch_first=True)
    with pytest.raises(UnsupportedLayerError, match=r"nn\.Dropout between them"):
        PerExampleGradientEngine(Probe(rnn), loss_reduction="mean")
    model = Probe(rnn).eval()  # evaluation mode: no dropout, accepted
    engine = PerExampleGradientEngine(model, loss_reduction="mean")
    x = torch.randn(B, T, IN, generator=torch.Generator().manual_seed(1))
    model(x).sum().backward()
    assert engine.squared_norms()["rnn.weight_ih_l0"].shape == (B,)
    model.train()  # switched to training after construction: refused at the forward
    with pytest.raises(UnsupportedLayerError, match=r"dropout=0\.3"):
        model(x)
    assert not engine.has_gradients
    with pytest.raises(EngineStateError):
        engine.squared_norms()


def test_single_layer_dropout_is_accepted():
    with pytest.warns(UserWarning, match="dropout"):
        torch.manual_seed(0)
        rnn = nn.RNN(IN, H, num_layers=1, dropout=0.5, batch_first=True)
    model = Probe(rnn)  # torch applies no dropout after the last layer
    engine = PerExampleGradientEngine(model, loss_reduction="sum")
    model(torch.randn(B, T, IN, generator=torch.Generator().manual_seed(1))).sum().backward()
    assert engine.squared_norms()["rnn.weight_hh_l0"].shape == (B,)


class Inputs(nn.Module):
    """An LSTM given a padded batch, a PackedSequence, or one sequence without a batch dim."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(IN, H, batch_first=True)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor | None = None, how: str = "padded"):
        if how == "packed":
            packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
            return self.rnn(packed)[1][0][0]
        if how == "unbatched":
            return self.rnn(x[0])[0]
        return self.rnn(x)[0]


def test_packed_and_unbatched_inputs_are_refused_before_anything_is_recorded():
    torch.manual_seed(0)
    model = Inputs()
    engine = PerExampleGradientEngine(model, loss_reduction="sum")
    x = torch.randn(B, T, IN, generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([4, 2, 3, 1, 4])
    with pytest.raises(UnsupportedLayerError, match="PackedSequence"):
        model(x, lengths, how="packed")
    assert not engine.has_gradients
    with pytest.raises(UnsupportedLayerError, match="batched input"):
        model(x, how="unbatched")
    assert not engine.has_gradients
    with torch.no_grad():  # nothing is recorded without gradients: not refused
        model(x, lengths, how="packed")
    model(x).sum().backward()  # a valid call still works
    assert engine.squared_norms()["rnn.weight_ih_l0"].shape == (B,)


class Keywords(nn.Module):
    """The initial state passed by keyword (the engine binds it to the positional arguments)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(IN, H, batch_first=True)

    def forward(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        hx = (h.transpose(0, 1).contiguous(), c.transpose(0, 1).contiguous())
        return self.rnn(input=x, hx=hx)[0]


def test_arguments_passed_by_keyword():
    torch.manual_seed(0)
    model = Keywords().double()
    g = torch.Generator().manual_seed(1)
    inputs = (
        torch.randn(B, T, IN, generator=g, dtype=torch.float64),
        torch.randn(B, 1, H, generator=g, dtype=torch.float64),
        torch.randn(B, 1, H, generator=g, dtype=torch.float64),
    )
    target = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    want = loop_per_example_grads(model, _mean_loss, inputs, target)
    engine = PerExampleGradientEngine(model, loss_reduction="mean")
    _mean_loss(model(*inputs), target).backward()
    assert_close_dicts(engine.per_example_gradients(), want)


@pytest.mark.parametrize(("name", "plain"), [("DPLSTM", nn.LSTM), ("DPGRU", nn.GRU)])
def test_opacus_recurrent_layers_are_refused_naming_the_torch_layer_to_use(name, plain):
    layers = pytest.importorskip("opacus.layers")

    class Net(nn.Module):
        def __init__(self, recurrent):
            super().__init__()
            self.rnn = recurrent
            self.head = nn.Linear(6, 3)

        def forward(self, x):
            return self.head(self.rnn(x)[0][:, -1])

    torch.manual_seed(0)
    opacus_layer = getattr(layers, name)(4, 6, batch_first=True)
    model = Net(opacus_layer)
    dp_args = {
        "l2_norm_bound": 1.0,
        "noise_multiplier": 1.0,
        "sampling_probability": 0.1,
        "population_size": 100,
        "seed": 0,
    }
    with pytest.raises(UnsupportedLayerError) as info:
        DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, **dp_args)
    message = str(info.value)
    assert f"'rnn' is Opacus's {name}" in message
    assert f"Use torch.nn.{plain.__name__} with the same arguments" in message
    assert (info.value.layer_name, info.value.layer_type) == ("rnn", name)
    # the suggested layer loads the Opacus layer's weights and trains
    model.rnn = plain(4, 6, batch_first=True)
    model.rnn.load_state_dict(opacus_layer.state_dict())
    ledger = PrivacyLedger()
    dp = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model=model, ledger=ledger, **dp_args
    )
    F.cross_entropy(model(torch.randn(5, 7, 4)), torch.randint(0, 3, (5,))).backward()
    dp.step()
    assert ledger.num_steps == 1
