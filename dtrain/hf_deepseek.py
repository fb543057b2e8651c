"""Hugging Face DeepSeek-V3 (``DeepseekV3ForCausalLM``) -> dtrain: ``LlamaArgs`` from its
``config.json`` and dtrain's state dict from its tensors.

The model is dtrain's ``Transformer`` with multi-head latent attention (``attention="mla"``,
``dtrain.models.mla``), dense SwiGLU feed-forwards in the first ``first_k_dense_replace`` blocks
and mixtures of experts after them: a sigmoid router with ``e_score_correction_bias`` as its
expert bias, group-limited routing (``n_group``, ``topk_group``), the weights normalised and
multiplied by ``routed_scaling_factor``, and a shared expert ``n_shared_experts *
moe_intermediate_size`` wide that every token takes (one SwiGLU, as dtrain's ``shared_expert``).

Names map one to one: ``self_attn.q_proj`` / ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` /
``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` / ``kv_b_proj`` / ``o_proj`` <-> ``attention.wq`` /
``wq_a`` / ``q_norm`` / ``wq_b`` / ``wkv_a`` / ``kv_norm`` / ``wkv_b`` / ``wo``;
``mlp.gate`` <-> ``feed_forward.router.gate``; the experts are read fused
(``mlp.experts.gate_up_proj`` / ``down_proj``, transformers 5 in memory) or one tensor each
(``mlp.experts.<e>.gate_proj.weight``, the checkpoint files). RoPE needs no permutation for
``rope_interleave`` (the default, DeepSeek's layout: dtrain rotates the same interleaved pairs);
without it, transformers rotates halves (``rotate_half``), and the rotary rows are interleaved
at import: each head's last ``qk_rope_head_dim`` rows of ``wq`` / ``wq_b``, and the last
``qk_rope_head_dim`` rows of ``wkv_a`` (and of its bias). The multi-token-prediction layers past
``num_hidden_layers`` are not read.
"""

from __future__ import annotations

import torch

from dtrain.config import ConfigError
from dtrain.hf_checkpoint import hf_tensor, state_dict_from_hf
from dtrain.hf_config import rope_from_hf
from dtrain.models.llama import LlamaArgs

_LAYER_NAMES = {  # dtrain suffix -> HF suffix, inside layers.<i>.
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.wq_a.bias": "self_attn.q_a_proj.bias",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.wkv_a.bias": "self_attn.kv_a_proj_with_mqa.bias",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wo.bias": "self_attn.o_proj.bias",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"feed_forward.{prefix}{ours}.weight": f"mlp.{theirs_prefix}{theirs}_proj.weight"
       for prefix, theirs_prefix in (("", ""), ("shared_expert.", "shared_experts."))
       for ours, theirs in (("w1", "gate"), ("w2", "down"), ("w3", "up"))},
    "feed_forward.router.gate.weight": "mlp.gate.weight",
    "feed_forward.router.expert_bias": "mlp.gate.e_score_correction_bias",
}
_TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight",
              "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def deepseek_v3_args(config: dict) -> LlamaArgs:
    """``LlamaArgs`` of a DeepSeek-V3 ``config.json`` (a dict; keys it lacks take
    ``DeepseekV3Config``'s defaults); raises ConfigError, one line, for a setting dtrain's
    model does not compute."""
    _refuse_unsupported(config)
    n_layers = config.get("num_hidden_layers", 61)
    max_seq_len = config.get("max_position_embeddings", 4096)
    theta, scaling = rope_from_hf(config, max_seq_len)
    bias = bool(config.get("attention_bias", False))
    moe_hidden = config.get("moe_intermediate_size", 2048)
    return LlamaArgs(
        dim=config.get("hidden_size", 7168), n_layers=n_layers,
        n_heads=config.get("num_attention_heads", 128), vocab_size=config.get("vocab_size", 129280),
        ffn_hidden_size=config.get("intermediate_size", 18432),
        norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        max_seq_len=max_seq_len, tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=bias, out_bias=bias, attention="mla",
        q_lora_rank=config.get("q_lora_rank", 1536),
        kv_lora_rank=config.get("kv_lora_rank", 512),
        qk_nope_head_dim=config.get("qk_nope_head_dim", 128),
        qk_rope_head_dim=config.get("qk_rope_head_dim", 64),
        v_head_dim=config.get("v_head_dim", 128),
        n_experts=config.get("n_routed_experts", 256),
        moe_layers=tuple(range(config.get("first_k_dense_replace", 3), n_layers)),
        moe_top_k=config.get("num_experts_per_tok", 8), moe_hidden_size=moe_hidden,
        moe_router="sigmoid", moe_norm_topk=True,
        moe_shared_hidden=(config.get("n_shared_experts", 1) or 0) * moe_hidden,
        moe_n_group=config.get("n_group", 8) or 1, moe_topk_group=config.get("topk_group", 4) or 1,
        moe_routed_scale=config.get("routed_scaling_factor", 2.5))


