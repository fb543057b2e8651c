"""Hugging Face ``config.json`` <-> ``LlamaArgs`` for the seven decoder families dtrain's
``Transformer`` computes exactly: LLaMA (any ``attention_bias``, explicit ``head_dim``), Mistral
(no sliding window), Mixtral (softmax top-k router), Qwen2 (q, k, v biases), Qwen3 (per-head
q/k RMSNorm), Qwen3-MoE (Qwen3's attention; softmax top-k experts, renormalised or not, in
every block or in those ``decoder_sparse_step`` and ``mlp_only_layers`` leave sparse) and
DeepSeek-V3 (multi-head latent attention, dense first blocks, the group-limited sigmoid router
with expert bias and routed scaling, shared experts, multi-token prediction; its tensors are
``dtrain.hf_deepseek``'s).

Both layouts of the RoPE settings are read: transformers 4's ``rope_theta`` with a
``rope_scaling`` dict, and transformers 5's single ``rope_parameters`` dict holding
``rope_theta`` too. The inverse writes transformers 4's layout, which transformers 5 also reads.
Whatever dtrain would compute differently is refused with one line naming it: sliding-window
attention, biases in the MLP, activations other than SiLU, RoPE scalings other than Llama 3.1's
and YaRN, partial rotary embeddings.
"""

from __future__ import annotations

import math

from dtrain.config import ConfigError
from dtrain.models.llama import LlamaArgs, RopeScaling, rope_attention_factor

LLAMA, MISTRAL, MIXTRAL = "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM"
QWEN2, QWEN3, QWEN3_MOE = "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"
DEEPSEEK_V3 = "DeepseekV3ForCausalLM"
ARCHITECTURES = {LLAMA: "llama", MISTRAL: "mistral", MIXTRAL: "mixtral", QWEN2: "qwen2",
                 QWEN3: "qwen3", QWEN3_MOE: "qwen3_moe",
                 DEEPSEEK_V3: "deepseek_v3"}  # architectures[0] -> model_type
ROPE_TYPES = ("default", "llama3", "yarn")


def hf_architecture(config: dict) -> str:
    """The config's architecture (``architectures[0]``, else the one of its ``model_type``);
    raises ConfigError for any but the seven supported."""
    names = config.get("architectures") or []
    by_type = {model_type: name for name, model_type in ARCHITECTURES.items()}
    name = names[0] if names else by_type.get(config.get("model_type"))
    if name not in ARCHITECTURES:
        described = names[0] if names else f"model_type {config.get('model_type')!r}"
        raise ConfigError(f"config.json describes {described}: only {', '.join(ARCHITECTURES)} "
                          "checkpoints are converted")
    return name


def args_from_hf_config(config: dict) -> LlamaArgs:
    """``LlamaArgs`` for an HF ``config.json`` (a dict) of one of the seven architectures;
    raises ConfigError, one line, for a key dtrain's model cannot honour."""
    arch = hf_architecture(config)
    if arch == DEEPSEEK_V3:
        return deepseek_v3_args(config)
    missing = [key for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                               "intermediate_size", "vocab_size") if key not in config]
    if missing:
        raise ConfigError(f"config.json of {arch} lacks {', '.join(missing)}")
    _refuse_unsupported(config, arch)
    dim, heads = config["hidden_size"], config["num_attention_heads"]
    # Qwen3's config class defaults head_dim to 128, the others (Qwen3-MoE's too) to
    # hidden_size / heads.
    head_dim = config.get("head_dim") or (128 if arch == QWEN3 else dim // heads)
    bias = bool(config.get("attention_bias")) and arch in (LLAMA, QWEN3, QWEN3_MOE)
    max_seq_len = config.get("max_position_embeddings", 4096)
    theta, scaling = rope_from_hf(config, max_seq_len)
    return LlamaArgs(
        dim=dim, n_layers=config["num_hidden_layers"], n_heads=heads,
        n_kv_heads=config.get("num_key_value_heads") or heads,
        head_size=None if head_dim == dim // heads else head_dim,
        vocab_size=config["vocab_size"], ffn_hidden_size=config["intermediate_size"],
        norm_eps=config.get("rms_norm_eps", 1e-5 if arch == MIXTRAL else 1e-6),
        rope_theta=theta, rope_scaling=scaling, max_seq_len=max_seq_len,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=bias or arch == QWEN2, out_bias=bias, qk_norm=arch in (QWEN3, QWEN3_MOE),
        **_moe_from_hf(config, arch))


def _refuse_unsupported(config: dict, arch: str) -> None:
    """One-line ConfigError for a setting of ``config`` that dtrain's model does not compute."""
    if config.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ConfigError(f"config.json has hidden_act {config['hidden_act']!r}: dtrain's "
                          "feed-forward is SwiGLU (silu)")
    if config.get("mlp_bias"):
        raise ConfigError("config.json has mlp_bias true: dtrain's feed-forward has no biases")
    window = _sliding_window(config, arch)
    if window:
        raise ConfigError(f"config.json uses sliding-window attention (sliding_window {window}): "
                          "dtrain's attention is full causal; such checkpoints are not converted")
    if config.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"config.json has partial_rotary_factor "
                          f"{config['partial_rotary_factor']}: dtrain rotates whole heads")
    if arch == MIXTRAL and config.get("router_jitter_noise"):
        raise ConfigError(f"config.json has router_jitter_noise {config['router_jitter_noise']}: "
                          "dtrain's router adds no jitter; set it to 0 to train without it")


