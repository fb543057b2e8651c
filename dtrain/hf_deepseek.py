"""Hugging Face DeepSeek-V3 (``DeepseekV3ForCausalLM``) checkpoints in dtrain's terms: the
tensor names, the rotary rows of checkpoints laid out for ``rotate_half``, and the
multi-token-prediction (MTP) layers. ``dtrain.hf_checkpoint`` reads and writes the tensors with
them; config.json <-> ``LlamaArgs`` is ``dtrain.hf_config``'s (``deepseek_v3_args``, named here
too).

The model is dtrain's ``Transformer`` with multi-head latent attention (``attention="mla"``,
``dtrain.models.mla``), dense SwiGLU feed-forwards in the first ``first_k_dense_replace`` blocks
and mixtures of experts after them: a sigmoid router with ``e_score_correction_bias`` as its
expert bias, group-limited routing (``n_group``, ``topk_group``), the weights normalised and
multiplied by ``routed_scaling_factor``, and a shared expert ``n_shared_experts *
moe_intermediate_size`` wide that every token takes (one SwiGLU, as dtrain's ``shared_expert``).

Names map one to one: ``self_attn.q_proj`` / ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` /
``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` / ``kv_b_proj`` / ``o_proj`` <-> ``attention.wq`` /
``wq_a`` / ``q_norm`` / ``wq_b`` / ``wkv_a`` / ``kv_norm`` / ``wkv_b`` / ``wo``;
``mlp.gate.e_score_correction_bias`` <-> ``feed_forward.router.expert_bias``; the router
(``mlp.gate``) and the experts are laid out as Qwen3-MoE's: fused in memory
(``mlp.experts.gate_up_proj`` / ``down_proj``, transformers 5) or one tensor each
(``mlp.experts.<e>.gate_proj.weight``, the checkpoint files, and what an export writes). RoPE
needs no permutation for ``rope_interleave`` (the default, DeepSeek's layout: dtrain rotates the
same interleaved pairs; an export writes it); without it, transformers rotates halves
(``rotate_half``), and the rotary rows are interleaved at import: each head's last
``qk_rope_head_dim`` rows of ``wq`` / ``wq_b``, and the last ``qk_rope_head_dim`` rows of
``wkv_a`` (and of its bias).

MTP depth k (``mtp.<k>`` in dtrain, ``dtrain.models.mtp``) is the checkpoint's layer
``model.layers.<num_hidden_layers + k>``: ``enorm``, ``hnorm``, ``eh_proj`` <-> ``proj``,
``shared_head.norm`` <-> ``norm``, and its block's tensors under a block's names. The layer also
holds ``embed_tokens`` and ``shared_head.head``, copies of the model's embedding and output
layer, which dtrain's depths share: an import checks they are copies, an export writes them.
transformers' model builds ``num_hidden_layers`` blocks and leaves these layers alone, so a
checkpoint it saved has none whatever ``num_nextn_predict_layers`` says: it imports without MTP.
"""

from __future__ import annotations

import dataclasses

import torch

from dtrain.config import ConfigError
from dtrain.hf_config import deepseek_v3_args  # the config's shape, with the other families'
from dtrain.models.llama import LlamaArgs

__all__ = ["LAYER_NAMES", "check_mtp_copies", "deepseek_v3_args", "interleave_rotary_rows",
           "mtp_copies", "mtp_held", "top_names"]

LAYER_NAMES = {  # dtrain suffix -> HF suffix, inside a block (layers.<i>. or mtp.<k>.block.)
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
    "feed_forward.router.expert_bias": "mlp.gate.e_score_correction_bias",
}
_TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight",
              "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_MTP_NAMES = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
              "proj.weight": "eh_proj.weight", "norm.weight": "shared_head.norm.weight"}
# An MTP layer's copies of the model's tensors: its name -> the model's (dtrain's) name.
_MTP_COPIES = {"embed_tokens.weight": "tok_embeddings.weight",
               "shared_head.head.weight": "output.weight"}


def _mtp_layer(args: LlamaArgs, k: int) -> str:
    """The checkpoint's prefix of MTP depth ``k``'s layer."""
    return f"model.layers.{args.n_layers + k}"


def top_names(args: LlamaArgs) -> dict[str, str]:
    """dtrain name -> HF name of every tensor outside a block: the model's embedding, final norm
    and output layer, and each MTP depth's norms and projection."""
    depths = {f"mtp.{k}.{ours}": f"{_mtp_layer(args, k)}.{theirs}"
              for k in range(args.mtp_depths) for ours, theirs in _MTP_NAMES.items()}
    return {**_TOP_NAMES, **depths}


def mtp_held(hf: dict[str, torch.Tensor], args: LlamaArgs) -> LlamaArgs:
    """``args`` without MTP depths where the checkpoint ``hf`` holds none of their layers (a
    checkpoint transformers saved), else ``args``."""
    held = any(name.startswith(f"{_mtp_layer(args, 0)}.") for name in hf)
    return args if held or not args.mtp_depths else dataclasses.replace(args, mtp_depths=0)


def check_mtp_copies(hf: dict[str, torch.Tensor], args: LlamaArgs) -> None:
    """ConfigError, one line, where an MTP layer of the checkpoint ``hf`` holds an
    ``embed_tokens`` or ``shared_head.head`` that differs from the model's embedding or output
    layer: dtrain's depths share the model's, so a different copy cannot be imported."""
    model = {"tok_embeddings.weight": "model.embed_tokens.weight",
             "output.weight": _TOP_NAMES["tok_embeddings.weight" if args.tie_embeddings
                                         else "output.weight"]}
    for k in range(args.mtp_depths):
        for copy, name in _MTP_COPIES.items():
            key = f"{_mtp_layer(args, k)}.{copy}"
            if key in hf and model[name] in hf and not torch.equal(hf[key], hf[model[name]]):
                raise ConfigError(
                    f"the HF checkpoint's {key} differs from {model[name]}: dtrain's "
                    "multi-token prediction shares the model's embedding and output layer; copy "
                    f"{model[name]} into {key} to import it")


def mtp_copies(ours: dict[str, torch.Tensor], args: LlamaArgs) -> dict[str, torch.Tensor]:
    """Each MTP layer's ``embed_tokens`` and ``shared_head.head`` (HF name -> tensor), copies
    of the embedding and output layer of dtrain's state dict ``ours`` (clones: safetensors
    stores no shared memory)."""
    return {f"{_mtp_layer(args, k)}.{copy}": ours[name].clone()
            for k in range(args.mtp_depths) for copy, name in _MTP_COPIES.items()}


def interleave_rotary_rows(w: torch.Tensor, suffix: str, args: LlamaArgs) -> torch.Tensor:
    """``w`` with its rotary rows in interleaved pairs where ``suffix`` (the name inside a
    block) names a tensor that has them in halves (``rotate_half``): each head's last
    qk_rope_head_dim rows of wq / wq_b, the last qk_rope_head_dim rows of wkv_a and its bias."""
    if suffix in ("attention.wq.weight", "attention.wq_b.weight"):
        heads = w.unflatten(0, (args.n_heads, -1))
    elif suffix in ("attention.wkv_a.weight", "attention.wkv_a.bias"):
        heads = w.unsqueeze(0)
    else:
        return w
    rope = args.qk_rope_head_dim
    rotary = heads[:, -rope:].unflatten(1, (2, rope // 2)).transpose(1, 2).flatten(1, 2)
    return torch.cat([heads[:, :-rope], rotary], dim=1).reshape(w.shape)
