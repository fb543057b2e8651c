"""LLaMA model: published sizes, RoPE, attention, initialisation."""

import math

import pytest
import torch
import torch.nn.functional as F

from dtrain.models import build, llama, model_args
from dtrain.models.llama import (
    Attention,
    RopeScaling,
    Transformer,
    apply_rope,
    rope_cache,
    rope_frequencies,
)


@pytest.mark.parametrize("name, published, rel", [
    # Published counts are rounded to the digits shown; the tolerance is half a unit of the last.
    ("llama3_1b", 1.24e9, 0.005 / 1.24),
    ("llama3_3b", 3.21e9, 0.005 / 3.21),
    ("llama3_8b", 8.03e9, 0.005 / 8.03),
    ("llama3_70b", 70.6e9, 0.05 / 70.6),
    ("llama3_405b", 405.9e9, 0.05 / 405.9),
    ("llama2_7b", 6.74e9, 0.005 / 6.74),
    ("llama2_13b", 13.0e9, 0.05 / 13.0),
])
def test_preset_parameter_count_matches_published(name, published, rel):
    model = build(name, device="meta")
    assert model.num_params() == pytest.approx(published, rel=rel)


def test_llama3_8b_shapes():
    args = model_args("llama3_8b")
    assert (args.ffn_dim, args.head_dim, args.kv_heads) == (14336, 128, 8)


def test_rope_frequencies_without_scaling_follow_the_formula():
    freqs = rope_frequencies(128, 500000.0, None)
    expected = [500000.0 ** (-2 * i / 128) for i in range(64)]
    assert torch.allclose(freqs, torch.tensor(expected, dtype=torch.float64), rtol=1e-12)


def test_rope_llama31_scaling_against_direct_formula():
    scaling = RopeScaling(factor=8, low_freq_factor=1, high_freq_factor=4,
                          original_max_seq_len=8192)
    got = rope_frequencies(128, 500000.0, scaling)
    for i, f in enumerate(500000.0 ** (-2 * i / 128) for i in range(64)):
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4:
            want = f
        elif wavelen > 8192 / 1:
            want = f / 8
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            want = (1 - smooth) * f / 8 + smooth * f
        assert got[i].item() == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("compiling", [False, True], ids=["complex", "real"])