def _sliding_window(config: dict, arch: str) -> int | None:
    """The window of the layers that slide, or None where every layer attends to all earlier
    tokens, as transformers decides it."""
    window = config.get("sliding_window",
                        4096 if arch in (MISTRAL, QWEN2, QWEN3, QWEN3_MOE) else None)
    if not window or not config.get("use_sliding_window", arch in (MISTRAL, MIXTRAL)):
        return None
    if arch in (QWEN2, QWEN3):  # Qwen slides only from layer max_window_layers on
        layer_types = config.get("layer_types") or [
            "sliding_attention" if i >= config.get("max_window_layers", 28) else "full_attention"
            for i in range(config["num_hidden_layers"])]
        if "sliding_attention" not in layer_types:
            return None
    return window


def rope_from_hf(config: dict, max_seq_len: int) -> tuple[float, RopeScaling | None]:
    """RoPE's theta and scaling from transformers 4's keys or transformers 5's
    ``rope_parameters``."""
    params = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    if isinstance(params.get("full_attention"), dict):  # kept per layer type
        params = params["full_attention"]
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(f"config.json has RoPE type {kind!r}: only {', '.join(ROPE_TYPES)} "
                          "(Llama 3.1's scaling and YaRN) are supported")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"config.json has partial_rotary_factor "
                          f"{params['partial_rotary_factor']}: dtrain rotates whole heads")
    if kind == "default":
        return theta, None
    original = params.get("original_max_position_embeddings",
                          config.get("original_max_position_embeddings", max_seq_len))
    if kind == "llama3":
        return theta, RopeScaling(kind="llama3", factor=params["factor"],
                                  low_freq_factor=params["low_freq_factor"],
                                  high_freq_factor=params["high_freq_factor"],
                                  original_max_seq_len=original)
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    scaling = RopeScaling(
        kind="yarn", factor=params.get("factor") or max_seq_len / original,
        original_max_seq_len=original, beta_fast=params.get("beta_fast") or 32.0,
        beta_slow=params.get("beta_slow") or 1.0, truncate=params.get("truncate", True),
        # transformers uses the pair only when both are set (DeepSeek's attention factor)
        mscale=mscale if mscale and mscale_all_dim else 1.0,
        mscale_all_dim=mscale_all_dim if mscale and mscale_all_dim else 0.0)
    given = params.get("attention_factor")
    if given is not None and not math.isclose(given, rope_attention_factor(scaling)):
        raise ConfigError(f"config.json has YaRN attention_factor {given}, not the "
                          f"{rope_attention_factor(scaling):.6g} its factor and mscale give: "
                          "dtrain computes the attention factor from them")
    return theta, scaling


def _moe_from_hf(config: dict, arch: str) -> dict:
    """The MoE fields of ``LlamaArgs``: Mixtral's experts and softmax top-k router (every block
    MoE, top-k renormalised); Qwen3-MoE's (its sparse blocks, ``norm_topk_prob``); none for the
    dense architectures, and for a Qwen3-MoE config that leaves no block sparse."""
    if arch == MIXTRAL:
        return {"n_experts": config.get("num_local_experts", 8),
                "moe_top_k": config.get("num_experts_per_tok", 2),
                "moe_hidden_size": config["intermediate_size"], "moe_layers": None,
                "moe_router": "softmax", "moe_norm_topk": True, "moe_shared_hidden": 0,
                "moe_aux_loss_coeff": config.get("router_aux_loss_coef", 0.0)}
    if arch != QWEN3_MOE:
        return {}
    # transformers writes the count as num_local_experts, the published configs as num_experts
    n_experts = config.get("num_experts", config.get("num_local_experts", 128))
    sparse = _qwen3_moe_sparse_blocks(config) if n_experts else ()
    if not sparse:
        return {}
    return {"n_experts": n_experts, "moe_top_k": config.get("num_experts_per_tok", 8),
            "moe_hidden_size": config.get("moe_intermediate_size", 768),
            "moe_layers": None if len(sparse) == config["num_hidden_layers"] else sparse,
            "moe_router": "softmax", "moe_norm_topk": bool(config.get("norm_topk_prob", False)),
            "moe_shared_hidden": 0,
            "moe_aux_loss_coeff": config.get("router_aux_loss_coef", 0.001)}


