"""Llama-family shapes beyond the presets: head width other than dim / n_heads, MQA and GQA,
projection biases, per-head q/k norms (Qwen2, Qwen3), YaRN and llama3 RoPE scaling as Hugging
Face transformers computes them, and MoE models with dense blocks (moe_layers). CPU, fp32."""

import hashlib
import math

import pytest
import torch
import torch.nn.functional as F

from dtrain.config import ConfigError
from dtrain.kernels.rope import rope
from dtrain.metrics import model_flops_per_token
from dtrain.models import Transformer, model_args
from dtrain.models.feed_forward import FeedForward
from dtrain.models.llama import (
    Attention,
    LlamaArgs,
    RopeScaling,
    apply_rope,
    rope_attention_factor,
    rope_cache,
    rope_frequencies,
)
from dtrain.models.moe import MoE
from dtrain.models.presets import LLAMA32_SCALING
from dtrain.parallel.expert import moe_layers
from dtrain.parallel.tensor import check_tp

SEQ = 7
TINY = dict(dim=96, n_layers=2, n_heads=3, vocab_size=128, multiple_of=32, max_seq_len=32,
            rope_theta=10000.0)


def rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Meta's interleaved RoPE at positions 0..seq-1, from the formula theta^(-2i / head_dim)."""
    head_dim = x.shape[-1]
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(x.shape[1], dtype=torch.float64), freqs)
    cos, sin = (t.float()[None, :, None, :] for t in (angles.cos(), angles.sin()))
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


