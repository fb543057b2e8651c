"""FP8 against the same model without it, trained in lockstep on the same batches: whether FP8
training keeps up, step by step, with nothing else different (one process, no parallelism).

    python tools/fp8_lockstep.py --recipe debug --steps 200                 # CPU: emulated FP8
    python tools/fp8_lockstep.py --recipe llama3_1b --steps 200 --training.seq_len 4096  # one GPU

Both models take the recipe's model, data, optimizer settings, warm-up + cosine schedule and
clipping; on CUDA they compute in bf16 (fp32 master weights) and FP8 uses torchao's kernels, on
CPU they compute in fp32 and FP8 is emulated. Prints a JSON line every ``--every`` steps: both
losses and their ratio; at the end the largest ratio seen.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dtrain import Trainer, load_config  # noqa: E402
from dtrain.models.llama import Transformer  # noqa: E402
from dtrain.optim import build_lr_scheduler, build_optimizer  # noqa: E402
from dtrain.parallel.fp8 import convert_to_fp8  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=10, help="steps between printed lines")
    args, overrides = parser.parse_known_args()
    overrides += ["--training.steps", str(args.steps), "--metrics.tensorboard", "false",
                  "--fp8.enabled", "false", "--compile.enabled", "false"]
    cfg = load_config(args.recipe, overrides)
    trainer = Trainer(cfg)  # the recipe's data pipeline, device and model shape
    device, cuda = trainer.device, trainer.device.type == "cuda"
    runs = {}
    for name in ("reference", "fp8"):
        with torch.device("meta"):
            model = Transformer(trainer.model.args)
        if name == "fp8":
            convert_to_fp8(model, dataclasses.replace(cfg.fp8, enabled=True), fsdp=False,
                           emulate=not cuda)
        model.to_empty(device=device)
        model.init_weights(cfg.training.seed)
        optimizer = build_optimizer(model, cfg.optimizer, device.type)
        scheduler = build_lr_scheduler(optimizer, cfg.lr_schedule, args.steps, cfg.optimizer.lr)
        runs[name] = (model, optimizer, scheduler)
    worst = 1.0
    for step in range(1, args.steps + 1):
        batches = [trainer.loader.next_batch() for _ in range(trainer.grad_accum)]
        losses = {}
        for name, (model, optimizer, scheduler) in runs.items():
            total = torch.zeros((), device=device)
            for inputs, labels in batches:
                inputs, labels = inputs.to(device), labels.to(device)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                    logits = model(inputs)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
                (loss / len(batches)).backward()
                total += loss.detach() / len(batches)
            if cfg.training.max_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.max_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses[name] = total.item()
        ratio = losses["fp8"] / losses["reference"]
        worst = max(worst, ratio, 1 / ratio)
        if step % args.every == 0 or step == args.steps:
            print(json.dumps({"step": step, **{k: round(v, 4) for k, v in losses.items()},
                              "ratio": round(ratio, 4)}), flush=True)
    print(json.dumps({"largest_ratio": round(worst, 4), "steps": args.steps,
                      "device": str(device), "recipe": args.recipe}), flush=True)
    trainer.loader.close()


if __name__ == "__main__":
    main()