def test_apply_rope_rotates_each_pair_by_position_times_frequency(compiling, monkeypatch):
    # Under torch.compile the rotation runs in real arithmetic; both paths are checked eagerly.
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    head_dim, theta = 8, 10000.0
    x = torch.randn(1, 5, 2, head_dim, dtype=torch.float64)
    out = apply_rope(x, rope_cache(16, head_dim, theta, None))
    for pos in range(5):
        for i in range(head_dim // 2):
            angle = pos * theta ** (-2 * i / head_dim)
            a, b = x[0, pos, :, 2 * i], x[0, pos, :, 2 * i + 1]
            # float32 cache: cos/sin carry float32 rounding
            assert torch.allclose(out[0, pos, :, 2 * i], a * math.cos(angle) - b * math.sin(angle),
                                  atol=1e-6)
            assert torch.allclose(out[0, pos, :, 2 * i + 1],
                                  a * math.sin(angle) + b * math.cos(angle), atol=1e-6)


def test_rope_paths_agree_in_bf16(monkeypatch):
    x = torch.randn(2, 64, 4, 16, dtype=torch.bfloat16)
    cache = rope_cache(64, 16, 500000.0, None)
    complex_path = apply_rope(x, cache)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    real_path = apply_rope(x, cache)
    assert real_path.dtype == torch.bfloat16
    # The same fp32 products rounded once to bf16; they may differ by the last bit of a few.
    assert torch.allclose(real_path.float(), complex_path.float(), rtol=2 ** -7, atol=0)


# Grouped K/V handed to the kernel as they are (enable_gqa), or expanded first.
@pytest.mark.parametrize("grouped", [True, False])
def test_gqa_attention_matches_explicit_causal_softmax(grouped, monkeypatch):
    monkeypatch.setattr(llama, "takes_grouped_kv", lambda *args: grouped)
    torch.manual_seed(0)
    args = model_args("llama3_debug")
    assert args.n_heads > args.kv_heads
    attn = Attention(args).double()
    x = torch.randn(2, 7, args.dim, dtype=torch.float64)
    rope = rope_cache(7, args.head_dim, args.rope_theta, None)
    out = attn(x, rope)
    q = apply_rope((x @ attn.wq.weight.T).view(2, 7, args.n_heads, -1), rope)
    k = apply_rope((x @ attn.wk.weight.T).view(2, 7, args.kv_heads, -1), rope)
    v = (x @ attn.wv.weight.T).view(2, 7, args.kv_heads, -1)
    group = args.n_heads // args.kv_heads
    heads = []
    for h in range(args.n_heads):
        scores = q[:, :, h] @ k[:, :, h // group].transpose(1, 2) / math.sqrt(args.head_dim)
        scores = scores.masked_fill(torch.ones(7, 7).triu(1).bool(), float("-inf"))
        heads.append(F.softmax(scores, dim=-1) @ v[:, :, h // group])
    expected = torch.cat(heads, dim=-1) @ attn.wo.weight.T
    assert torch.allclose(out, expected, atol=1e-10)


@pytest.mark.parametrize("device, dtype, backend, grouped", [
    ("cpu", torch.float32, "efficient", True),      # CPU kernels take grouped K/V
    ("cuda", torch.bfloat16, "auto", True),         # cuDNN
    ("cuda", torch.bfloat16, "flash", True),
    ("cuda", torch.bfloat16, "efficient", False),
    ("cuda", torch.float32, "auto", False),         # cuDNN and flash are 16-bit: efficient runs
    ("cuda", torch.float32, "math", True),
])
def test_grouped_kv_go_to_the_kernels_that_take_them(device, dtype, backend, grouped):
    backends = Attention(model_args("llama3_debug", attention_backend=backend)).backends
    assert llama.takes_grouped_kv(device, dtype, backends) is grouped


def test_forward_is_causal():
    model = build("llama3_debug", device="cpu", seed=0)
    tokens = torch.randint(0, 4096, (1, 16))
    changed = tokens.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 4096
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.equal(a[0, :10], b[0, :10])
    assert not torch.allclose(a[0, 10:], b[0, 10:])


def test_meta_then_init_equals_direct_build():
    direct = build("llama3_debug", device="cpu", seed=3)
    meta = build("llama3_debug", device="meta")
    meta.to_empty(device="cpu")
    meta.init_weights(3, buffer_device=torch.device("cpu"))
    for (name, a), (_, b) in zip(direct.state_dict().items(), meta.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(direct.rope, meta.rope)


def test_init_depends_on_seed_and_parameter_not_on_order():
    a = build("llama3_debug", device="cpu", seed=1)
    b = build("llama3_debug", device="cpu", seed=2)
    assert not torch.equal(a.layers["0"].attention.wq.weight, b.layers["0"].attention.wq.weight)
    # Two parameters of the same shape get different values.
    assert not torch.equal(a.layers["0"].attention.wk.weight, a.layers["0"].attention.wv.weight)
    # A model with fewer layers shares the first layers' weights (values depend on the name only).
    short = build("llama3_debug", device="cpu", seed=1, n_layers=2)
    assert torch.equal(short.layers["1"].feed_forward.w1.weight,
                       a.layers["1"].feed_forward.w1.weight)


def test_init_statistics():
    model = build("llama3_debug", device="cpu", seed=0)
    w = model.layers["0"].attention.wq.weight
    assert w.std().item() == pytest.approx(0.02 * 0.9866, rel=0.02)  # 3-sigma truncation
    assert w.abs().max().item() <= 0.06 + 1e-7
    emb = model.tok_embeddings.weight
    assert emb.mean().item() == pytest.approx(0.0, abs=0.01)
    assert emb.std().item() == pytest.approx(1.0, rel=0.01)
    wo = model.layers["3"].attention.wo.weight
    assert wo.std().item() == pytest.approx(0.02 / math.sqrt(8) * 0.9866, rel=0.02)
    assert torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))


def test_tied_embeddings_share_one_tensor():
    model = build("llama3_1b", device="meta")
    assert model.output.weight is model.tok_embeddings.weight
    assert model.num_params(exclude_embedding=True) == model.num_params()


def test_stage_without_embeddings_or_output_passes_hidden_states():
    model = build("llama3_debug", device="cpu", seed=0)
    tokens = torch.randint(0, 4096, (2, 8))
    with torch.no_grad():
        full = model(tokens)
        hidden = model.tok_embeddings(tokens)
        model.tok_embeddings, output = None, model.output
        model.output = None
        out = output(model(hidden))
    assert torch.allclose(out, full)


def test_forward_shape_and_dtype():
    model = Transformer(model_args("llama3_debug", n_layers=1))
    model.init_weights(0)
    logits = model(torch.randint(0, 4096, (3, 11)))
    assert logits.shape == (3, 11, 4096) and logits.dtype == torch.float32