def reference_attention(attn: Attention, x: torch.Tensor, args: LlamaArgs) -> torch.Tensor:
    """Causal softmax attention by hand from ``attn``'s weights: projections (with biases),
    RMSNorm of each head's q and k, RoPE, each query head on its KV head, output projection."""
    batch, seq, _ = x.shape

    def project(linear, heads):
        out = x @ linear.weight.T + (linear.bias if linear.bias is not None else 0)
        return out.view(batch, seq, heads, args.head_dim)

    def rms(t, weight):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + args.norm_eps) * weight

    q, k = project(attn.wq, args.n_heads), project(attn.wk, args.kv_heads)
    v = project(attn.wv, args.kv_heads)
    if args.qk_norm:
        q, k = rms(q, attn.q_norm.weight), rms(k, attn.k_norm.weight)
    q, k = rotate(q, args.rope_theta), rotate(k, args.rope_theta)
    group, future = args.n_heads // args.kv_heads, torch.ones(seq, seq).triu(1).bool()
    heads = []
    for h in range(args.n_heads):
        scores = q[:, :, h] @ k[:, :, h // group].transpose(1, 2) / math.sqrt(args.head_dim)
        heads.append(F.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
                     @ v[:, :, h // group])
    out = torch.cat(heads, dim=-1) @ attn.wo.weight.T
    return out + attn.wo.bias if attn.wo.bias is not None else out


# fp32: the fused kernels and the loop above differ only in the order of sums.
@pytest.mark.parametrize("shape", [
    dict(head_size=40),                                  # head width other than dim / n_heads
    dict(n_heads=4, n_kv_heads=1, head_size=40),         # MQA
    dict(n_heads=6, n_kv_heads=2),                       # GQA, head_dim 16
    dict(qkv_bias=True),                                 # Qwen2
    dict(qkv_bias=True, out_bias=True),                  # HF Llama's attention_bias
    dict(qk_norm=True, head_size=40, n_kv_heads=1),      # Qwen3
    dict(n_heads=4, n_kv_heads=2, head_size=40, qkv_bias=True, out_bias=True, qk_norm=True),
], ids=["head_size", "mqa", "gqa", "qkv_bias", "all_bias", "qk_norm", "everything"])
def test_attention_matches_hand_written_causal_softmax(shape):
    torch.manual_seed(0)
    args = LlamaArgs(**{**TINY, **shape})
    attn = Attention(args)  # nn.Linear's default init: nonzero biases
    for norm in (attn.q_norm, attn.k_norm):
        if norm is not None:
            torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    x = torch.randn(2, SEQ, args.dim)
    out = attn(x, rope_cache(SEQ, args.head_dim, args.rope_theta, None))
    assert torch.allclose(out, reference_attention(attn, x, args), rtol=1e-5, atol=1e-5)


def test_projection_shapes_follow_head_size():
    args = LlamaArgs(**TINY, n_kv_heads=1, head_size=40, qkv_bias=True, qk_norm=True)
    shapes = {name: tuple(p.shape) for name, p in Transformer(args).named_parameters()
              if name.startswith("layers.0.attention.")}
    assert shapes == {
        "layers.0.attention.wq.weight": (120, 96), "layers.0.attention.wq.bias": (120,),
        "layers.0.attention.wk.weight": (40, 96), "layers.0.attention.wk.bias": (40,),
        "layers.0.attention.wv.weight": (40, 96), "layers.0.attention.wv.bias": (40,),
        "layers.0.attention.wo.weight": (96, 120),
        "layers.0.attention.q_norm.weight": (40,), "layers.0.attention.k_norm.weight": (40,)}


def test_init_zeroes_biases_sets_qk_norms_to_one_and_keeps_the_rest():
    plain = Transformer(LlamaArgs(**TINY, head_size=40))
    shaped = Transformer(LlamaArgs(**TINY, head_size=40, qkv_bias=True, out_bias=True,
                                   qk_norm=True))
    plain.init_weights(seed=5)
    shaped.init_weights(seed=5)
    before = dict(plain.named_parameters())
    for name, param in shaped.named_parameters():
        if name.endswith(".bias"):
            assert torch.equal(param, torch.zeros_like(param)), name
        elif "q_norm" in name or "k_norm" in name:
            assert torch.equal(param, torch.ones_like(param)), name
        else:
            assert torch.equal(param, before[name]), name


def transformers_rope(kind: str, head_dim: int, theta: float, parameters: dict):
    """(inverse frequencies, attention factor) from transformers' ROPE_INIT_FUNCTIONS."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=96, num_attention_heads=3, head_dim=head_dim,
                         max_position_embeddings=4096,
                         rope_parameters={"rope_type": kind, "rope_theta": theta, **parameters})
    return ROPE_INIT_FUNCTIONS[kind](config, "cpu")


# transformers computes in fp32, dtrain in fp64: they agree to fp32's rounding.
@pytest.mark.parametrize("head_dim, theta, scaling", [
    (128, 1e6, RopeScaling(kind="yarn", factor=4.0, original_max_seq_len=32768)),  # Qwen3
    (40, 1e4, RopeScaling(kind="yarn", factor=8.0, original_max_seq_len=1024, beta_fast=16,
                          beta_slow=2)),
    (64, 1e4, RopeScaling(kind="yarn", factor=4.0, original_max_seq_len=1024, truncate=False)),
    (64, 1e4, RopeScaling(kind="yarn", factor=40.0, original_max_seq_len=4096, mscale=1.0,
                          mscale_all_dim=0.5)),  # DeepSeek's form of the attention factor
    (64, 1e4, RopeScaling(kind="yarn", factor=4.0, original_max_seq_len=1024, mscale=0.7)),
    (40, 5e5, RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_seq_len=64)),  # llama3
], ids=["yarn-qwen3", "yarn-betas", "yarn-untruncated", "yarn-mscale", "yarn-mscale-alone",
        "llama3"])
def test_rope_scaling_matches_transformers(head_dim, theta, scaling):
    parameters = {"factor": scaling.factor,
                  "original_max_position_embeddings": scaling.original_max_seq_len}
    if scaling.kind == "yarn":
        parameters |= {"beta_fast": scaling.beta_fast, "beta_slow": scaling.beta_slow,
                       "truncate": scaling.truncate}
        if scaling.mscale != 1.0 or scaling.mscale_all_dim:
            parameters |= {"mscale": scaling.mscale, "mscale_all_dim": scaling.mscale_all_dim}
    else:
        parameters |= {"low_freq_factor": scaling.low_freq_factor,
                       "high_freq_factor": scaling.high_freq_factor}
    inv_freq, attention_factor = transformers_rope(scaling.kind, head_dim, theta, parameters)
    freqs = rope_frequencies(head_dim, theta, scaling)
    assert torch.allclose(freqs, inv_freq.double(), rtol=1e-6, atol=0)
    assert rope_attention_factor(scaling) == pytest.approx(attention_factor, rel=1e-6)
    magnitude = rope_cache(16, head_dim, theta, scaling).abs()
    assert torch.allclose(magnitude, torch.full_like(magnitude, attention_factor), rtol=1e-6)


def test_unknown_rope_scaling_kind_is_refused():
    with pytest.raises(ValueError, match="'ntk': use llama3 or yarn"):
        RopeScaling(kind="ntk")


def test_yarn_attention_factor_survives_every_rope_path(monkeypatch):
    # The complex multiply (eager), the dtrain::rope op (the Triton kernel's reference on CPU)
    # and the real products of the compiled path, forward and backward.
    scaling = RopeScaling(kind="yarn", factor=4.0, original_max_seq_len=16)
    factor = rope_attention_factor(scaling)
    assert factor > 1.1
    cache = rope_cache(SEQ, 16, 10000.0, scaling)
    x = torch.randn(2, SEQ, 3, 16, requires_grad=True)
    grad = torch.randn(2, SEQ, 3, 16)
    eager = apply_rope(x, cache)
    kernel = rope(x, torch.view_as_real(cache))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    compiled = apply_rope(x, cache)
    pair_norms = [t.unflatten(-1, (-1, 2)).norm(dim=-1) for t in (x, eager)]
    assert torch.allclose(pair_norms[1], factor * pair_norms[0], rtol=1e-5)
    eager_grad, = torch.autograd.grad(eager, x, grad)
    for out in (kernel, compiled):
        assert torch.allclose(out, eager, atol=1e-5)
        assert torch.allclose(torch.autograd.grad(out, x, grad)[0], eager_grad, atol=1e-5)


MOE = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32,
           max_seq_len=32, n_experts=4, moe_top_k=2, moe_hidden_size=32)


def test_moe_layers_makes_the_other_blocks_dense():
    model = Transformer(LlamaArgs(**MOE, moe_layers=(1,)))
    assert isinstance(model.layers["0"].feed_forward, FeedForward)
    assert isinstance(model.layers["1"].feed_forward, MoE)
    names = {name for name, _ in model.named_parameters() if ".feed_forward." in name}
    assert names == {"layers.0.feed_forward.w1.weight", "layers.0.feed_forward.w2.weight",
                     "layers.0.feed_forward.w3.weight", "layers.1.feed_forward.router.gate.weight",
                     "layers.1.feed_forward.experts.w1", "layers.1.feed_forward.experts.w2",
                     "layers.1.feed_forward.experts.w3"}
    assert set(moe_layers([model])) == {1}
    every = Transformer(LlamaArgs(**MOE))
    assert set(moe_layers([every])) == {0, 1}


def test_moe_layers_parameter_counts_and_flops():
    args = LlamaArgs(**MOE, moe_layers=(1,))
    model = Transformer(args)
    dim, hd = args.dim, args.head_dim
    attention = dim * hd * (2 * args.n_heads + 2 * args.kv_heads) + 2 * dim  # with its norms
    dense, router, experts = 3 * dim * args.ffn_dim, dim * 4, 3 * 4 * dim * 32
    top = 2 * args.vocab_size * dim + dim
    assert model.num_params() == 2 * attention + dense + router + experts + top
    active = 2 * attention + dense + router + experts * 2 // 4 + top - args.vocab_size * dim
    assert model.num_params(exclude_embedding=True, active=True) == active
    seq = 16
    assert model_flops_per_token(model, seq) == (
        6 * active + 12 * args.n_layers * args.n_heads * hd * seq)


def test_moe_layers_model_trains_every_parameter():
    torch.manual_seed(0)
    model = Transformer(LlamaArgs(**MOE, moe_layers=(1,), moe_aux_loss_coeff=0.01))
    model.init_weights(seed=0)
    tokens = torch.randint(0, 128, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 128)
    F.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten()).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    assert model.layers["1"].feed_forward.stats()[:4].sum() == 2 * 16 * 2  # top-2 of 32 tokens


def test_tp_asks_the_dense_width_to_split_only_where_a_block_is_dense():
    odd = dict(MOE, ffn_hidden_size=99)
    check_tp(LlamaArgs(**odd), 2, 16)  # every block an MoE: its experts are not split over tp
    with pytest.raises(ConfigError, match="ffn hidden size"):
        check_tp(LlamaArgs(**odd, moe_layers=(1,)), 2, 16)


def weights_digest(model: Transformer) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name}{tuple(tensor.shape)}".encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def cache_digest(cache: torch.Tensor) -> str:
    return hashlib.sha256(torch.view_as_real(cache).contiguous().numpy().tobytes()).hexdigest()


# Digests of the weights and RoPE tables the presets had before the shape options existed: the
# options' defaults must build and initialise them bit for bit as before.
@pytest.mark.parametrize("name, weights, table", [
    ("llama3_debug", "1a2c2e68d5a5674fc2c0bd18f57b2ce5c55b4b1bf5df75c96f2211e024a590ec",
     "f9101ae2e510c8d78fe9ce41f1eb74f5cb3c0a96b8bf9b937c52d4a1a6874415"),
    ("mixtral_debug", "edbb4a91e2474a01c197e1d106e20ac6ebb6194532086e0d350029cef15b6744",
     "acad279b0add3f3e5200ce22cd60ab9accd3501b1b73dbec6879dd5b98e8f776"),
])
def test_presets_initialise_bit_for_bit_as_before(name, weights, table):
    model = Transformer(model_args(name))
    model.init_weights(seed=1234)
    assert weights_digest(model) == weights
    assert cache_digest(model.rope) == table


def test_llama3_scaled_rope_table_is_unchanged():
    assert cache_digest(rope_cache(4096, 64, 500000.0, LLAMA32_SCALING)) == (
        "1fb7d07be4061e6aa1662bc4277d42830d9264e87d7bb0aeaf5614837d9347e8")
