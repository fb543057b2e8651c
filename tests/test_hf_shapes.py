"""Hugging Face models of the six supported architectures, in shapes no dtrain preset has (odd
head counts, MQA and GQA, head widths other than hidden / heads, biases, qk-norm, tied and untied
embeddings, Llama 3.1 and YaRN RoPE scaling, three experts top-1, four experts top-2 with and
without renormalised weights, a dense block before the MoE ones): an import computes
transformers' logits, and its export loads in transformers with the same logits. Configs that
dtrain cannot compute are refused in one line naming the problem."""

import math
from dataclasses import replace

import pytest
import torch
import transformers

from dtrain import Trainer, load_config
from dtrain.config import ConfigError
from dtrain.convert_hf import write_recipe
from dtrain.hf_checkpoint import args_from_hf_config, export_hf, import_hf, load_model
from dtrain.hf_config import hf_architecture_of, hf_config_from_args
from dtrain.models import model_args
from dtrain.models.moe import Router
from dtrain.run import feature_lines

TINY_RUN = {"training.steps": 5, "training.seq_len": 32, "training.global_batch_size": 2,
            "training.micro_batch_size": 1, "metrics.tensorboard": False,
            "metrics.log_every": 1, "data.tokenizer": "builtin:debug/tokenizer.json"}

# fp32 on CPU, eager attention in transformers: the two sides differ only in the order of float
# operations and in RoPE angles (float64 here, float32 there).
ATOL = 1e-5
# The debug tokenizer's 4096 ids: each imported model also trains from its recipe with it.
COMMON = {"num_hidden_layers": 2, "vocab_size": 4096, "max_position_embeddings": 64,
          "rms_norm_eps": 1e-6}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}

# id -> (config class, its fields, the class the export loads as)
SHAPES = {
    "llama-5-heads-mqa-biases-llama3": (transformers.LlamaConfig, dict(
        hidden_size=60, num_attention_heads=5, num_key_value_heads=1, intermediate_size=88,
        attention_bias=True, rope_theta=500000.0, rope_scaling=LLAMA3), "LlamaForCausalLM"),
    "llama-3-heads-tied-yarn-mscale": (transformers.LlamaConfig, dict(
        hidden_size=48, num_attention_heads=3, num_key_value_heads=3, intermediate_size=80,
        tie_word_embeddings=True, rope_theta=10000.0,
        rope_scaling={**YARN, "beta_fast": 8.0, "beta_slow": 0.5, "mscale": 0.8,
                      "mscale_all_dim": 0.4, "truncate": False}), "LlamaForCausalLM"),
    "mistral-6-heads-gqa-head-dim-12": (transformers.MistralConfig, dict(
        hidden_size=64, num_attention_heads=6, num_key_value_heads=2, head_dim=12,
        intermediate_size=72, sliding_window=None, rope_theta=1e6), "MistralForCausalLM"),
    "mixtral-3-experts-top-1-mqa": (transformers.MixtralConfig, dict(
        hidden_size=48, num_attention_heads=3, num_key_value_heads=1, intermediate_size=40,
        num_local_experts=3, num_experts_per_tok=1, rope_theta=1e6), "MixtralForCausalLM"),
    "qwen2-7-heads-mha-tied-yarn": (transformers.Qwen2Config, dict(
        hidden_size=56, num_attention_heads=7, num_key_value_heads=7, intermediate_size=96,
        tie_word_embeddings=True, rope_theta=1e6, rope_scaling=YARN), "Qwen2ForCausalLM"),
    "qwen3-qk-norm-head-dim-16-mqa": (transformers.Qwen3Config, dict(
        hidden_size=40, num_attention_heads=5, num_key_value_heads=1, head_dim=16,
        intermediate_size=64, rope_theta=1e6), "Qwen3ForCausalLM"),
    "qwen3-gqa-biases-untied": (transformers.Qwen3Config, dict(
        hidden_size=48, num_attention_heads=6, num_key_value_heads=3, head_dim=10,
        intermediate_size=64, attention_bias=True, rope_theta=1e6), "Qwen3ForCausalLM"),
    # No head_dim: Qwen3-MoE's default is hidden / heads (12), not Qwen3's 128.
    "qwen3-moe-4-experts-top-2-renormalised": (transformers.Qwen3MoeConfig, dict(
        hidden_size=48, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        rope_theta=1e6), "Qwen3MoeForCausalLM"),
    "qwen3-moe-dense-first-block-unnormalised-biases": (transformers.Qwen3MoeConfig, dict(
        hidden_size=40, num_attention_heads=5, num_key_value_heads=1, head_dim=8,
        intermediate_size=72, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=False, mlp_only_layers=[0], attention_bias=True, rope_theta=1e6),
     "Qwen3MoeForCausalLM"),
}


