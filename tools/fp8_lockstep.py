"""FP8 against the same run without it, trained in lockstep on the same batches: whether FP8
training keeps up, step by step, with nothing else different.

    python tools/fp8_lockstep.py --recipe debug --steps 200                 # CPU: emulated FP8
    python tools/fp8_lockstep.py --recipe llama3_1b --steps 200 --training.seq_len 4096  # one GPU

Two trainers of the recipe (any ``--section.key value`` overrides apply to both), one with
``fp8.enabled``, step alternately; with the same seed they read the same batches and start from
the same weights. On the CPU the FP8 one is emulated (``fp8.emulate``). Prints a JSON line every
``--every`` steps: both losses and their ratio; at the end the largest ratio either way.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dtrain import Trainer, load_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=10, help="steps between printed lines")
    args, overrides = parser.parse_known_args()
    overrides += ["--training.steps", str(args.steps), "--metrics.tensorboard", "false"]
    cuda = torch.cuda.is_available()
    trainers = {
        "reference": Trainer(load_config(args.recipe, overrides + [
            "--fp8.enabled", "false", "--job.name", "fp8_lockstep_reference"])),
        "fp8": Trainer(load_config(args.recipe, overrides + [
            "--fp8.enabled", "true", "--fp8.emulate", str(not cuda).lower(),
            "--job.name", "fp8_lockstep_fp8"])),
    }
    worst = 1.0
    for step in range(1, args.steps + 1):
        losses = {name: trainer.train_step()[0].item() for name, trainer in trainers.items()}
        ratio = losses["fp8"] / losses["reference"]
        worst = max(worst, ratio, 1 / ratio)
        if step % args.every == 0 or step == args.steps:
            print(json.dumps({"step": step, **{k: round(v, 4) for k, v in losses.items()},
                              "ratio": round(ratio, 4)}), flush=True)
    print(json.dumps({"largest_ratio": round(worst, 4), "steps": args.steps,
                      "device": str(trainers["fp8"].device), "recipe": args.recipe}), flush=True)
    for trainer in trainers.values():
        trainer.loader.close()


if __name__ == "__main__":
    main()
