"""Hugging Face models (built from configs, random init) on the engine's fast path.

Every family is checked against a per-example loop in float64 (each record alone through the
same model): squared norms, a clipped sum with random factors and the per-example gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

transformers = pytest.importorskip("transformers", reason="dpledger[hf] is not installed")
peft = pytest.importorskip("peft", reason="dpledger[hf] is not installed")

from dpledger.adapters.torch import PerExampleGradientEngine  # noqa: E402
from dpledger.adapters.torch.layer_rules.hugging_face import (  # noqa: E402
    llama_rms_norm_per_example,
)
from dpledger.adapters.torch.registry import layer_rule  # noqa: E402
from tests.adapters.torch.reference import (  # noqa: E402
    DEVICES,
    assert_close_dicts,
    squared_norms,
    to_device,
    weighted_sum,
)

B, T, VOCAB = 4, 6, 50
NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def _bert(**overrides):
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=3,
        **{**NO_DROPOUT, **overrides},
    )
    return transformers.BertForSequenceClassification(config)


def _gpt2(**overrides):
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=16,
        n_layer=2,
        n_head=2,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
        **{"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, **overrides},
    )
    return transformers.GPT2LMHeadModel(config)


def _llama():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        intermediate_size=32,
        max_position_embeddings=16,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config)


def _vit(**overrides):
    config = transformers.ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=3,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=3,
        **{**NO_DROPOUT, **overrides},
    )
    return transformers.ViTForImageClassification(config)


def _classify(model, x, y):
    return F.cross_entropy(model(**x).logits, y)


def _lm(model, x, y):
    logits = model(**x).logits[:, :-1]
    per_token = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), y[:, 1:].reshape(-1), reduction="none"
    )
    return per_token.view(y.shape[0], -1).mean(1).mean()


def _ids(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (B, T), generator=g)


FAMILIES = {
    "bert": (_bert, lambda: {"input_ids": _ids(1)}, lambda: torch.tensor([0, 2, 1, 2]), _classify),
    "gpt2": (_gpt2, lambda: {"input_ids": _ids(2)}, lambda: _ids(2), _lm),
    "llama": (_llama, lambda: {"input_ids": _ids(3)}, lambda: _ids(3), _lm),
    "vit": (
        _vit,
        lambda: {"pixel_values": torch.randn(B, 3, 8, 8, dtype=torch.float64)},
        lambda: torch.tensor([1, 0, 2, 2]),
        _classify,
    ),
}


def _one(x, i):
    return {k: v[i : i + 1] for k, v in x.items()}


def _loop(model, loss, x, y):
    """g_i of every trainable parameter, record i alone through the model (batch of one)."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    rows = []
    for i in range(y.shape[0]):
        grads = torch.autograd.grad(
            loss(model, _one(x, i), y[i : i + 1]), list(params.values()), allow_unused=True
        )
        rows.append(
            [
                torch.zeros_like(p) if g is None else g
                for p, g in zip(params.values(), grads, strict=True)
            ]
        )
    return {n: torch.stack([r[k] for r in rows]) for k, n in enumerate(params)}


def _check_against_loop(model, loss, x, y, expected_generic=(), device="cpu"):
    """The engine on ``device`` against the loop on the CPU."""
    want = _loop(model, loss, x, y)
    f = torch.rand(B, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    model = model.to(device)
    x, y, f = to_device((x, y, f), device)
    engine = PerExampleGradientEngine(model, loss_reduction="mean")
    assert engine.generic_modules == expected_generic
    loss(model, x, y).backward()
    assert_close_dicts(engine.squared_norms(), squared_norms(want))
    assert_close_dicts(engine.clipped_sum(f), weighted_sum(want, f))
    assert_close_dicts(engine.per_example_gradients(), want)
    engine.remove()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_a_per_example_loop_in_float64(family, device):
    build, inputs, targets, loss = FAMILIES[family]
    torch.manual_seed(0)
    model = build().double().train()
    # ViT's embeddings own the class token and position embeddings: only that module takes
    # the generic path (for those two tensors); its patch convolution keeps the fast path.
    generic = ("vit.embeddings",) if family == "vit" else ()
    _check_against_loop(model, loss, inputs(), targets(), generic, device)


def test_gpt2_registers_conv1d_and_ties_lm_head_to_the_token_embedding():
    model = _gpt2().double()
    assert model.lm_head.weight is model.transformer.wte.weight
    conv1d = type(model.transformer.h[0].attn.c_attn)
    assert layer_rule(conv1d) is not None and layer_rule(conv1d).has_fast_path
    engine = PerExampleGradientEngine(model, loss_reduction="mean")
    assert "transformer.wte.weight" in engine.parameter_names
    assert "lm_head.weight" not in engine.parameter_names  # one tensor, one name
    x, y = {"input_ids": _ids(7)}, _ids(7)
    _lm(model, x, y).backward()
    got = engine.squared_norms()["transformer.wte.weight"]
    # The tied weight keeps both layers' ghost norms (plus their cross term): no (B, V, d)
    # per-example gradient is materialised for it.
    assert "transformer.wte.weight" not in engine._state.per_example
    assert {u.name for u, _ in engine._state.ghost} >= {"transformer.wte", "lm_head"}
    engine.remove()
    want = _loop(model, _lm, x, y)["transformer.wte.weight"]
    torch.testing.assert_close(got, want.flatten(1).square().sum(1))


def test_a_tied_weight_norm_in_float32_is_never_understated():
    # ‖E_i + L_i‖² from ‖E_i‖² + ‖L_i‖² + 2⟨E_i, L_i⟩: the two norms' rounding is relative to
    # them, not to the total, so the engine adds their margin; checked against float64.
    torch.manual_seed(3)
    model = _gpt2()
    reference = _gpt2().double()
    reference.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    x, y = {"input_ids": _ids(8)}, _ids(8)
    engine = PerExampleGradientEngine(model, loss_reduction="mean")
    _lm(model, x, y).backward()
    got = engine.squared_norms()["transformer.wte.weight"]
    want = _loop(reference, _lm, x, y)["transformer.wte.weight"].flatten(1).square().sum(1)
    assert (got >= want).all()
    torch.testing.assert_close(got, want, rtol=2e-3, atol=0.0)


def test_llama_style_rms_norms_are_recognised_by_their_forward():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm

    assert layer_rule(LlamaRMSNorm) is not None
    assert layer_rule(MistralRMSNorm) is not None  # the same forward, another name

    class ShiftedRMSNorm(LlamaRMSNorm):  # a forward of its own: not Llama's
        def forward(self, hidden_states):
            return super().forward(hidden_states) + 1.0

    ShiftedRMSNorm.__module__ = "transformers.models.custom.modeling_custom"
    assert layer_rule(ShiftedRMSNorm) is None
    # The registered rule against autograd on a single module, one record at a time.
    norm = LlamaRMSNorm(5, eps=1e-5).double()
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 5))
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    b = torch.randn(3, 4, 5, dtype=torch.float64)
    got = llama_rms_norm_per_example(norm, (x,), b)["weight"]
    for i in range(3):
        (want,) = torch.autograd.grad(norm(x[i : i + 1]), norm.weight, b[i : i + 1])
        torch.testing.assert_close(got[i], want)


