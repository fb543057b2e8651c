"""Hugging Face checkpoints of LLaMA, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE and DeepSeek-V3
<-> dtrain weights.

HF stores a model as safetensors (one file, or shards with ``model.safetensors.index.json``)
beside ``config.json``, whose mapping to ``LlamaArgs`` is ``dtrain.hf_config``'s. Names map one to
one (``model.layers.3.self_attn.q_proj.weight`` <-> ``layers.3.attention.wq.weight``, biases and
Qwen3's ``self_attn.q_norm`` / ``k_norm`` alike); what RoPE rotates is also permuted, because HF
rotates the two halves of each head (``rotate_half``) where dtrain, like Meta's reference code,
rotates interleaved pairs: the rows of wq and wk, their biases, and within its one head the
weights of q_norm and k_norm. Grouped-query attention and an explicit head width need nothing
more. Checkpoints keep one tensor per expert, ``block_sparse_moe.experts.<e>.w1.weight`` (w1,
w2, w3) in Mixtral's, ``mlp.experts.<e>.gate_proj.weight`` (gate_proj, down_proj, up_proj) in
Qwen3-MoE's, as transformers 5 still saves them (its models hold them fused in memory, as
``mlp.experts.gate_up_proj`` / ``down_proj``, and that layout is read too): they are stacked into
dtrain's ``[n_experts, ...]`` parameters, and the router is ``block_sparse_moe.gate`` or
``mlp.gate``. Qwen3-MoE's dense blocks keep Qwen3's ``mlp.gate_proj`` / ``up_proj`` /
``down_proj``. DeepSeek-V3's names, rotary layout and multi-token-prediction layers are
``dtrain.hf_deepseek``'s; its experts are laid out as Qwen3-MoE's.

``import_hf`` writes a model-only DCP checkpoint that a run starts from with
``checkpoint.initial_weights``, under any parallel layout; ``export_hf`` turns a dtrain
model back into a folder that ``transformers`` loads. ``python -m dtrain.convert_hf`` is their
command line, which also writes the recipe of an import and the tokenizer of an export.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from dtrain import hf_deepseek
from dtrain.config import ConfigError
from dtrain.hf_config import (
    DEEPSEEK_V3,
    MIXTRAL,
    args_from_hf_config,
    hf_architecture_of,
    hf_config_from_args,
)
from dtrain.models.llama import LlamaArgs, Transformer

_LAYER_NAMES = {  # dtrain suffix -> HF suffix, inside layers.<i>.
    **{f"attention.{ours}.{kind}": f"self_attn.{theirs}_proj.{kind}"
       for ours, theirs in (("wq", "q"), ("wk", "k"), ("wv", "v"), ("wo", "o"))
       for kind in ("weight", "bias")},
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight",
              "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
# Where a checkpoint keeps an MoE block: the module under model.layers.<i> holding the router
# (``gate``) and the experts, and each expert's names of dtrain's w1, w2, w3.
_MIXTRAL_EXPERTS = ("block_sparse_moe", {"w1": "w1", "w2": "w2", "w3": "w3"})
_QWEN3_MOE_EXPERTS = ("mlp", {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"})


def _rotary_heads(suffix: str, args: LlamaArgs) -> int:
    """How many heads of rotated channels dim 0 of layer tensor ``suffix`` holds (0: none)."""
    if suffix.startswith(("attention.wq.", "attention.wk.")):
        return args.n_heads if suffix.startswith("attention.wq.") else args.kv_heads
    return 1 if suffix in ("attention.q_norm.weight", "attention.k_norm.weight") else 0


def _to_interleaved(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's half-split rotary layout -> interleaved pairs, along dim 0 of ``w`` (a q/k
    projection's rows, its bias, or a per-head norm's weight) split into ``heads`` heads."""
    return w.unflatten(0, (heads, 2, -1)).transpose(1, 2).reshape(w.shape)


