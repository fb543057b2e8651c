"""Hugging Face model folders <-> dtrain checkpoints (LLaMA, Mistral, Mixtral, Qwen2, Qwen3,
Qwen3-MoE, DeepSeek-V3 with its multi-token-prediction layers).

    python -m dtrain.convert_hf import HF_FOLDER OUT
        OUT: a model-only checkpoint, and OUT/recipe.toml that trains from it as it is:
        python -m dtrain.train --recipe OUT/recipe.toml
    python -m dtrain.convert_hf export RUN_OR_CHECKPOINT OUT [--dtype bf16|fp32] [--step N]
        RUN_OR_CHECKPOINT: a run folder (its latest checkpoint, or step N), one of its step
        folders (<run>/checkpoints/step-0001000), or an imported checkpoint. The shape comes
        from the run's config.toml (or the checkpoint's model_args.json); the run's tokenizer
        and generation_config.json are written beside the weights, bf16 unless --dtype fp32.

An export loads with ``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` and
``transformers.AutoTokenizer.from_pretrained(OUT)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path

import torch

from dtrain.build import build_tokenizer
from dtrain.checkpoint import checkpoint_folder, checkpoint_steps
from dtrain.config import Config, ConfigError, load_config
from dtrain.config.sections import TrainingConfig, toml_value
from dtrain.data.tokenizer import Tokenizer, padded_vocab_size
from dtrain.hf_checkpoint import args_from_hf_config, export_hf, import_hf, load_model
from dtrain.model_shape import model_args_of
from dtrain.models import model_args
from dtrain.models.llama import LlamaArgs, RopeScaling

# LlamaArgs fields that say how a run computes, not what it computes: --model ignores them.
HOW_FIELDS = {"vocab_size", "attention_backend", "rope_kernel", "moe_capacity_factor",
              "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_gemm", "moe_aux_grad_scale"}


def write_recipe(hf_folder: Path, out: Path, args: LlamaArgs) -> Path:
    """``out/recipe.toml``: a run that starts from the checkpoint ``out`` imported from
    ``hf_folder`` (shape from ``out/hf_config.json``, a copy of its config.json; tokenizer from
    the folder where it has one; no multi-token prediction where the checkpoint held none of its
    layers). Returns the recipe's path."""
    hf_folder, out = hf_folder.resolve(), out.resolve()
    shutil.copyfile(hf_folder / "config.json", out / "hf_config.json")
    configured = args_from_hf_config(json.loads((out / "hf_config.json").read_text()))
    has_tokenizer = (hf_folder / "tokenizer.json").is_file() or (
        (hf_folder / "vocab.json").is_file() and (hf_folder / "merges.txt").is_file())
    seq_len = TrainingConfig().seq_len
    lines = [f"# Trains {hf_folder.name} from the weights imported from {hf_folder}:",
             f"#   python -m dtrain.train --recipe {out / 'recipe.toml'}",
             "# Every key not set here keeps dtrain's default (python -m dtrain.train --help);",
             "# data.path is the small shipped corpus until set to yours.", "",
             "[job]", f"name = {toml_value(hf_folder.name)}", "",
             "[model]", f"hf_config = {toml_value(str(out / 'hf_config.json'))}"]
    if args.mtp_depths != configured.mtp_depths:
        lines += [f"# config.json has {configured.mtp_depths} multi-token-prediction layers, "
                  "the checkpoint's weights none:", f"mtp_depths = {args.mtp_depths}"]
    lines += [""]
    if args.max_seq_len < seq_len:
        lines += ["[training]", f"seq_len = {args.max_seq_len}  # the model's longest sequence", ""]
    lines += ["[data]"]
    if has_tokenizer:
        lines += [f"tokenizer = {toml_value(str(hf_folder))}"]
    else:
        lines += [f"# {hf_folder} has no tokenizer (tokenizer.json, or vocab.json and merges.txt):",
                  "# data.tokenizer keeps dtrain's default (its 4096-id debug tokenizer):",
                  "# set it to the model's tokenizer."]
    lines += [f"# The embedding's {args.vocab_size} rows load as they are: no padding rows.",
              "vocab_size_divisible_by = 1", "",
              "[checkpoint]", f"initial_weights = {toml_value(str(out))}", ""]
    recipe = out / "recipe.toml"
    recipe.write_text("\n".join(lines))
    return recipe