def _refuse_unsupported(config: dict) -> None:
    """One-line ConfigError for a setting of ``config`` that dtrain's model does not compute."""
    if config.get("model_type", "deepseek_v3") != "deepseek_v3":
        raise ConfigError(f"config.json describes model_type {config['model_type']!r}, not "
                          "deepseek_v3")
    if config.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ConfigError(f"config.json has hidden_act {config['hidden_act']!r}: dtrain's "
                          "feed-forward is SwiGLU (silu)")
    if not config.get("norm_topk_prob", True):
        raise ConfigError("config.json has norm_topk_prob false: dtrain's sigmoid router always "
                          "normalises the top-k weights")
    params = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if params.get("mscale_all_dim") and not params.get("mscale"):
        raise ConfigError("config.json has YaRN mscale_all_dim without mscale: dtrain takes the "
                          "softmax scale and the rotary attention factor from the pair")


def from_deepseek_state_dict(hf: dict[str, torch.Tensor], args: LlamaArgs,
                             rope_interleave: bool = True) -> dict[str, torch.Tensor]:
    """HF DeepSeek-V3 tensor names and layouts -> dtrain's: every tensor of
    ``Transformer(args)``'s state dict, taken from ``hf``; ``rope_interleave`` is
    config.json's (False: the rotary rows are interleaved here). Raises ConfigError naming the
    first tensor ``hf`` lacks."""
    def convert(tensor: torch.Tensor, suffix: str) -> torch.Tensor:
        return tensor if rope_interleave else _interleave_rotary_rows(tensor, suffix, args)

    return state_dict_from_hf(
        hf, args, _TOP_NAMES, _LAYER_NAMES,
        skip=lambda suffix, i: suffix.startswith("feed_forward.experts."),  # stacked below
        convert=convert, experts=lambda i: _experts(hf, args, i), model="DeepSeek-V3 model")


def _tensor(hf: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    return hf_tensor(hf, key, "DeepSeek-V3 model")


def _interleave_rotary_rows(w: torch.Tensor, suffix: str, args: LlamaArgs) -> torch.Tensor:
    """``w`` with its rotary rows in interleaved pairs where ``suffix`` names a tensor that
    has them in halves (``rotate_half``): each head's last qk_rope_head_dim rows of wq / wq_b,
    the last qk_rope_head_dim rows of wkv_a and its bias."""
    if suffix in ("attention.wq.weight", "attention.wq_b.weight"):
        heads = w.unflatten(0, (args.n_heads, -1))
    elif suffix in ("attention.wkv_a.weight", "attention.wkv_a.bias"):
        heads = w.unsqueeze(0)
    else:
        return w
    rope = args.qk_rope_head_dim
    rotary = heads[:, -rope:].unflatten(1, (2, rope // 2)).transpose(1, 2).flatten(1, 2)
    return torch.cat([heads[:, :-rope], rotary], dim=1).reshape(w.shape)


def _experts(hf: dict[str, torch.Tensor], args: LlamaArgs, i: int) -> dict[str, torch.Tensor]:
    """Layer ``i``'s stacked experts ``[n_experts, ...]`` from the fused tensors or from one
    tensor per expert and matrix."""
    ours, theirs = f"layers.{i}.feed_forward.experts", f"model.layers.{i}.mlp.experts"
    if f"{theirs}.gate_up_proj" in hf:
        gate_up = hf[f"{theirs}.gate_up_proj"]
        return {f"{ours}.w1": gate_up[:, :args.expert_dim],
                f"{ours}.w3": gate_up[:, args.expert_dim:],
                f"{ours}.w2": _tensor(hf, f"{theirs}.down_proj")}
    return {f"{ours}.{w}": torch.stack([_tensor(hf, f"{theirs}.{e}.{proj}_proj.weight")
                                        for e in range(args.n_experts)])
            for w, proj in (("w1", "gate"), ("w2", "down"), ("w3", "up"))}