def _qwen3_moe_sparse_blocks(config: dict) -> tuple[int, ...]:
    """The blocks a Qwen3-MoE config makes MoE, as transformers decides it: block i is, unless
    it is in ``mlp_only_layers``, when (i + 1) is a multiple of ``decoder_sparse_step``."""
    step = config.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ConfigError(f"config.json has decoder_sparse_step {step!r}: give a whole number "
                          ">= 1 (1: every block not in mlp_only_layers is MoE)")
    dense = set(config.get("mlp_only_layers") or ())
    return tuple(i for i in range(config["num_hidden_layers"])
                 if i not in dense and (i + 1) % step == 0)


def deepseek_v3_args(config: dict) -> LlamaArgs:
    """``LlamaArgs`` of a DeepSeek-V3 ``config.json`` (a dict; keys it lacks take
    ``DeepseekV3Config``'s defaults): multi-head latent attention; dense SwiGLU feed-forwards in
    the first ``first_k_dense_replace`` blocks (every block where that covers them all) and
    mixtures of experts after them, with the sigmoid router and its expert bias, group-limited
    routing, routed scaling and a shared expert ``n_shared_experts * moe_intermediate_size``
    wide; the sequence-wise balance loss (``seq_aux``, ``aux_loss_alpha``); and
    ``num_nextn_predict_layers`` multi-token-prediction depths. Raises ConfigError, one line,
    for a setting dtrain's model does not compute."""
    _refuse_deepseek_unsupported(config)
    n_layers = config.get("num_hidden_layers", 61)
    first_dense = config.get("first_k_dense_replace", 3)
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
        n_experts=config.get("n_routed_experts", 256) if first_dense < n_layers else 0,
        moe_layers=tuple(range(first_dense, n_layers)) if 0 < first_dense < n_layers else None,
        moe_top_k=config.get("num_experts_per_tok", 8), moe_hidden_size=moe_hidden,
        moe_router="sigmoid", moe_norm_topk=True,
        moe_shared_hidden=(config.get("n_shared_experts", 1) or 0) * moe_hidden,
        moe_n_group=config.get("n_group", 8) or 1, moe_topk_group=config.get("topk_group", 4) or 1,
        moe_routed_scale=config.get("routed_scaling_factor", 2.5),
        moe_aux_loss_coeff=config.get("aux_loss_alpha", 0.0),
        moe_aux_loss_type="seq_aux_loss" if config.get("seq_aux", True) else "aux_loss",
        mtp_depths=config.get("num_nextn_predict_layers", config.get("num_mtp_layers", 1)))


def _refuse_deepseek_unsupported(config: dict) -> None:
    """One-line ConfigError for a setting of a DeepSeek-V3 ``config`` that dtrain's model does
    not compute."""
    if config.get("model_type", "deepseek_v3") != "deepseek_v3":
        raise ConfigError(f"config.json describes model_type {config['model_type']!r}, not "
                          "deepseek_v3")
    if config.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ConfigError(f"config.json has hidden_act {config['hidden_act']!r}: dtrain's "
                          "feed-forward is SwiGLU (silu)")
    if not config.get("norm_topk_prob", True):
        raise ConfigError("config.json has norm_topk_prob false: dtrain's sigmoid router always "
                          "normalises the top-k weights")
    if config.get("scoring_func", "sigmoid") != "sigmoid":
        raise ConfigError(f"config.json has scoring_func {config['scoring_func']!r}: "
                          "DeepSeek-V3's router, and dtrain's, scores with a sigmoid")
    if config.get("moe_layer_freq", 1) != 1:
        raise ConfigError(f"config.json has moe_layer_freq {config['moe_layer_freq']}: "
                          "DeepSeek-V3's blocks are MoE from first_k_dense_replace on (1)")
    params = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if params.get("mscale_all_dim") and not params.get("mscale"):
        raise ConfigError("config.json has YaRN mscale_all_dim without mscale: dtrain takes the "
                          "softmax scale and the rotary attention factor from the pair")


