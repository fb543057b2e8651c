"""DeepSeek-V3 in dtrain's model: multi-head latent attention, the group-limited sigmoid router,
shared experts and dense first blocks compute transformers' ``DeepseekV3ForCausalLM`` from the
same weights; tensor parallel of MLA computes one process's numbers."""

import dataclasses

import pytest
import torch
from conftest import logits_and_grads, on_two_gloo_ranks, with_biases_and_norms_drawn
from torch.distributed.device_mesh import init_device_mesh
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from dtrain.config import ConfigError
from dtrain.hf_checkpoint import from_hf_state_dict
from dtrain.hf_deepseek import deepseek_v3_args
from dtrain.models.llama import LlamaArgs, RopeScaling, Transformer
from dtrain.models.mla import LatentAttention, softmax_scale
from dtrain.models.moe import Router
from dtrain.parallel.tensor import apply_tp, check_tp

# fp32 on the CPU: the two models differ only in the order of sums and in RoPE's angles
# (transformers computes them in fp32, dtrain in fp64), each ~1e-7 of the values.
TOLERANCE = 1e-5


def tiny_config(q_lora_rank: int | None, rope_interleave: bool = True) -> DeepseekV3Config:
    """Three blocks, the first dense; 4 routed experts in 2 groups, top 2 from the best group,
    routed_scaling_factor 2.5, one shared expert; YaRN with mscale and mscale_all_dim both set
    and unequal (the rotary attention factor and the softmax scale both away from 1); heads
    whose value width (10) differs from the key's (12 + 8); rms_norm_eps other than the latent
    norms' 1e-6; no multi-token prediction."""
    return DeepseekV3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=q_lora_rank, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, rms_norm_eps=1e-5,
        max_position_embeddings=64, rope_interleave=rope_interleave, attn_implementation="eager",
        num_nextn_predict_layers=0,  # transformers' model holds no MTP layers
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16, "mscale": 0.8,
                         "mscale_all_dim": 1.0})


def random_hf_model(config: DeepseekV3Config) -> DeepseekV3ForCausalLM:
    """Every parameter drawn at random, norms around 1 and the router's
    e_score_correction_bias included, so that a misplaced tensor changes the logits."""
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(0.5 + torch.rand(param.shape))
            else:
                param.normal_(0.0, 1.0 if "embed_tokens" in name else 0.15)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    return model


def dtrain_model(hf: DeepseekV3ForCausalLM) -> Transformer:
    """dtrain's model of ``hf``'s config, holding ``hf``'s weights."""
    args = deepseek_v3_args(hf.config.to_dict())
    model = Transformer(args).eval()
    model.load_state_dict(from_hf_state_dict(hf.state_dict(), args, hf.config.to_dict()))
    return model


@pytest.mark.parametrize("q_lora_rank, rope_interleave", [
    (24, True),  # DeepSeek-V3's shape: queries through their own latent
    (None, True),  # DeepSeek-V2-Lite's: one wq
    (24, False),  # a checkpoint laid out for rotate_half: the rotary rows interleaved at import
])
def test_deepseek_v3_logits_match_transformers(q_lora_rank, rope_interleave):
    hf = random_hf_model(tiny_config(q_lora_rank, rope_interleave))
    model = dtrain_model(hf)
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(tokens).logits
        got = model(tokens)
    assert torch.allclose(got, want, rtol=TOLERANCE, atol=TOLERANCE)


def test_deepseek_v3_args_describe_the_blocks():
    args = deepseek_v3_args(tiny_config(24).to_dict())
    assert (args.attention, args.rope_dim, args.moe_layers) == ("mla", 8, (1, 2))
    assert (args.moe_n_group, args.moe_topk_group, args.moe_routed_scale) == (2, 1, 2.5)
    assert args.moe_shared_hidden == 16 and args.moe_router == "sigmoid"
    model = Transformer(args)
    assert isinstance(model.layers["0"].attention, LatentAttention)
    assert model.rope.shape == (64, 4)  # qk_rope_head_dim // 2 pairs per position


def test_softmax_scale_is_transformers_with_yarn_mscale_all_dim():
    # DeepSeek's rule: 1/sqrt(qk_head_dim) times (0.1 mscale_all_dim ln(factor) + 1)^2.
    hf = random_hf_model(tiny_config(24))
    args = deepseek_v3_args(hf.config.to_dict())
    assert softmax_scale(20, args.rope_scaling) == hf.model.layers[0].self_attn.scaling
    assert softmax_scale(20, None) == 20 ** -0.5


def test_group_limited_router_matches_transformers():
    # 8 experts in 4 groups, the 3 best of the 2 best groups: the choice of groups and of
    # experts within them matters. Same experts, and weights within fp32 rounding.
    config = DeepseekV3Config(hidden_size=16, n_routed_experts=8, num_experts_per_tok=3,
                              n_group=4, topk_group=2, routed_scaling_factor=2.5)
    torch.manual_seed(0)
    theirs = DeepseekV3TopkRouter(config)
    ours = Router(16, 8, 3, "sigmoid", n_group=4, topk_group=2, routed_scale=2.5)
    with torch.no_grad():
        theirs.weight.normal_()
        theirs.e_score_correction_bias.normal_(0.0, 0.3)
        ours.gate.weight.copy_(theirs.weight)
        ours.expert_bias.copy_(theirs.e_score_correction_bias)
    x = torch.randn(64, 16)
    _, want_weights, want_chosen = theirs(x)
    _, _, chosen, weights = ours(x)
    order, want_order = chosen.argsort(-1), want_chosen.argsort(-1)
    assert torch.equal(chosen.gather(-1, order), want_chosen.gather(-1, want_order))
    assert torch.allclose(weights.gather(-1, order), want_weights.gather(-1, want_order),
                          rtol=1e-6, atol=1e-6)