def random_hf(config_class, fields: dict) -> transformers.PreTrainedModel:
    """A transformers model with every parameter random: biases and norm weights too, which
    transformers initialises to 0 and 1 (so a wrong permutation of them would go unseen);
    weights of std 0.1, so that attention is far from uniform and RoPE matters."""
    config = config_class(**COMMON, **fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model.eval()


def max_error(ours, theirs, tokens) -> float:
    with torch.no_grad():
        return (ours(tokens) - theirs(tokens).logits).abs().max().item()


@pytest.mark.parametrize("shape", SHAPES)
def test_import_gives_transformers_logits_and_export_loads_with_them(tmp_path, shape):
    config_class, fields, exported_as = SHAPES[shape]
    hf = random_hf(config_class, fields)
    hf.save_pretrained(tmp_path / "hf")
    args = import_hf(tmp_path / "hf", tmp_path / "ckpt")
    recipe = write_recipe(tmp_path / "hf", tmp_path / "ckpt", args)  # as `convert_hf import`
    ours = load_model(tmp_path / "ckpt", args).eval()
    tokens = torch.randint(0, COMMON["vocab_size"], (2, 24))
    assert max_error(ours, hf, tokens) < ATOL

    export_hf(ours, tmp_path / "out", torch.float32)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out",
                                                             attn_implementation="eager").eval()
    assert type(back).__name__ == exported_as
    assert max_error(ours, back, tokens) < ATOL

    # The recipe the import wrote trains as it is (5 steps on the CPU, from these weights).
    trainer = Trainer(load_config(recipe, {
        **TINY_RUN, "job.output_dir": str(tmp_path / "runs")}))
    assert feature_lines(trainer)[0].startswith(f"weights: from {tmp_path / 'ckpt'}")
    records = trainer.train()
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert all(math.isfinite(r["loss"]) for r in records)


def test_the_shape_fields_follow_the_architecture():
    base = {"hidden_size": 48, "num_hidden_layers": 2, "num_attention_heads": 6,
            "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 64}
    qwen2 = args_from_hf_config({**base, "architectures": ["Qwen2ForCausalLM"]})
    assert (qwen2.qkv_bias, qwen2.out_bias, qwen2.qk_norm, qwen2.head_size) == (True, False,
                                                                                False, None)
    qwen3 = args_from_hf_config({**base, "model_type": "qwen3", "attention_bias": True})
    assert (qwen3.qkv_bias, qwen3.out_bias, qwen3.qk_norm, qwen3.head_dim) == (True, True,
                                                                               True, 128)
    mistral = args_from_hf_config({**base, "model_type": "mistral", "attention_bias": True,
                                   "sliding_window": None, "head_dim": 16})
    assert (mistral.qkv_bias, mistral.head_size) == (False, 16)  # Mistral has no biases
    mixtral = args_from_hf_config({**base, "model_type": "mixtral", "num_local_experts": 3,
                                   "num_experts_per_tok": 1, "router_aux_loss_coef": 0.02})
    assert (mixtral.n_experts, mixtral.moe_top_k, mixtral.moe_router, mixtral.moe_norm_topk,
            mixtral.moe_aux_loss_coeff, mixtral.moe_layers) == (3, 1, "softmax", True, 0.02, None)
    qwen3_moe = args_from_hf_config({**base, "model_type": "qwen3_moe", "num_experts": 8,
                                     "num_experts_per_tok": 2, "moe_intermediate_size": 16})
    assert (qwen3_moe.qk_norm, qwen3_moe.head_dim, qwen3_moe.ffn_dim, qwen3_moe.expert_dim,
            qwen3_moe.moe_norm_topk, qwen3_moe.moe_aux_loss_coeff) == (True, 8, 64, 16, False,
                                                                       0.001)


@pytest.mark.parametrize("norm_topk", [True, False])
def test_the_router_weighs_the_experts_as_qwen3_moes(norm_topk):
    # Softmax over all experts, top-k, renormalised only with norm_topk_prob: the same
    # operations in fp32 on both sides, so the weights agree to rounding.
    config = transformers.Qwen3MoeConfig(hidden_size=16, num_experts=6, num_experts_per_tok=3,
                                         norm_topk_prob=norm_topk)
    theirs = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(config)
    ours = Router(16, 6, 3, "softmax", norm_topk)
    torch.manual_seed(0)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(6, 16))
        ours.gate.weight.copy_(theirs.weight)
        x = torch.randn(32, 16)
        _, their_weights, their_experts = theirs(x)
        _, _, our_experts, our_weights = ours(x)
    assert torch.equal(our_experts, their_experts)
    assert torch.allclose(our_weights, their_weights, rtol=0, atol=1e-6)
    assert torch.allclose(our_weights.sum(-1), torch.ones(32)) == norm_topk