def _deepseek_v3_keys(args: LlamaArgs) -> dict:
    """The keys of a DeepSeek-V3 config.json that ``hf_config_from_args`` does not write for
    every architecture, as the published config has them: ``q_lora_rank`` null for one query
    projection, ``first_k_dense_replace`` the dense blocks (all of them without experts),
    ``rope_interleave`` true (dtrain's rotary layout is DeepSeek's own, written as it is)."""
    dense = [i for i in range(args.n_layers) if not args.is_moe_layer(i)]
    return {
        "num_key_value_heads": args.n_heads, "attention_bias": args.qkv_bias,
        "attention_dropout": 0.0, "q_lora_rank": args.q_lora_rank,
        "kv_lora_rank": args.kv_lora_rank, "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim, "v_head_dim": args.v_head_dim,
        "rope_interleave": True, "first_k_dense_replace": len(dense), "moe_layer_freq": 1,
        "n_routed_experts": args.n_experts, "num_experts_per_tok": args.moe_top_k,
        "moe_intermediate_size": args.expert_dim,
        "n_shared_experts": args.moe_shared_hidden // args.expert_dim,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
        "n_group": args.moe_n_group, "topk_group": args.moe_topk_group,
        "routed_scaling_factor": args.moe_routed_scale, "aux_loss_alpha": args.moe_aux_loss_coeff,
        "seq_aux": args.moe_aux_loss_type == "seq_aux_loss", "ep_size": 1,
        "num_nextn_predict_layers": args.mtp_depths, "initializer_range": 0.02,
        "pretraining_tp": 1, "use_cache": True,
    }


def _refuse_export(what: str) -> ConfigError:
    """The one-line error of an export whose shape ``what`` no supported architecture has."""
    return ConfigError(f"{what}: no Hugging Face architecture among {', '.join(ARCHITECTURES)} "
                       "has this shape, so it is not exported")


def hf_architecture_of(args: LlamaArgs) -> str:
    """The HF architecture that computes the shape ``args``: DeepSeek-V3 with multi-head latent
    attention; with experts Qwen3-MoE (qk-norm) or Mixtral; else Qwen3 with qk-norm, Qwen2 with
    biases on q, k, v only, else LLaMA (Mistral where the hidden size is no multiple of the
    heads, which LLaMA's config refuses); raises ConfigError for a shape none of them has."""
    if args.attention == "mla":
        return _deepseek_architecture(args)
    if args.mtp_depths:
        raise _refuse_export(f"multi-token prediction ({args.mtp_depths} depths) without "
                             "multi-head latent attention")
    if args.n_experts:
        return _moe_architecture(args)
    if args.out_bias and not args.qkv_bias:
        raise _refuse_export("a bias on wo without biases on wq, wk, wv")
    if args.qk_norm:
        if args.qkv_bias != args.out_bias:
            raise _refuse_export("qk_norm with biases on q, k, v but not on wo")
        return QWEN3
    if args.qkv_bias and not args.out_bias:
        return QWEN2
    if args.dim % args.n_heads:
        if args.qkv_bias:
            raise _refuse_export(f"hidden size {args.dim} not divisible by {args.n_heads} "
                                 "heads, with attention biases")
        return MISTRAL
    return LLAMA


def _moe_architecture(args: LlamaArgs) -> str:
    """Qwen3-MoE for an MoE shape with qk-norm (any blocks MoE, top-k renormalised or not),
    Mixtral for one without (every block MoE, renormalised, no attention biases)."""
    if args.moe_n_group > 1 or args.moe_routed_scale != 1.0:
        raise _refuse_export("group-limited routing or a routed scaling factor without "
                             "multi-head latent attention (DeepSeek-V3 has all three)")
    if args.moe_router != "softmax" or args.moe_shared_hidden:
        raise _refuse_export("an MoE router other than a softmax top-k without shared expert "
                             "(Mixtral's and Qwen3-MoE's)")
    if args.qk_norm:
        if args.qkv_bias != args.out_bias:
            raise _refuse_export("qk_norm with biases on q, k, v but not on wo")
        return QWEN3_MOE
    if args.qkv_bias or args.out_bias:
        raise _refuse_export("an MoE model with attention biases but no qk_norm")
    dense = [i for i in range(args.n_layers) if not args.is_moe_layer(i)]
    if dense:
        raise _refuse_export(f"dense blocks {dense} in an MoE model without qk_norm (Mixtral's "
                             "blocks are all MoE; Qwen3-MoE has qk_norm)")
    if not args.moe_norm_topk:
        raise _refuse_export("top-k router weights not renormalised without qk_norm (Mixtral "
                             "renormalises; Qwen3-MoE has qk_norm)")
    return MIXTRAL


