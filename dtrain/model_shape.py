"""The model's shape from the ``[model]`` section: a preset (``model.name``) or a Hugging Face
config (``model.hf_config``) gives every field's default, and each shape key that is set
replaces its field, so any Llama-family shape trains, presets being only named defaults.

``model_args_of`` builds the ``LlamaArgs``; ``check_shape`` cross-checks them (heads divide,
KV heads divide heads, the MoE settings agree), each problem one line naming the key and the
fix. The checks of a layout against the shape (tp and cp dividing what they split) stay with
their parallelisms (``dtrain.checks`` calls both). The dry run and the planner read the shape
through the same function.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from dtrain.config import ConfigError, ModelConfig
from dtrain.models import LlamaArgs, model_args
from dtrain.models.llama import RopeScaling

# [model] key -> LlamaArgs field, where the names differ (else the same name).
FIELDS = {"hidden_size": "dim", "head_dim": "head_size"}
SHAPE_KEYS = ("hidden_size", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden_size",
              "ffn_dim_multiplier", "multiple_of", "norm_eps", "rope_theta", "max_seq_len",
              "tie_embeddings", "qkv_bias", "out_bias", "qk_norm", "n_experts", "moe_top_k",
              "moe_hidden_size", "moe_shared_hidden", "moe_n_group", "moe_topk_group",
              "moe_routed_scale", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim", "mtp_depths", "mtp_loss_weight")
# The published defaults of each scaling, where neither the key nor the base shape sets one.
ROPE_DEFAULTS = {"llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_seq_len": 8192},
                 "yarn": {"factor": 4.0, "original_max_seq_len": 4096, "beta_fast": 32.0,
                          "beta_slow": 1.0}}
ROPE_KEYS = {"rope_scaling_factor": "factor", "rope_original_max_seq_len": "original_max_seq_len",
             "rope_low_freq_factor": "low_freq_factor", "rope_high_freq_factor": "high_freq_factor",
             "rope_yarn_beta_fast": "beta_fast", "rope_yarn_beta_slow": "beta_slow"}


def hf_config_file(path: str) -> Path:
    """``model.hf_config``'s config.json (the path, or config.json inside the folder)."""
    file = Path(path).expanduser()
    file = file / "config.json" if file.is_dir() else file
    if not file.is_file():
        raise ConfigError(f"model.hf_config = {path!r}: no such file or folder with a "
                          f"config.json: give a Hugging Face model folder or its config.json")
    return file


def base_args(cfg: ModelConfig) -> LlamaArgs:
    """The shape's defaults: the Hugging Face config's where ``model.hf_config`` names one,
    else the preset's."""
    if not cfg.hf_config:
        return model_args(cfg.name)
    from dtrain.hf_checkpoint import args_from_hf_config

    file = hf_config_file(cfg.hf_config)
    try:
        config = json.loads(file.read_text())
    except ValueError as e:
        raise ConfigError(f"model.hf_config: {file} is not valid JSON ({e})") from None
    try:
        return args_from_hf_config(config)
    except (KeyError, ValueError) as e:
        raise ConfigError(f"model.hf_config: {file}: {e}") from None


def moe_overrides(cfg: ModelConfig) -> dict[str, object]:
    """``LlamaArgs`` fields an MoE model takes from the [model] section's MoE settings."""
    fields: dict[str, object] = {"moe_capacity_factor": cfg.moe_capacity_factor,
                                 "moe_gemm": cfg.moe_gemm}
    if cfg.moe_aux_loss_coeff >= 0:
        fields["moe_aux_loss_coeff"] = cfg.moe_aux_loss_coeff
    if cfg.moe_z_loss_coeff >= 0:
        fields["moe_z_loss_coeff"] = cfg.moe_z_loss_coeff
    if cfg.moe_router != "preset":
        fields["moe_router"] = cfg.moe_router
    if cfg.moe_aux_loss_type != "preset":
        fields["moe_aux_loss_type"] = cfg.moe_aux_loss_type
    return fields


def rope_scaling_of(cfg: ModelConfig, base: RopeScaling | None) -> RopeScaling | None:
    """``model.rope_scaling`` and its parameters over the base shape's scaling."""
    kind = (base.kind if base is not None else "none") if cfg.rope_scaling == "preset" \
        else cfg.rope_scaling
    if kind == "none":
        return None
    values = dict(ROPE_DEFAULTS[kind])
    if base is not None and base.kind == kind:
        values = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    values |= {field: getattr(cfg, key) for key, field in ROPE_KEYS.items()
               if getattr(cfg, key) is not None}
    values["kind"] = kind
    return RopeScaling(**values)


def moe_layers_of(cfg: ModelConfig, n_layers: int, base: tuple[int, ...] | None
                  ) -> tuple[int, ...] | None:
    """The blocks that are MoE layers: ``moe_layer_freq`` and ``moe_first_dense_layers`` over
    the base shape's (None: every block)."""
    if cfg.moe_layer_freq is None and cfg.moe_first_dense_layers is None:
        return base if base is None else tuple(i for i in base if i < n_layers)
    freq, first_dense = cfg.moe_layer_freq or 1, cfg.moe_first_dense_layers or 0
    layers = tuple(i for i in range(n_layers) if i >= first_dense and i % freq == 0)
    return None if len(layers) == n_layers else layers