def test_broadcast_one_row_output_gets_per_record_gradients():
    # The pattern of every HF model with position ids of shape (1, T): a unit that never sees
    # the batch, whose one-row output the model broadcasts over the records.
    class Positions(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(VOCAB, 8)
            self.pos = nn.Embedding(T, 8)
            self.head = nn.Linear(8, 3)

        def forward(self, ids):
            pos = self.pos(torch.arange(ids.shape[1]).unsqueeze(0))  # (1, T, 8)
            return self.head(torch.tanh(self.tok(ids) + pos).mean(1))

    torch.manual_seed(0)
    model = Positions().double()
    x, y = {"ids": _ids(4)}, torch.tensor([0, 1, 2, 1])

    def loss(m, xx, yy):
        return F.cross_entropy(m(**xx), yy)

    _check_against_loop(model, loss, x, y)


def test_peft_lora_trains_only_the_adapters_on_the_fast_path():
    torch.manual_seed(0)
    base = _llama().double()
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(base, lora)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    with torch.no_grad():  # LoRA's B starts at zero: move it so every gradient is non-trivial
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    x, y = {"input_ids": _ids(5)}, _ids(5)
    _check_against_loop(model, _lm, x, y)


@pytest.mark.parametrize("family", ["bert", "vit"])
def test_dropout_in_training_uses_the_batch_masks(family):
    # BERT's dropout sits between units (fast path); ViT's embeddings draw their dropout
    # inside a generic unit, whose per-example re-run replays the batch's masks.
    build, inputs, targets, loss = FAMILIES[family]
    torch.manual_seed(0)
    model = build(hidden_dropout_prob=0.3).double().train()
    x, y = inputs(), targets()
    torch.manual_seed(21)  # the reference: one batch forward, then one backward per record
    losses = F.cross_entropy(model(**x).logits, y, reduction="none")
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    rows = [
        torch.autograd.grad(losses[i], list(params.values()), retain_graph=True, allow_unused=True)
        for i in range(B)
    ]
    want = {
        n: torch.stack([torch.zeros_like(p) if r[k] is None else r[k] for r in rows])
        for k, (n, p) in enumerate(params.items())
    }
    engine = PerExampleGradientEngine(model, loss_reduction="mean")
    torch.manual_seed(21)
    loss(model, x, y).backward()
    assert_close_dicts(engine.per_example_gradients(), want)


@pytest.mark.parametrize("device", DEVICES)
def test_gpt2_under_bf16_autocast_keeps_the_clip_bound(device):
    # Under autocast the stored activations and output gradients are bfloat16; per-example
    # norms and the clipped sum are formed in float32 from those same values, so clipping to
    # C(1 - ρ) with the float32 margin bounds every contribution by C (checked in float64).
    # On CUDA, autocast runs the matrix products in bfloat16 on the tensor cores.
    from dpledger.mechanisms.clipping import rounding_clip_margin

    torch.manual_seed(0)
    model = _gpt2().train().to(device)
    x, y = to_device(({"input_ids": _ids(6)}, _ids(6)), device)
    engine = PerExampleGradientEngine(model, loss_reduction="mean")
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = _lm(model, x, y)
    loss.backward()  # the consistency check (Σ g_i against autograd) runs on this step
    c = 1e-3  # far below every record's norm: every record is clipped
    margin = rounding_clip_margin(torch.finfo(torch.float32).eps)
    total = sum(v.to(torch.float64) for v in engine.squared_norms().values()).sqrt()
    assert (total > c).all()
    f = (c * (1 - margin) / total).clamp(max=1.0)
    sums = engine.clipped_sum(f)
    assert all(v.dtype == torch.float32 and v.isfinite().all() for v in sums.values())
    per_example = {n: g.to(torch.float64) for n, g in engine.per_example_gradients().items()}
    contribution = sum(
        (f.view(-1, *[1] * (g.dim() - 1)) * g).flatten(1).square().sum(1)
        for g in per_example.values()
    ).sqrt()
    assert (contribution <= c).all()
    released = sum(v.to(torch.float64).square().sum() for v in sums.values()).sqrt()
    assert released <= B * c
