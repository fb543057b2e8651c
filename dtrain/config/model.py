"""The [model] section: the model's preset and every key of its shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dtrain.config.fields import ranged, unset_or


@dataclass
class ModelConfig:
    name: str = "llama3_debug"
    """Model preset (``dtrain.models.presets``): the defaults of the shape keys below."""
    hf_config: str = ""
    """A Hugging Face model folder or its config.json (LlamaForCausalLM, MistralForCausalLM,
    MixtralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM): the shape's
    defaults come from it instead of the preset ``name``; the shape keys below still replace
    them."""
    n_layers: int = ranged(0, lambda v: v >= 0, "an integer >= 0")
    """Number of transformer blocks (Megatron's --num-layers; 0 keeps the preset's)."""
    vocab_size: int = ranged(0, lambda v: v >= 0, "an integer >= 0")
    """Vocabulary rows (0 keeps the preset's; padded to data.vocab_size_divisible_by x tp, and
    at least the tokenizer's)."""
    hidden_size: int | None = ranged(None, unset_or(lambda v: v >= 1), "an integer >= 1")
    """Width of the residual stream (Megatron's --hidden-size; unset: the preset's)."""
    n_heads: int | None = ranged(None, unset_or(lambda v: v >= 1), "an integer >= 1")
    """Query heads (--num-attention-heads)."""
    n_kv_heads: int | None = ranged(None, unset_or(lambda v: v >= 1), "an integer >= 1")
    """Key/value heads (--num-query-groups): n_heads for multi-head attention, fewer for GQA,
    1 for MQA; must divide n_heads."""
    head_dim: int | None = ranged(None, unset_or(lambda v: v >= 2 and v % 2 == 0),
                                  "an even integer >= 2")
    """Each head's width (--kv-channels); unset: hidden_size / n_heads."""
    ffn_hidden_size: int | None = ranged(None, unset_or(lambda v: v >= 1), "an integer >= 1")
    """The feed-forward's width (--ffn-hidden-size); unset: the preset's, or Llama's rule."""
    ffn_dim_multiplier: float | None = ranged(None, unset_or(lambda v: v > 0), "a number > 0")
    """Llama's rule: 8/3 x hidden_size x this, rounded up to multiple_of."""
    multiple_of: int | None = ranged(None, unset_or(lambda v: v >= 1), "an integer >= 1")
    """Llama's rule: the feed-forward width is rounded up to a multiple of this."""
    norm_eps: float | None = ranged(None, unset_or(lambda v: 0 < v < 1), "a number in (0, 1)")
    """RMSNorm's epsilon (--norm-epsilon)."""
    rope_theta: float | None = ranged(None, unset_or(lambda v: v > 0), "a number > 0")
    """RoPE's base (--rotary-base)."""
    rope_scaling: Literal["preset", "none", "llama3", "yarn"] = "preset"
    """RoPE scaling for long context: none, Llama 3.1's (llama3) or YaRN (rope_* keys below)."""
    rope_scaling_factor: float | None = ranged(None, unset_or(lambda v: v >= 1), "a number >= 1")
    """llama3 and yarn: how much longer the context is than rope_original_max_seq_len."""
    rope_original_max_seq_len: int | None = ranged(None, unset_or(lambda v: v >= 1),
                                                   "an integer >= 1")
    """llama3 and yarn: the context the model was trained with before scaling."""
    rope_low_freq_factor: float | None = ranged(None, unset_or(lambda v: v > 0), "a number > 0")
    """llama3: wavelengths above original / this are scaled fully."""
    rope_high_freq_factor: float | None = ranged(None, unset_or(lambda v: v > 0), "a number > 0")
    """llama3: wavelengths below original / this are not scaled."""
    rope_yarn_beta_fast: float | None = ranged(None, unset_or(lambda v: v > 0), "a number > 0")
    """yarn: rotations of the fastest frequencies left unscaled (default 32)."""
    rope_yarn_beta_slow: float | None = ranged(None, unset_or(lambda v: v > 0), "a number > 0")
    """yarn: rotations below which frequencies are scaled fully (default 1)."""
    max_seq_len: int | None = ranged(None, unset_or(lambda v: v >= 1), "an integer >= 1")
    """The longest sequence (--max-position-embeddings): the RoPE table's length."""
    tie_embeddings: bool | None = None
    """The output layer shares the token embedding's table (Megatron: unless --untie-...)."""
    qkv_bias: bool | None = None
    """Biases on the query, key and value projections (Qwen2; --add-qkv-bias)."""
    out_bias: bool | None = None
    """A bias on the attention's output projection."""
    qk_norm: bool | None = None
    """RMSNorm of each head's queries and keys before RoPE (Qwen3; --qk-layernorm)."""
    n_experts: int | None = ranged(None, unset_or(lambda v: v >= 0), "an integer >= 0")
    """MoE: routed experts per MoE layer (--num-experts; 0: a dense model)."""
    moe_top_k: int | None = ranged(None, unset_or(lambda v: v >= 1), "an integer >= 1")
    """MoE: experts each token is routed to (--moe-router-topk)."""
    moe_hidden_size: int | None = ranged(None, unset_or(lambda v: v >= 1), "an integer >= 1")
    """MoE: each expert's feed-forward width (--moe-ffn-hidden-size)."""
    moe_shared_hidden: int | None = ranged(None, unset_or(lambda v: v >= 0), "an integer >= 0")
    """MoE: width of a shared expert every token also takes (0: none)."""
    moe_layer_freq: int | None = ranged(None, unset_or(lambda v: v >= 1), "an integer >= 1")
    """MoE: every this-many-th block from block 0 is MoE, the others dense (--moe-layer-freq)."""
    moe_first_dense_layers: int | None = ranged(None, unset_or(lambda v: v >= 0),
                                                "an integer >= 0")
    """MoE: the first this-many blocks are dense (DeepSeek's first_k_dense_replace)."""
    moe_n_group: int | None = ranged(None, unset_or(lambda v: v >= 1), "an integer >= 1")
    """MoE, sigmoid router: DeepSeek-V3's expert groups (n_group; 1: no groups)."""
    moe_topk_group: int | None = ranged(None, unset_or(lambda v: v >= 1), "an integer >= 1")
    """MoE: each token takes its experts from its best this-many groups (topk_group)."""
    moe_routed_scale: float | None = ranged(None, unset_or(lambda v: v > 0), "a number > 0")
    """MoE: a factor on the routed experts' weights (routed_scaling_factor)."""
    moe_aux_loss_type: Literal["preset", "aux_loss", "seq_aux_loss"] = "preset"
    """MoE: the load-balancing loss over each micro-batch's tokens (aux_loss) or over each
    sequence's (seq_aux_loss, DeepSeek-V3's); Megatron's --moe-router-load-balancing-type."""
    mtp_depths: int | None = ranged(None, unset_or(lambda v: v >= 0), "an integer >= 0")
    """Multi-token prediction: extra blocks each predicting one token further (DeepSeek-V3: 1;
    --mtp-num-layers); 0: none."""
    mtp_loss_weight: float | None = ranged(None, unset_or(lambda v: v >= 0), "a number >= 0")
    """Multi-token prediction: weight of the depths' mean loss in the gradient
    (--mtp-loss-scaling-factor); the logged training loss stays the next-token loss."""
    attention: Literal["preset", "gqa", "mla"] = "preset"
    """gqa: n_kv_heads key/value heads; mla: DeepSeek-V3's latent attention (keys below)."""
    q_lora_rank: int | None = ranged(None, unset_or(lambda v: v >= 0), "an integer >= 0")
    """mla: queries through a latent of this width (0: one query projection)."""
    kv_lora_rank: int | None = ranged(None, unset_or(lambda v: v >= 1), "an integer >= 1")
    """mla: the latent width keys and values are expanded from."""
    qk_nope_head_dim: int | None = ranged(None, unset_or(lambda v: v >= 1), "an integer >= 1")
    """mla: each head's query/key channels without RoPE."""
    qk_rope_head_dim: int | None = ranged(None, unset_or(lambda v: v >= 2 and v % 2 == 0),
                                          "an even integer >= 2")
    """mla: each head's query/key channels with RoPE (the key's shared by the heads)."""
    v_head_dim: int | None = ranged(None, unset_or(lambda v: v >= 1), "an integer >= 1")
    """mla: each head's value width."""
    attention_backend: Literal["auto", "cudnn", "flash", "efficient", "math"] = "auto"
    """SDPA kernel; auto prefers cuDNN, then flash, then memory-efficient, then math."""
    triton_kernels: bool = True
    """On CUDA, RoPE and the cross-entropy loss through dtrain's Triton kernels
    (``dtrain.kernels``: whole-row loads, one pass over the logits each way), where Inductor's
    generated code ran them at a third of the memory's speed; false: PyTorch's ops (compiled
    where compile is on). The CPU always runs PyTorch's."""
    moe_aux_loss_coeff: float = ranged(-1.0, lambda v: v >= 0 or v == -1, "-1 or a number >= 0")
    """MoE presets: weight of the load-balancing loss, summed over layers (-1 keeps the
    preset's; the logged loss stays the plain LM loss)."""
    moe_z_loss_coeff: float = ranged(-1.0, lambda v: v >= 0 or v == -1, "-1 or a number >= 0")
    """MoE presets: weight of the router z-loss, summed over layers (-1 keeps the preset's)."""
    moe_capacity_factor: float = ranged(0.0, lambda v: v >= 0, "a number >= 0 (0 = dropless)")
    """MoE presets: 0 is dropless; else each expert takes at most capacity_factor x tokens x
    top_k / experts assignments per forward and drops the rest."""
    moe_router: Literal["preset", "softmax", "sigmoid"] = "preset"
    """MoE presets: router scores; softmax top-k (Mixtral) or sigmoid with an expert bias
    updated after each step for balance (DeepSeek-V3, aux-loss-free)."""
    moe_bias_update_rate: float = ranged(0.001, lambda v: v >= 0, "a number >= 0")
    """MoE with sigmoid router: step of the expert-bias update per optimizer step."""
    moe_gemm: Literal["auto", "grouped", "loop"] = "auto"
    """MoE expert compute: grouped GEMM (torch._grouped_mm), a loop over experts, or auto
    (grouped for bf16 on CUDA sm90+, else the loop)."""
    cast_weights_once_per_step: bool = True
    """bf16 compute on fp32 weights whole on each rank (no FSDP nor pipeline), with gradient
    accumulation: cast the linear layers' weights to bf16 once per optimizer step, for every
    micro-batch (one copy for the step: 2 bytes a parameter), and add each micro-batch's weight
    gradients into the fp32 gradients in place, the token embedding's only for the rows its
    tokens read (``dtrain.step_weights``)."""
    moe_cast_weights_once_per_step: bool = True
    """MoE with the grouped GEMM (or FP8 experts), expert weights whole on each rank (no FSDP,
    TP nor EP): cast the stacked expert weights to the compute dtype (bf16 or FP8) once per
    optimizer step, for every micro-batch (one copy of them for the step: 2 bytes a parameter),
    and add each micro-batch's weight gradients into the fp32 gradients in place."""