@pytest.mark.parametrize("step, mlp_only", [(1, []), (2, []), (3, [2]), (1, [0, 5]), (7, [])])
def test_the_moe_blocks_are_those_transformers_makes_sparse(step, mlp_only):
    config = transformers.Qwen3MoeConfig(
        hidden_size=16, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
        head_dim=8, intermediate_size=32, moe_intermediate_size=8, num_experts=4,
        num_experts_per_tok=2, vocab_size=64, decoder_sparse_step=step, mlp_only_layers=mlp_only)
    with torch.device("meta"):
        layers = transformers.Qwen3MoeForCausalLM(config).model.layers
    sparse = [i for i, layer in enumerate(layers)
              if isinstance(layer.mlp, transformers.models.qwen3_moe.modeling_qwen3_moe
                            .Qwen3MoeSparseMoeBlock)]
    args = args_from_hf_config(config.to_dict())
    assert [i for i in range(6) if args.is_moe_layer(i)] == sparse
    if sparse:  # the export lists the dense blocks, and reads back as the same blocks
        assert args_from_hf_config(hf_config_from_args(args)) == args


def test_an_moe_shape_exports_as_qwen3_moe_with_qk_norm_else_mixtral():
    mixtral = model_args("mixtral_debug")
    assert hf_architecture_of(mixtral) == "MixtralForCausalLM"
    assert hf_architecture_of(model_args("qwen3_30b_a3b")) == "Qwen3MoeForCausalLM"
    some_blocks = replace(mixtral, qk_norm=True, moe_layers=(1, 3), moe_norm_topk=False)
    assert hf_architecture_of(some_blocks) == "Qwen3MoeForCausalLM"
    assert hf_config_from_args(some_blocks)["mlp_only_layers"] == [0, 2]
    for refused, message in ((replace(mixtral, moe_layers=(1, 3)), r"dense blocks \[0, 2\]"),
                             (replace(mixtral, moe_norm_topk=False), "not renormalised")):
        with pytest.raises(ConfigError, match=message):
            hf_architecture_of(refused)


def test_transformers_4_and_5_rope_layouts_give_the_same_shape():
    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 64}
    older = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    v4 = args_from_hf_config({**base, "rope_theta": 5e5, "rope_scaling": older})
    v5 = args_from_hf_config({**base, "rope_parameters": {**YARN, "rope_theta": 5e5}})
    assert v4 == v5 and v5.rope_theta == 5e5 and v5.rope_scaling.kind == "yarn"
    plain = args_from_hf_config({**base, "rope_parameters": {"rope_type": "default",
                                                             "rope_theta": 1e6}})
    assert plain.rope_theta == 1e6 and plain.rope_scaling is None


def test_a_sliding_window_that_no_layer_uses_is_accepted():
    # Qwen2.5's configs: a window is named but switched off, or starts after the last layer.
    base = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 64,
            "sliding_window": 131072}
    args_from_hf_config({**base, "use_sliding_window": False})
    args_from_hf_config({**base, "use_sliding_window": True, "max_window_layers": 2})


DENSE = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "intermediate_size": 64, "vocab_size": 64}
REFUSED = {
    "mistral-sliding-window": ({**DENSE, "architectures": ["MistralForCausalLM"],
                                "sliding_window": 4096}, "sliding_window 4096"),
    "mistral-default-window": ({**DENSE, "model_type": "mistral"}, "sliding-window attention"),
    "qwen2-sliding-window": ({**DENSE, "architectures": ["Qwen2ForCausalLM"],
                              "use_sliding_window": True, "sliding_window": 64,
                              "max_window_layers": 1}, "sliding_window 64"),
    "dynamic-rope": ({**DENSE, "model_type": "llama",
                      "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
                     "RoPE type 'dynamic': only default, llama3, yarn"),
    "mlp-bias": ({**DENSE, "model_type": "llama", "mlp_bias": True}, "mlp_bias"),
    "gelu": ({**DENSE, "model_type": "llama", "hidden_act": "gelu"}, "hidden_act 'gelu'"),
    "other-architecture": ({**DENSE, "architectures": ["GemmaForCausalLM"]},
                           "GemmaForCausalLM: only LlamaForCausalLM, MistralForCausalLM, "
                           "MixtralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
                           "Qwen3MoeForCausalLM"),
    "qwen3-moe-sparse-step-0": ({**DENSE, "model_type": "qwen3_moe", "decoder_sparse_step": 0},
                                "decoder_sparse_step 0"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_dtrain_cannot_compute_is_refused_in_one_line(case):
    config, message = REFUSED[case]
    with pytest.raises(ConfigError, match=message) as refused:
        args_from_hf_config(config)
    assert "\n" not in str(refused.value)


def test_a_gpt2_folder_is_refused_in_one_line(tmp_path):
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="GPT2LMHeadModel: only LlamaForCausalLM") as refused:
        import_hf(tmp_path, tmp_path / "ckpt")
    assert "\n" not in str(refused.value)
