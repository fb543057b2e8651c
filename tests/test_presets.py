"""The Qwen3-MoE and DeepSeek presets are the published models: the shape their Hugging Face
config.json (for the DeepSeek-V3 16B, torchtitan's flavor) gives, and the parameter counts their
publisher states, counted on the meta device."""

import pytest

from dtrain.hf_config import args_from_hf_config, hf_config_from_args
from dtrain.models import PRESETS, build

# The keys of Qwen/Qwen3-30B-A3B's and Qwen/Qwen3-235B-A22B's config.json that set the shape.
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
             "attention_bias": False, "decoder_sparse_step": 1, "head_dim": 128,
             "hidden_act": "silu", "max_position_embeddings": 40960, "mlp_only_layers": [],
             "norm_topk_prob": True, "num_experts": 128, "num_experts_per_tok": 8,
             "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "rope_scaling": None,
             "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
             "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936}
PUBLISHED_CONFIGS = {
    "qwen3_30b_a3b": {**QWEN3_MOE, "hidden_size": 2048, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "max_window_layers": 48},
    "qwen3_235b_a22b": {**QWEN3_MOE, "hidden_size": 4096, "num_hidden_layers": 94,
                        "num_attention_heads": 64, "intermediate_size": 12288,
                        "moe_intermediate_size": 1536, "max_window_layers": 94},
}


@pytest.mark.parametrize("name", PUBLISHED_CONFIGS)
def test_a_qwen3_moe_preset_is_the_shape_of_its_published_config(name):
    assert args_from_hf_config(PUBLISHED_CONFIGS[name]) == PRESETS[name]
    assert args_from_hf_config(hf_config_from_args(PRESETS[name])) == PRESETS[name]


# Qwen states its counts cut, not rounded, to the digits shown: 30,532,122,624 parameters are
# "30.5B", 3,353,032,704 active "3.3B" (1.6% less: 1% would not hold), 235,093,634,560 "235B"
# and 22,190,763,520 active "22B". Active: the routed experts by top_k / n_experts, all else
# (embeddings, attention, router) in full.
@pytest.mark.parametrize("name, total, active, unit", [
    ("qwen3_30b_a3b", 305, 33, 10**8),
    ("qwen3_235b_a22b", 235, 22, 10**9),
])
def test_a_qwen3_moe_preset_has_the_published_parameter_counts(name, total, active, unit):
    model = build(name, device="meta")
    assert model.num_params() // unit == total
    assert model.num_params(active=True) // unit == active


# The DeepSeek-V3 preset against its published config.json: tests/test_hf_deepseek.py.


def test_the_deepseek_v3_16b_preset_is_torchtitans_16b_flavor():
    # torchtitan/models/deepseek_v3/__init__.py, _16b: the values it passes, one by one.
    a = PRESETS["deepseek_v3_16b"]
    assert (a.dim, a.n_layers, a.vocab_size, a.n_heads) == (2048, 27, 102400, 16)
    assert (a.q_lora_rank, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim,
            a.v_head_dim) == (None, 512, 128, 64, 128)  # q_lora_rank 0: one query projection
    assert (a.ffn_dim, a.expert_dim, a.n_experts, a.moe_top_k) == (10944, 1408, 64, 6)
    assert a.moe_shared_hidden == 2 * 1408  # two shared experts, as one of twice the width
    assert [a.is_moe_layer(i) for i in range(27)] == [False] + [True] * 26  # n_dense_layers 1
    assert (a.moe_router, a.moe_norm_topk, a.moe_routed_scale, a.moe_n_group) == (
        "softmax", False, 1.0, 1)  # route_norm and route_scale left at their defaults
    s = a.rope_scaling
    assert (a.rope_theta, a.max_seq_len) == (10000.0, 4096 * 4)
    assert (s.kind, s.factor, s.original_max_seq_len, s.beta_fast, s.beta_slow) == (
        "yarn", 40.0, 4096, 32.0, 1.0)
    # torchtitan's mscale 0.70 scales the softmax by mscale(40)^2 and leaves cos and sin alone:
    # dtrain's pair (mscale, mscale_all_dim) does that when both are 0.70.
    assert (s.mscale, s.mscale_all_dim, a.mtp_depths) == (0.7, 0.7, 0)


def mtp_params(model) -> int:
    return model.num_params() - model.num_params(mtp=False)


# DeepSeek states 671B parameters and 37B activated for V3 (README: 36.7B in README_WEIGHTS,
# whose figure is the count without the input embedding, a lookup: 36.63B); DeepSeek-V2-Lite,
# the 16B's shape, 15.7B and 2.4B activated (the same count: 2.45B). Counted here: 671.03B and
# 37.55B (36.63B), 15.71B and 2.45B.
@pytest.mark.parametrize("name, total, active, unit", [
    ("deepseek_v3_671b", 671, 36.7, 10**9),
    ("deepseek_v3_16b", 15.7, 2.4, 10**9),
])
def test_a_deepseek_preset_has_the_published_parameter_counts(name, total, active, unit):
    model = build(name, device="meta")
    assert model.num_params(mtp=False) / unit == pytest.approx(total, rel=0.001)
    activated = model.num_params(exclude_embedding=True, active=True, mtp=False) / unit
    assert activated == pytest.approx(active, rel=0.025)
    if name == "deepseek_v3_671b":
        assert model.num_params(active=True, mtp=False) // unit == 37


def test_the_deepseek_v3_mtp_depth_has_the_published_size():
    # README_WEIGHTS: the MTP module is 11.5B unique parameters (its transformer layer: 11.507B;
    # with its projection and norms 11.61B), 14B with the copies of the embedding and the output
    # head its checkpoint files hold (they share the model's): 685B = 671B + 14B in all.
    model = build("deepseek_v3_671b", device="meta")
    assert sum(p.numel() for p in model.mtp["0"].block.parameters()) // 10**8 == 115
    depth = mtp_params(model)
    assert depth == sum(p.numel() for p in model.mtp.parameters())
    in_files = depth + 2 * model.tok_embeddings.weight.numel()
    assert (model.num_params(mtp=False) + in_files) / 1e9 == pytest.approx(685, rel=0.001)
    assert in_files / 1e9 == pytest.approx(14, rel=0.04)
    assert mtp_params(build("deepseek_v3_16b", device="meta")) == 0
