"""Converts LLaMA weights between HF transformers folders and dtrain checkpoints.

    python tools/convert_hf.py import HF_FOLDER OUT_CHECKPOINT
        then train from it: --checkpoint.initial_weights OUT_CHECKPOINT
    python tools/convert_hf.py export CHECKPOINT OUT_HF_FOLDER --model llama3_8b [--n-layers N]
        [--dtype bf16]
        CHECKPOINT is a step folder (outputs/<run>/checkpoints/step-0001000) or an imported one

An export loads with ``transformers.AutoModelForCausalLM.from_pretrained(OUT_HF_FOLDER)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dtrain.config import ConfigError  # noqa: E402
from dtrain.hf_checkpoint import export_hf, import_hf, load_model  # noqa: E402
from dtrain.models import model_args  # noqa: E402
from dtrain.models.llama import LlamaArgs, RopeScaling  # noqa: E402


def args_for_export(checkpoint: Path, preset: str | None, n_layers: int = 0) -> LlamaArgs:
    """The model shape: the imported checkpoint's model_args.json, else the named preset."""
    saved = checkpoint / "model_args.json"
    if saved.is_file():
        fields = json.loads(saved.read_text())
        if fields.get("rope_scaling"):
            fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
        return LlamaArgs(**fields)
    if not preset:
        raise ConfigError(f"{checkpoint} has no model_args.json: name the model with --model "
                          "(the preset the run trained, e.g. llama3_8b)")
    return model_args(preset, n_layers=n_layers)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="HF folder -> dtrain model-only checkpoint")
    imp.add_argument("hf_folder")
    imp.add_argument("out")
    exp = sub.add_parser("export", help="dtrain checkpoint -> HF folder")
    exp.add_argument("checkpoint")
    exp.add_argument("out")
    exp.add_argument("--model", help="preset of the run (not needed for imported checkpoints)")
    exp.add_argument("--n-layers", type=int, default=0,
                     help="the run's model.n_layers, if it overrode the preset's")
    exp.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    args = parser.parse_args()
    try:
        if args.command == "import":
            shape = import_hf(args.hf_folder, args.out)
            print(f"imported {shape.n_layers} layers, dim {shape.dim} -> {args.out}")
        else:
            checkpoint = Path(args.checkpoint)
            shape = args_for_export(checkpoint, args.model, args.n_layers)
            model = load_model(checkpoint, shape)
            dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
            export_hf(model, args.out, dtype)
            print(f"exported {dataclasses.asdict(shape)['n_layers']} layers -> {args.out}")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