def test_group_limited_routing_needs_a_sigmoid_router_and_equal_groups():
    with pytest.raises(ValueError, match="group-limited routing"):
        Router(16, 8, 2, "softmax", n_group=2)
    with pytest.raises(ValueError, match="group-limited routing"):
        Router(16, 6, 2, "sigmoid", n_group=4)
    with pytest.raises(ValueError, match="group-limited routing"):
        Router(16, 8, 5, "sigmoid", n_group=4, topk_group=2)


def test_deepseek_configs_dtrain_does_not_compute_are_refused():
    config = tiny_config(24).to_dict()
    with pytest.raises(ConfigError, match="norm_topk_prob false"):
        deepseek_v3_args({**config, "norm_topk_prob": False})
    rope = {**config["rope_parameters"], "mscale": 0}
    with pytest.raises(ConfigError, match="mscale_all_dim without mscale"):
        deepseek_v3_args({**config, "rope_parameters": rope})


# MLA with every part on: queries through a latent, biases on the down-projections and wo,
# YaRN with mscale_all_dim, value heads narrower than the key heads.
MLA_ARGS = LlamaArgs(
    dim=64, n_layers=2, n_heads=4, vocab_size=128, multiple_of=32, max_seq_len=32,
    rope_theta=10000.0, qkv_bias=True, out_bias=True, attention="mla", q_lora_rank=24,
    kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
    rope_scaling=RopeScaling(kind="yarn", factor=4.0, original_max_seq_len=8, mscale=0.8,
                             mscale_all_dim=1.0))


def test_mla_tensor_parallel_needs_tp_to_divide_the_heads():
    with pytest.raises(ConfigError, match="parallel.tp = 3 does not divide the model's n_heads"):
        check_tp(MLA_ARGS, 3, 64)
    check_tp(MLA_ARGS, 4, 64)


def mla_model(q_lora_rank: int | None) -> Transformer:
    """MLA_ARGS initialised, its biases and norm weights drawn (the same on every rank)."""
    model = Transformer(dataclasses.replace(MLA_ARGS, q_lora_rank=q_lora_rank))
    model.init_weights(seed=0)
    return with_biases_and_norms_drawn(model)


def mla_tp_worker(rank: int, q_lora_rank: int | None, out: str) -> None:
    model = mla_model(q_lora_rank)
    apply_tp(model, init_device_mesh("cpu", (2,)), loss_parallel=False)
    logits, grads = logits_and_grads(model)
    if rank == 0:
        torch.save({"logits": logits, "grads": grads}, out)


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_mla_tensor_parallel_matches_one_process(tmp_path, q_lora_rank):
    # Heads split at wq / wq_b and wkv_b, the down-projections and latent norms whole on each
    # rank, the shared rotary key's gradient summed over the ranks. fp32: the two ranks' partial
    # sums differ from one process's only in order. Logits and the gradient norm within 1e-5;
    # each gradient within 1e-4 of its largest entry (small sums of terms that largely cancel).
    out = tmp_path / "tp.pt"
    on_two_gloo_ranks(mla_tp_worker, q_lora_rank, str(out))
    got = torch.load(out)
    logits, grads = logits_and_grads(mla_model(q_lora_rank))
    assert torch.allclose(got["logits"], logits, rtol=TOLERANCE, atol=TOLERANCE)
    assert got["grads"].keys() == grads.keys()
    norm = torch.stack([g.norm() for g in grads.values()]).norm()
    got_norm = torch.stack([g.norm() for g in got["grads"].values()]).norm()
    assert got_norm.item() == pytest.approx(norm.item(), rel=TOLERANCE)
    for name, want in grads.items():
        error = (got["grads"][name] - want).abs().max()
        assert error <= 1e-4 * want.abs().max(), name


def test_deepseek_routing_without_mla_is_refused_by_the_hugging_face_export_in_one_line():
    # DeepSeek-V3 exports (tests/test_hf_deepseek.py); its router on grouped-query attention
    # is no Hugging Face architecture's.
    from dtrain.hf_config import hf_config_from_args

    assert hf_config_from_args(MLA_ARGS)["architectures"] == ["DeepseekV3ForCausalLM"]
    routed = dataclasses.replace(MLA_ARGS, attention="gqa", n_experts=4, moe_top_k=2,
                                 moe_router="sigmoid", moe_n_group=2, moe_topk_group=1)
    with pytest.raises(ConfigError, match=r"^group-limited routing or a routed scaling factor "
                                          "without multi-head latent attention"):
        hf_config_from_args(routed)
