"""HF transformers LLaMA and Mixtral checkpoints <-> dtrain weights.

HF stores ``LlamaForCausalLM`` as safetensors (one file, or shards with
``model.safetensors.index.json``) beside ``config.json``. Names map one to one
(``model.layers.3.self_attn.q_proj.weight`` <-> ``layers.3.attention.wq.weight``); the q and k
projections are also permuted, because HF rotates the two halves of each head (``rotate_half``)
where dtrain, like Meta's reference code, rotates interleaved pairs. Grouped-query attention needs
nothing more: k and v keep their ``n_kv_heads`` rows. ``MixtralForCausalLM`` keeps one tensor per
expert (``block_sparse_moe.experts.<e>.w1.weight``; transformers 5 models hold them fused as
``mlp.experts.gate_up_proj`` / ``down_proj``, and either is read): they are stacked into dtrain's
``[n_experts, ...]`` parameters, and the router is ``block_sparse_moe.gate``.

``import_hf`` writes a model-only DCP checkpoint that a run starts from with
``checkpoint.initial_weights``, under any parallel layout; ``export_hf`` turns a dtrain
checkpoint back into a folder that ``transformers`` loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dtrain.config import ConfigError
from dtrain.models.llama import LlamaArgs, RopeScaling, Transformer

_LAYER_NAMES = {  # dtrain suffix -> HF suffix, inside layers.<i>.
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_DENSE = ("feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")
_TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight",
              "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def args_from_hf_config(config: dict) -> LlamaArgs:
    """``LlamaArgs`` for an HF LLaMA ``config.json``."""
    if config.get("model_type") not in (None, "llama", "mixtral"):
        raise ConfigError(f"config.json has model_type {config.get('model_type')!r}: only "
                          "LLaMA and Mixtral checkpoints (model_type 'llama' or 'mixtral') are "
                          "converted in this version")
    if config.get("sliding_window"):
        raise ConfigError(f"config.json has sliding_window {config['sliding_window']}: "
                          "sliding-window attention is not supported (Mixtral has none)")
    # transformers 4 writes rope_theta and rope_scaling; transformers 5 one rope_parameters.
    rope = config.get("rope_parameters") or {}
    theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = config.get("rope_scaling") or (
        rope if rope.get("rope_type", "default") != "default" else None)
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    if (config.get("head_dim") or head_dim) != head_dim:
        raise ConfigError(f"config.json has head_dim {config['head_dim']}, not hidden_size / "
                          f"num_attention_heads = {head_dim}: such models are not supported")
    if scaling is not None:
        if scaling.get("rope_type", scaling.get("type")) != "llama3":
            raise ConfigError(f"rope_scaling {scaling} is not supported: only Llama 3.1's "
                              "'llama3' frequency scaling (or none) is")
        scaling = RopeScaling(factor=scaling["factor"], low_freq_factor=scaling["low_freq_factor"],
                              high_freq_factor=scaling["high_freq_factor"],
                              original_max_seq_len=scaling["original_max_position_embeddings"])
    return LlamaArgs(
        dim=config["hidden_size"], n_layers=config["num_hidden_layers"],
        n_heads=config["num_attention_heads"],
        n_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        vocab_size=config["vocab_size"], ffn_hidden_size=config["intermediate_size"],
        norm_eps=config.get("rms_norm_eps", 1e-5), rope_theta=theta,
        rope_scaling=scaling, max_seq_len=config.get("max_position_embeddings", 4096),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        **_moe_args(config))


def _moe_args(config: dict) -> dict:
    """The MoE fields of ``LlamaArgs`` for a Mixtral config (none for LLaMA)."""
    if config.get("model_type") != "mixtral":
        return {}
    return {"n_experts": config["num_local_experts"], "moe_top_k": config["num_experts_per_tok"],
            "moe_hidden_size": config["intermediate_size"],
            "moe_aux_loss_coeff": config.get("router_aux_loss_coef", 0.0)}


def hf_config_from_args(args: LlamaArgs) -> dict:
    """The HF ``config.json`` of a dtrain LLaMA or Mixtral."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": args.dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.kv_heads,
        "intermediate_size": args.ffn_dim, "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len, "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "torch_dtype": "float32",
    }
    if args.n_experts:
        config.update({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                       "intermediate_size": args.expert_dim,
                       "num_local_experts": args.n_experts,
                       "num_experts_per_tok": args.moe_top_k,
                       "router_aux_loss_coef": args.moe_aux_loss_coeff,
                       "sliding_window": None})
        for key in ("attention_bias", "mlp_bias"):
            del config[key]
    if args.rope_scaling is not None:
        s = args.rope_scaling
        config["rope_scaling"] = {"rope_type": "llama3", "factor": s.factor,
                                  "low_freq_factor": s.low_freq_factor,
                                  "high_freq_factor": s.high_freq_factor,
                                  "original_max_position_embeddings": s.original_max_seq_len}
    return config