@dataclasses.dataclass
class ExportSource:
    """What an export reads: the checkpoint folder, the model's shape, and the tokenizer the
    run trained with (None for an imported checkpoint or a preset named with --model)."""
    checkpoint: Path
    args: LlamaArgs
    tokenizer: Tokenizer | None = None
    tokenizer_config: dict = dataclasses.field(default_factory=dict)


def export_source(path: Path, step: int = 0, preset: str | None = None,
                  n_layers: int = 0) -> ExportSource:
    """The checkpoint and shape of ``path``: a run folder (its latest complete checkpoint, or
    ``step``), a step folder of a run (the run's config.toml two levels up), or a checkpoint
    with model_args.json (else the ``preset`` with ``n_layers``)."""
    if not path.is_dir():
        raise ConfigError(f"{path} is not a folder: give a run folder, a step folder of one or "
                          "an imported checkpoint")
    if (path / "config.toml").is_file():
        cfg = load_config(path / "config.toml")
        return run_source(path, cfg, run_step(path, cfg, step), preset, n_layers)
    if step:
        raise ConfigError(f"--step {step} picks a checkpoint of a run folder, and {path} has no "
                          "config.toml: give the run folder, or leave --step out")
    run = path.parent.parent
    if (run / "config.toml").is_file():
        cfg = load_config(run / "config.toml")
        if checkpoint_folder(cfg.checkpoint, run).resolve() == path.parent.resolve():
            return run_source(run, cfg, path, preset, n_layers)
    return ExportSource(path, args_for_export(path, preset, n_layers))


def run_step(run: Path, cfg: Config, step: int = 0) -> Path:
    """The step folder of ``run``'s latest complete checkpoint, or of ``step``."""
    folder = checkpoint_folder(cfg.checkpoint, run)
    steps = checkpoint_steps(folder)
    if not steps:
        raise ConfigError(f"{run} has no checkpoint: the run saved none (checkpoint.enabled = "
                          "false?) or was stopped before its first save; train with "
                          "--checkpoint.enabled true")
    if step and step not in steps:
        raise ConfigError(f"--step {step}: {folder} holds no complete checkpoint of that step; "
                          f"its steps are {', '.join(map(str, steps))}")
    return folder / f"step-{step or steps[-1]:07d}"


def run_source(run: Path, cfg: Config, checkpoint: Path, preset: str | None,
               n_layers: int) -> ExportSource:
    """The shape ``run`` trained (its [model] section, the vocabulary padded as the run padded
    it) and its tokenizer; a ``preset`` (with ``n_layers``) of another shape is refused."""
    try:
        tokenizer = build_tokenizer(cfg.data)
    except FileNotFoundError as e:
        raise ConfigError(f"{run / 'config.toml'}: {e}; the export writes the run's "
                          "tokenizer and needs its vocabulary size") from None
    args = model_args_of(cfg.model)
    vocab = padded_vocab_size(max(args.vocab_size, tokenizer.vocab_size),
                              cfg.data.vocab_size_divisible_by * cfg.parallel.tp)
    args = dataclasses.replace(args, vocab_size=vocab)
    if preset:
        check_same_shape(model_args(preset, n_layers=n_layers), args, preset, run)
    config_file = Path(tokenizer.file_key[0]).parent / "tokenizer_config.json"
    saved = json.loads(config_file.read_text()) if config_file.is_file() else {}
    return ExportSource(checkpoint, args, tokenizer, saved)


def check_same_shape(given: LlamaArgs, trained: LlamaArgs, preset: str, run: Path) -> None:
    """ConfigError naming the first shape field where ``--model preset`` disagrees with the
    run's config.toml."""
    for field in dataclasses.fields(LlamaArgs):
        ours, theirs = getattr(given, field.name), getattr(trained, field.name)
        if field.name not in HOW_FIELDS and ours != theirs:
            raise ConfigError(f"--model {preset} disagrees with {run / 'config.toml'}: its "
                              f"{field.name} is {ours}, the run's {theirs}; leave --model out "
                              "for a run folder")


def args_for_export(checkpoint: Path, preset: str | None, n_layers: int = 0) -> LlamaArgs:
    """The shape of a checkpoint outside a run folder: its model_args.json (an imported one),
    else the named preset."""
    saved = checkpoint / "model_args.json"
    if saved.is_file():
        fields = json.loads(saved.read_text())
        if fields.get("rope_scaling"):
            fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
        return LlamaArgs(**fields)
    if not preset:
        raise ConfigError(f"{checkpoint} is neither a run folder (config.toml), a step folder "
                          "of one, nor an imported checkpoint (model_args.json): name the model "
                          "with --model (the preset the run trained, e.g. llama3_8b)")
    try:
        return model_args(preset, n_layers=n_layers)
    except ValueError as e:
        raise ConfigError(f"--model: {e}") from None