def _to_half_split(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Interleaved rotary pairs -> HF's half-split layout (inverse of ``_to_interleaved``)."""
    return w.unflatten(0, (heads, -1, 2)).transpose(1, 2).reshape(w.shape)


def from_hf_state_dict(hf: dict[str, torch.Tensor], args: LlamaArgs,
                       config: dict | None = None) -> dict[str, torch.Tensor]:
    """HF tensor names and layouts -> dtrain's: every tensor of ``Transformer(args)``'s state
    dict, taken from ``hf``; ``config`` is the checkpoint's config.json (DeepSeek-V3's
    ``rope_interleave``). Raises ConfigError naming the first tensor ``hf`` lacks."""
    if args.attention == "mla":
        return _from_deepseek(hf, args, (config or {}).get("rope_interleave", True))

    def convert(tensor: torch.Tensor, suffix: str) -> torch.Tensor:
        heads = _rotary_heads(suffix, args)
        return _to_interleaved(tensor, heads) if heads else tensor

    return state_dict_from_hf(
        hf, args, _TOP_NAMES, _LAYER_NAMES,
        # an MoE layer's experts and router come from its experts' tensors
        skip=lambda suffix, i: suffix.startswith("feed_forward.") and args.is_moe_layer(i),
        convert=convert, experts=lambda block, i: _experts_from_hf(hf, args, block, i))


def _from_deepseek(hf: dict[str, torch.Tensor], args: LlamaArgs,
                   rope_interleave: bool) -> dict[str, torch.Tensor]:
    """``from_hf_state_dict`` of a DeepSeek-V3 checkpoint (``dtrain.hf_deepseek``), its MTP
    layers' copies of the embedding and output layer checked first."""
    hf_deepseek.check_mtp_copies(hf, args)

    def convert(tensor: torch.Tensor, suffix: str) -> torch.Tensor:
        return tensor if rope_interleave else hf_deepseek.interleave_rotary_rows(tensor, suffix,
                                                                                 args)

    return state_dict_from_hf(
        hf, args, hf_deepseek.top_names(args), hf_deepseek.LAYER_NAMES,
        skip=lambda suffix, i: suffix.startswith(("feed_forward.experts.",
                                                  "feed_forward.router.gate.")),
        convert=convert, experts=lambda block, i: _experts_from_hf(hf, args, block, i),
        model="DeepSeek-V3 model")


def split_block(name: str, n_layers: int) -> tuple[str, int, str]:
    """A block tensor's dtrain name -> (the block, its index among the checkpoint's
    ``model.layers``, the name inside the block): ``layers.<i>.<suffix>`` is block i,
    ``mtp.<k>.block.<suffix>`` (multi-token-prediction depth k's block) ``n_layers + k``, where
    DeepSeek-V3's checkpoints keep it."""
    parts = name.split(".")
    if parts[0] == "mtp":
        return ".".join(parts[:3]), n_layers + int(parts[1]), ".".join(parts[3:])
    return ".".join(parts[:2]), int(parts[1]), ".".join(parts[2:])


def state_dict_from_hf(hf: dict[str, torch.Tensor], args: LlamaArgs, top_names: dict[str, str],
                       layer_names: dict[str, str], skip: Callable[[str, int], bool],
                       convert: Callable[[torch.Tensor, str], torch.Tensor],
                       experts: Callable[[str, int], dict[str, torch.Tensor]],
                       model: str = "model") -> dict[str, torch.Tensor]:
    """Every tensor of ``Transformer(args)``'s state dict from an HF checkpoint ``hf``: a name
    outside the blocks through ``top_names``, a block's through ``layer_names`` (dtrain suffix
    -> HF suffix inside ``model.layers.<i>.``, ``split_block``) unless ``skip(suffix, i)``, each
    passed through ``convert(tensor, suffix)``; each MoE block's stacked experts from
    ``experts(block, i)``; the tied output layer as the embedding. Raises ConfigError naming the
    first tensor ``hf`` lacks."""
    with torch.device("meta"):
        names = list(Transformer(args).state_dict())
    out = {}
    for name in names:
        if name == "output.weight" and args.tie_embeddings:
            continue
        if name in top_names:
            key, suffix = top_names[name], ""
        else:
            _, i, suffix = split_block(name, args.n_layers)
            if skip(suffix, i):
                continue
            key = f"model.layers.{i}.{layer_names[suffix]}"
        out[name] = convert(hf_tensor(hf, key, model), suffix)
    for name in names:
        if name.endswith(".feed_forward.experts.w1"):
            out.update(experts(*split_block(name, args.n_layers)[:2]))
    if args.tie_embeddings:  # one tensor under both names, as the tied model's state_dict has
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def hf_tensor(hf: dict[str, torch.Tensor], key: str, model: str = "model") -> torch.Tensor:
    """``hf[key]``; ConfigError when the checkpoint lacks it."""
    if key not in hf:
        raise ConfigError(f"the HF checkpoint has no tensor {key}: it is not a complete {model} "
                          "of the shape its config.json gives")
    return hf[key]


def _experts_from_hf(hf: dict[str, torch.Tensor], args: LlamaArgs, block: str,
                     i: int) -> dict[str, torch.Tensor]:
    """The router and stacked experts of dtrain's ``block`` from the checkpoint's layer ``i``:
    Mixtral's or Qwen3-MoE's (and DeepSeek-V3's) per-expert tensors, or transformers 5's fused
    ones."""
    ours, fused = f"{block}.feed_forward", f"model.layers.{i}.mlp"
    out = {}
    if f"{fused}.experts.gate_up_proj" in hf:  # transformers 5 in memory
        gate_up, hidden = hf[f"{fused}.experts.gate_up_proj"], args.expert_dim
        out[f"{ours}.experts.w1"] = gate_up[:, :hidden]
        out[f"{ours}.experts.w3"] = gate_up[:, hidden:]
        out[f"{ours}.experts.w2"] = hf[f"{fused}.experts.down_proj"]
        out[f"{ours}.router.gate.weight"] = hf[f"{fused}.gate.weight"]
        return out
    mixtral = f"model.layers.{i}.{_MIXTRAL_EXPERTS[0]}.gate.weight" in hf
    block, names = _MIXTRAL_EXPERTS if mixtral else _QWEN3_MOE_EXPERTS
    legacy = f"model.layers.{i}.{block}"
    for w, theirs in names.items():
        keys = [f"{legacy}.experts.{e}.{theirs}.weight" for e in range(args.n_experts)]
        missing = [k for k in keys if k not in hf]
        if missing:
            raise ConfigError(f"the HF checkpoint has no tensor {missing[0]}: it is not a "
                              f"complete MoE model with {args.n_experts} experts per layer")
        out[f"{ours}.experts.{w}"] = torch.stack([hf[k] for k in keys])
    if f"{legacy}.gate.weight" not in hf:
        raise ConfigError(f"the HF checkpoint has no tensor {legacy}.gate.weight")
    out[f"{ours}.router.gate.weight"] = hf[f"{legacy}.gate.weight"]
    return out


def to_hf_state_dict(ours: dict[str, torch.Tensor], args: LlamaArgs) -> dict[str, torch.Tensor]:
    """dtrain tensor names and layouts -> HF's, for the architecture ``hf_architecture_of``
    picks (the experts one tensor each; no ``lm_head.weight`` where the embeddings are tied;
    DeepSeek-V3's MTP layers with their copies of the embedding and output layer)."""
    arch = hf_architecture_of(args)
    layout = _MIXTRAL_EXPERTS if arch == MIXTRAL else _QWEN3_MOE_EXPERTS
    if arch == DEEPSEEK_V3:  # its rotary rows as they are: rope_interleave
        out = state_dict_to_hf(ours, args, hf_deepseek.top_names(args), hf_deepseek.LAYER_NAMES,
                               layout, lambda tensor, suffix: tensor)
        return {**out, **hf_deepseek.mtp_copies(ours, args)}

    def convert(tensor: torch.Tensor, suffix: str) -> torch.Tensor:
        heads = _rotary_heads(suffix, args)
        return _to_half_split(tensor, heads) if heads else tensor

    return state_dict_to_hf(ours, args, _TOP_NAMES, _LAYER_NAMES, layout, convert)


def state_dict_to_hf(ours: dict[str, torch.Tensor], args: LlamaArgs, top_names: dict[str, str],
                     layer_names: dict[str, str], experts: tuple[str, dict[str, str]],
                     convert: Callable[[torch.Tensor, str], torch.Tensor]
                     ) -> dict[str, torch.Tensor]:
    """The inverse of ``state_dict_from_hf``: each tensor of dtrain's state dict ``ours`` under
    its HF name (``top_names``, else ``layer_names`` inside ``model.layers.<i>.``, i as
    ``split_block`` gives it), a block's passed through ``convert(tensor, suffix)``; an MoE
    block's router and its experts one tensor each, laid out as ``experts`` (the module holding
    them, and each expert's names of w1, w2, w3); no ``lm_head.weight`` when tied."""
    module, names = experts
    out = {}
    for name, tensor in ours.items():
        if name in top_names:
            if not (name == "output.weight" and args.tie_embeddings):
                out[top_names[name]] = tensor
            continue
        _, i, suffix = split_block(name, args.n_layers)
        moe = f"model.layers.{i}.{module}"
        if suffix == "feed_forward.router.gate.weight":
            out[f"{moe}.gate.weight"] = tensor
        elif suffix.startswith("feed_forward.experts."):
            theirs = names[suffix.rsplit(".", 1)[1]]
            for e in range(tensor.shape[0]):
                out[f"{moe}.experts.{e}.{theirs}.weight"] = tensor[e].contiguous()
        else:
            out[f"model.layers.{i}.{layer_names[suffix]}"] = convert(tensor, suffix)
    return out


def read_hf(folder: str | Path) -> tuple[dict, LlamaArgs, dict[str, torch.Tensor]]:
    """``config.json`` (a dict), its shape (a config dtrain does not convert fails before the
    weights load) and every safetensors shard of an HF model folder."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{config_file} not found: give the folder of an HF model "
                          "(config.json and model*.safetensors)")
    config = json.loads(config_file.read_text())
    args = args_from_hf_config(config)
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
    return config, args, tensors


def import_hf(hf_folder: str | Path, out: str | Path) -> LlamaArgs:
    """Converts an HF model folder into a model-only dtrain checkpoint (DCP) at ``out`` and
    writes ``out/model_args.json``; returns the model's shape (DeepSeek-V3's without MTP depths
    where the checkpoint holds none of their layers)."""
    import dataclasses

    import torch.distributed.checkpoint as dcp

    from dtrain.checkpoint_files import hashing_writer, write_hashes

    config, args, hf = read_hf(hf_folder)
    if args.attention == "mla":
        args = hf_deepseek.mtp_held(hf, args)
    state = from_hf_state_dict(hf, args, config)
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
                    f"model of dim {args.dim}", "Export the run folder, whose config.toml "
                    "gives the shape, or name the preset the run trained (and its layer count)")
    model.load_state_dict(state["model"])
    return model


def export_hf(model: Transformer, out: str | Path, dtype: torch.dtype = torch.bfloat16,
              token_ids: dict[str, int] | None = None) -> None:
    """Writes a full (unsharded, single-process) dtrain model as an HF folder of the
    architecture ``hf_config_from_args`` picks for its shape (ConfigError where none has it),
    its weights in ``dtype``; ``token_ids`` (``bos_token_id``, ``eos_token_id``) go into its
    config.json."""
    from safetensors.torch import save_file

    from dtrain.models.llama import canonical_name

    config = hf_config_from_args(model.args)  # first: a shape HF has no class for fails here
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # The router's expert bias stays fp32, as DeepSeek-V3's checkpoints and transformers keep
    # it: rounded, it would change which experts tokens take.
    ours = {canonical_name(k): v.detach().to("cpu", torch.float32 if k.endswith("expert_bias")
                                             else dtype).contiguous()
            for k, v in model.state_dict().items()}
    save_file(to_hf_state_dict(ours, model.args), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config.update(token_ids or {})
    (out / "config.json").write_text(json.dumps(config, indent=1))