def _to_interleaved(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's half-split rotary layout -> interleaved pairs, for a q/k projection's rows."""
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _to_half_split(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Interleaved rotary pairs -> HF's half-split layout (inverse of ``_to_interleaved``)."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def from_hf_state_dict(hf: dict[str, torch.Tensor], args: LlamaArgs) -> dict[str, torch.Tensor]:
    """HF tensor names and layouts -> dtrain's."""
    out = {}
    for ours, theirs in _TOP_NAMES.items():
        if theirs in hf:
            out[ours] = hf[theirs]
    for i in range(args.n_layers):
        if args.n_experts:
            out.update(_experts_from_hf(hf, args, i))
        for ours, theirs in _LAYER_NAMES.items():
            if args.n_experts and ours in _DENSE:
                continue
            key = f"model.layers.{i}.{theirs}"
            if key not in hf:
                raise ConfigError(f"the HF checkpoint has no tensor {key}: it is not a complete "
                                  f"model with {args.n_layers} layers")
            tensor = hf[key]
            if ours == "attention.wq.weight":
                tensor = _to_interleaved(tensor, args.n_heads)
            elif ours == "attention.wk.weight":
                tensor = _to_interleaved(tensor, args.kv_heads)
            out[f"layers.{i}.{ours}"] = tensor
    if args.tie_embeddings:  # one tensor under both names, as the tied model's state_dict has
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def _experts_from_hf(hf: dict[str, torch.Tensor], args: LlamaArgs,
                     i: int) -> dict[str, torch.Tensor]:
    """Layer ``i``'s router and stacked experts from Mixtral's per-expert (or fused) tensors."""
    ours, legacy, fused = (f"layers.{i}.feed_forward", f"model.layers.{i}.block_sparse_moe",
                           f"model.layers.{i}.mlp")
    out = {}
    if f"{fused}.experts.gate_up_proj" in hf:  # transformers 5 in memory
        gate_up, hidden = hf[f"{fused}.experts.gate_up_proj"], args.expert_dim
        out[f"{ours}.experts.w1"] = gate_up[:, :hidden]
        out[f"{ours}.experts.w3"] = gate_up[:, hidden:]
        out[f"{ours}.experts.w2"] = hf[f"{fused}.experts.down_proj"]
        out[f"{ours}.router.gate.weight"] = hf[f"{fused}.gate.weight"]
        return out
    for w in ("w1", "w2", "w3"):
        keys = [f"{legacy}.experts.{e}.{w}.weight" for e in range(args.n_experts)]
        missing = [k for k in keys if k not in hf]
        if missing:
            raise ConfigError(f"the HF checkpoint has no tensor {missing[0]}: it is not a "
                              f"complete Mixtral with {args.n_experts} experts per layer")
        out[f"{ours}.experts.{w}"] = torch.stack([hf[k] for k in keys])
    if f"{legacy}.gate.weight" not in hf:
        raise ConfigError(f"the HF checkpoint has no tensor {legacy}.gate.weight")
    out[f"{ours}.router.gate.weight"] = hf[f"{legacy}.gate.weight"]
    return out


def to_hf_state_dict(ours: dict[str, torch.Tensor], args: LlamaArgs) -> dict[str, torch.Tensor]:
    """dtrain tensor names and layouts -> HF's."""
    out = {}
    for name, tensor in ours.items():
        if name in _TOP_NAMES:
            if not (name == "output.weight" and args.tie_embeddings):
                out[_TOP_NAMES[name]] = tensor
            continue
        _, i, suffix = name.split(".", 2)
        moe = f"model.layers.{i}.block_sparse_moe"
        if suffix == "feed_forward.router.gate.weight":
            out[f"{moe}.gate.weight"] = tensor
            continue
        if suffix.startswith("feed_forward.experts."):
            w = suffix.rsplit(".", 1)[1]
            for e in range(tensor.shape[0]):
                out[f"{moe}.experts.{e}.{w}.weight"] = tensor[e].contiguous()
            continue
        if suffix == "attention.wq.weight":
            tensor = _to_half_split(tensor, args.n_heads)
        elif suffix == "attention.wk.weight":
            tensor = _to_half_split(tensor, args.kv_heads)
        out[f"model.layers.{i}.{_LAYER_NAMES[suffix]}"] = tensor
    return out


def read_hf(folder: str | Path) -> tuple[LlamaArgs, dict[str, torch.Tensor]]:
    """``config.json`` and every safetensors shard of an HF model folder."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{config_file} not found: give the folder of an HF model "
                          "(config.json and model*.safetensors)")
    args = args_from_hf_config(json.loads(config_file.read_text()))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = [p.name for p in sorted(folder.glob("*.safetensors"))]
    if not files:
        raise ConfigError(f"no safetensors files in {folder}")
    tensors = {}
    for name in files:
        path = folder / name
        if not path.is_file():
            raise ConfigError(f"{path} is listed in model.safetensors.index.json but missing: "
                              "copy the whole model folder")
        try:
            tensors.update(load_file(str(path)))
        except Exception as e:  # safetensors reports truncation as several error types
            raise ConfigError(f"{path} cannot be read ({e}): the file is damaged; copy it "
                              "again") from None
    return args, tensors


def import_hf(hf_folder: str | Path, out: str | Path) -> LlamaArgs:
    """Converts an HF LLaMA folder into a model-only dtrain checkpoint (DCP) at ``out`` and
    writes ``out/model_args.json``; returns the model's shape."""
    import dataclasses

    import torch.distributed.checkpoint as dcp

    from dtrain.checkpoint_files import hashing_writer, write_hashes

    args, hf = read_hf(hf_folder)
    state = from_hf_state_dict(hf, args)
    with torch.device("meta"):
        expected = Transformer(args).state_dict()
    for name, tensor in expected.items():
        if name not in state:
            raise ConfigError(f"the HF checkpoint lacks {name}'s tensor")
        if state[name].shape != tensor.shape:
            raise ConfigError(f"{name}: HF shape {tuple(state[name].shape)} does not match the "
                              f"config's {tuple(tensor.shape)}")
    out = Path(out)
    writer, files = hashing_writer(out)  # hashed, so that a run verifies it like its own
    dcp.save({"model": {k: v.float().contiguous() for k, v in state.items()}},
             storage_writer=writer)
    write_hashes(out, 0, files)
    (out / "model_args.json").write_text(json.dumps(dataclasses.asdict(args), indent=1))
    return args


def load_model(checkpoint: str | Path, args: LlamaArgs) -> Transformer:
    """A full model on CPU with the weights of a dtrain checkpoint (a training step folder or an
    imported model-only one), read in one process whatever layout saved it."""
    from dtrain.checkpoint import read_checkpoint

    model = Transformer(args)
    state = {"model": model.state_dict()}
    read_checkpoint(state, checkpoint, f"checkpoint {checkpoint} as a {args.n_layers}-layer "
                    f"model of dim {args.dim}", "Name the preset the run trained (and its "
                    "layer count)")
    model.load_state_dict(state["model"])
    return model


def export_hf(model: Transformer, out: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Writes a full (unsharded, single-process) dtrain model as an HF LLaMA folder."""
    from safetensors.torch import save_file

    from dtrain.models.llama import canonical_name

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ours = {canonical_name(k): v.detach().to("cpu", dtype).contiguous()
            for k, v in model.state_dict().items()}
    save_file(to_hf_state_dict(ours, model.args), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = hf_config_from_args(model.args)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=1))