def special_ids(source: ExportSource) -> dict[str, int]:
    """``bos_token_id`` and ``eos_token_id`` the run trained with (those its tokenizer has)."""
    tok = source.tokenizer
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id} if tok else {}
    return {key: value for key, value in ids.items() if value is not None}


def write_tokenizer(source: ExportSource, out: Path) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` of the run's tokenizer in ``out``: text
    encodes to the ids the run trained on, BOS first where it had one (dtrain adds BOS to every
    document; a post-processor adds it here where the tokenizer does not already)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors

    tok = source.tokenizer
    # The run's tokenizers object (a GPT-2 vocab.json + merges.txt pair exists only in memory),
    # copied: its post-processor may change.
    hf = HFTokenizer.from_str(tok.hf_tokenizer.to_str())
    config = {"tokenizer_class": "PreTrainedTokenizerFast",
              "model_max_length": source.args.max_seq_len,
              "clean_up_tokenization_spaces": False}
    if tok.bos_id is not None:
        bos = hf.id_to_token(tok.bos_id)
        config["bos_token"] = bos
        if hf.encode("a").ids[:1] != [tok.bos_id]:
            template = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1",
                special_tokens=[(bos, tok.bos_id)])
            hf.post_processor = template if hf.post_processor is None else \
                processors.Sequence([hf.post_processor, template])
    if tok.eos_id is not None:
        config["eos_token"] = hf.id_to_token(tok.eos_id)
    if "chat_template" in source.tokenizer_config:
        config["chat_template"] = source.tokenizer_config["chat_template"]
    hf.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def export(source: ExportSource, out: Path, dtype: torch.dtype) -> None:
    """The HF folder ``out`` of ``source``: weights and config.json, and where the run's
    tokenizer is known its files and generation_config.json (the run's BOS and EOS ids)."""
    model = load_model(source.checkpoint, source.args)
    ids = special_ids(source)
    export_hf(model, out, dtype, ids)
    if source.tokenizer is not None:
        write_tokenizer(source, out)
        generation = {**ids, "pad_token_id": ids.get("eos_token_id")}
        (out / "generation_config.json").write_text(json.dumps(
            {k: v for k, v in generation.items() if v is not None}, indent=1))


def parser() -> argparse.ArgumentParser:
    """The command line: ``import`` and ``export``."""
    top = argparse.ArgumentParser(prog="python -m dtrain.convert_hf", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="HF folder -> dtrain checkpoint and OUT/recipe.toml")
    imp.add_argument("hf_folder", metavar="HF_FOLDER",
                     help="an HF model folder (config.json, *.safetensors)")
    imp.add_argument("out", metavar="OUT", help="the checkpoint folder to write")
    exp = sub.add_parser("export", help="dtrain run or checkpoint -> HF folder")
    exp.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT",
                     help="a run folder, a step folder of one, or an imported checkpoint")
    exp.add_argument("out", metavar="OUT", help="the HF folder to write")
    exp.add_argument("--step", type=int, default=0,
                     help="a run folder's checkpoint of this step (default: the latest)")
    exp.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                     help="the weights' dtype in the HF folder (default: bf16)")
    exp.add_argument("--model", help="the preset, for a checkpoint outside a run folder "
                                     "without model_args.json")
    exp.add_argument("--n-layers", type=int, default=0,
                     help="with --model: the run's model.n_layers, if it overrode the preset's")
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == "import":
            shape = import_hf(args.hf_folder, args.out)
            recipe = write_recipe(Path(args.hf_folder), Path(args.out), shape)
            depths = f" and {shape.mtp_depths} MTP depths" if shape.mtp_depths else ""
            print(f"imported {shape.n_layers} layers{depths}, dim {shape.dim} -> {args.out}\n"
                  f"train from it: python -m dtrain.train --recipe {recipe}")
        else:
            source = export_source(Path(args.checkpoint), args.step, args.model, args.n_layers)
            export(source, Path(args.out),
                   torch.bfloat16 if args.dtype == "bf16" else torch.float32)
            print(f"exported {source.checkpoint} ({source.args.n_layers} layers, {args.dtype}) "
                  f"-> {args.out}")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