def _deepseek_architecture(args: LlamaArgs) -> str:
    """DeepSeek-V3 for a shape with multi-head latent attention: one bias setting for the
    down-projections and wo, and with experts a sigmoid router, a shared expert of whole
    experts' widths and the dense blocks first."""
    if args.qk_norm:
        raise _refuse_export("multi-head latent attention with qk_norm")
    if args.qkv_bias != args.out_bias:
        raise _refuse_export("multi-head latent attention with biases on wq_a and wkv_a but not "
                             "on wo, or the reverse (DeepSeek-V3's attention_bias sets all three)")
    if not args.n_experts:
        return DEEPSEEK_V3
    if args.moe_router != "sigmoid":
        raise _refuse_export("multi-head latent attention with a softmax router (DeepSeek-V3's "
                             "is sigmoid)")
    if args.moe_shared_hidden % args.expert_dim:
        raise _refuse_export(f"a shared expert {args.moe_shared_hidden} wide, no multiple of the "
                             f"experts' {args.expert_dim} (DeepSeek-V3's n_shared_experts)")
    dense = [i for i in range(args.n_layers) if not args.is_moe_layer(i)]
    if dense != list(range(len(dense))):
        raise _refuse_export(f"dense blocks {dense} not all before the MoE ones (DeepSeek-V3's "
                             "first_k_dense_replace)")
    return DEEPSEEK_V3


def hf_config_from_args(args: LlamaArgs) -> dict:
    """The HF ``config.json`` (a dict) of the shape ``args``, for the architecture
    ``hf_architecture_of`` picks; ``transformers.AutoConfig`` reads it."""
    arch = hf_architecture_of(args)
    config = {
        "architectures": [arch], "model_type": ARCHITECTURES[arch],
        "hidden_size": args.dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "intermediate_size": args.ffn_dim,
        "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta, "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings, "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if arch == DEEPSEEK_V3:
        config.update(_deepseek_v3_keys(args))
    else:
        config.update({"num_key_value_heads": args.kv_heads, "head_dim": args.head_dim})
    if arch in (LLAMA, QWEN3, QWEN3_MOE):
        config["attention_bias"] = args.qkv_bias
    if arch == LLAMA:
        config["mlp_bias"] = False
    if arch in (MISTRAL, MIXTRAL, QWEN2, QWEN3, QWEN3_MOE):
        config["sliding_window"] = None
    if arch in (QWEN2, QWEN3, QWEN3_MOE):
        config["use_sliding_window"] = False
    if arch in (QWEN2, QWEN3):
        config["max_window_layers"] = args.n_layers
    config.update(_moe_to_hf(args, arch))
    if args.rope_scaling is not None:
        config["rope_scaling"] = _rope_to_hf(args.rope_scaling)
    return config


def _moe_to_hf(args: LlamaArgs, arch: str) -> dict:
    """The MoE keys of the config.json of architecture ``arch`` (none for dense ones)."""
    if arch == MIXTRAL:
        return {"intermediate_size": args.expert_dim, "num_local_experts": args.n_experts,
                "num_experts_per_tok": args.moe_top_k,
                "router_aux_loss_coef": args.moe_aux_loss_coeff, "router_jitter_noise": 0.0}
    if arch != QWEN3_MOE:
        return {}
    # intermediate_size stays the dense blocks' width, and mlp_only_layers lists those blocks
    return {"num_experts": args.n_experts, "num_experts_per_tok": args.moe_top_k,
            "moe_intermediate_size": args.expert_dim, "norm_topk_prob": args.moe_norm_topk,
            "router_aux_loss_coef": args.moe_aux_loss_coeff, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(args.n_layers) if not args.is_moe_layer(i)]}


def _rope_to_hf(s: RopeScaling) -> dict:
    """transformers' ``rope_scaling`` dict of a dtrain ``RopeScaling``."""
    if s.kind == "llama3":
        return {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_seq_len}
    yarn = {"rope_type": "yarn", "factor": s.factor, "beta_fast": s.beta_fast,
            "beta_slow": s.beta_slow, "mscale": s.mscale, "mscale_all_dim": s.mscale_all_dim,
            "original_max_position_embeddings": s.original_max_seq_len}
    if not s.truncate:  # transformers' default, and a key older versions do not know
        yarn["truncate"] = False
    return yarn