def model_args_of(cfg: ModelConfig, microbatches: int = 1) -> LlamaArgs:
    """The ``LlamaArgs`` of the [model] section: the base shape (``base_args``) with every set
    key replacing its field. The MoE aux losses of each forward get a gradient scaled by
    1 / ``microbatches``, as the LM loss is averaged over the step's micro-batches."""
    args = base_args(cfg)
    shape = {FIELDS.get(key, key): getattr(cfg, key) for key in SHAPE_KEYS
             if getattr(cfg, key) is not None}
    if cfg.n_layers:
        shape["n_layers"] = cfg.n_layers
    if cfg.vocab_size:
        shape["vocab_size"] = cfg.vocab_size
    if cfg.q_lora_rank is not None:
        shape["q_lora_rank"] = cfg.q_lora_rank or None  # 0: one query projection
    if cfg.attention != "preset":
        shape["attention"] = cfg.attention
    if cfg.ffn_dim_multiplier is not None or cfg.multiple_of is not None:
        shape.setdefault("ffn_hidden_size", None)  # Llama's rule, not the base's width
    args = dataclasses.replace(args, **shape, attention_backend=cfg.attention_backend,
                               rope_kernel=cfg.triton_kernels)
    args = dataclasses.replace(args, rope_scaling=rope_scaling_of(cfg, args.rope_scaling),
                               moe_layers=moe_layers_of(cfg, args.n_layers, args.moe_layers))
    if args.n_experts:
        args = dataclasses.replace(args, **moe_overrides(cfg), moe_aux_grad_scale=1 / microbatches)
    return args


def describe_shape(cfg: ModelConfig) -> str | None:
    """The start-up summary's line of where the shape came from, where it is not a preset as
    it is (None then)."""
    keys = [key for key in (*SHAPE_KEYS, *ROPE_KEYS, "moe_layer_freq", "moe_first_dense_layers")
            if getattr(cfg, key) is not None]
    keys += [key for key in ("n_layers", "vocab_size") if getattr(cfg, key)]
    keys += ["rope_scaling"] if cfg.rope_scaling != "preset" else []
    keys += ["attention"] if cfg.attention != "preset" else []
    keys += ["moe_aux_loss_type"] if cfg.moe_aux_loss_type != "preset" else []
    keys += ["q_lora_rank"] if cfg.q_lora_rank is not None else []
    base = f"{cfg.hf_config} (model.hf_config)" if cfg.hf_config else f"preset {cfg.name}"
    if not keys and not cfg.hf_config:
        return None
    return f"shape: {base}" + (f", with {', '.join(keys)} set" if keys else "")


def check_shape(args: LlamaArgs) -> None:
    """Cross-checks of a shape; raises ConfigError naming the [model] keys and the fix."""
    if args.attention == "mla":
        check_latent_attention(args)
    elif args.head_size is None and args.dim % args.n_heads:
        raise ConfigError(f"model.hidden_size = {args.dim} is not divisible by model.n_heads = "
                          f"{args.n_heads}: change one, or set model.head_dim")
    if args.n_heads % args.kv_heads:
        raise ConfigError(f"model.n_kv_heads = {args.kv_heads} does not divide model.n_heads = "
                          f"{args.n_heads}: use a divisor of n_heads (1 for MQA)")
    if args.head_dim % 2:
        raise ConfigError(f"the head width {args.head_dim} (hidden_size / n_heads) is odd: "
                          f"RoPE rotates pairs of channels; set model.head_dim to an even width")
    if args.n_experts:
        check_groups(args)
        if args.moe_top_k > args.n_experts:
            raise ConfigError(f"model.moe_top_k = {args.moe_top_k} exceeds model.n_experts = "
                              f"{args.n_experts}: route each token to at most n_experts")
        if args.moe_layers is not None and not args.moe_layers:
            raise ConfigError("model.moe_layer_freq and model.moe_first_dense_layers leave no "
                              "MoE layer: lower them, or set model.n_experts = 0 for a dense "
                              "model")
    scaling = args.rope_scaling
    if scaling is not None and scaling.kind == "llama3" \
            and scaling.low_freq_factor >= scaling.high_freq_factor:
        raise ConfigError(f"model.rope_low_freq_factor = {scaling.low_freq_factor} must be "
                          f"below model.rope_high_freq_factor = {scaling.high_freq_factor}")


def check_latent_attention(args: LlamaArgs) -> None:
    """MLA's widths are all given (ConfigError naming the unset ones)."""
    unset = [key for key, field in (("kv_lora_rank", "kv_lora_rank"),
                                    ("qk_nope_head_dim", "qk_nope_head_dim"),
                                    ("qk_rope_head_dim", "qk_rope_head_dim"),
                                    ("v_head_dim", "v_head_dim")) if getattr(args, field) < 1]
    if unset:
        raise ConfigError(f"model.attention = 'mla' needs {', '.join('model.' + k for k in unset)}"
                          f": set them (DeepSeek-V3: kv_lora_rank 512, qk_nope_head_dim 128, "
                          f"qk_rope_head_dim 64, v_head_dim 128)")


def check_groups(args: LlamaArgs) -> None:
    """Group-limited routing: a sigmoid router, equal groups of two or more experts, and the
    top-k inside the chosen groups."""
    n_group, topk_group = args.moe_n_group, args.moe_topk_group
    if n_group == 1:
        return
    per_group = args.n_experts // n_group
    if args.moe_router != "sigmoid":
        raise ConfigError(f"model.moe_n_group = {n_group} needs model.moe_router = 'sigmoid' "
                          "(DeepSeek-V3's group-limited routing)")
    if args.n_experts % n_group or per_group < 2:
        raise ConfigError(f"model.moe_n_group = {n_group} does not split model.n_experts = "
                          f"{args.n_experts} into equal groups of 2 or more")
    if not 1 <= topk_group <= n_group or args.moe_top_k > topk_group * per_group:
        raise ConfigError(f"model.moe_topk_group = {topk_group} must be at most moe_n_group = "
                          f"{n_group} and its groups must hold moe_top_k = {args.moe_top_k} "
                          "experts")
