"""The Qwen3-MoE presets are the published models: the shape their Hugging Face config.json
gives, and the parameter counts their publisher states, counted on the meta device."""

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
