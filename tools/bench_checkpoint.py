"""Checkpoint benchmark: save and load time, and the training pause per save, sync vs async.

    torchrun --nproc_per_node=2 tools/bench_checkpoint.py --recipe llama3_8b \
        --folder /local/disk/ckpt [--section.key value ...]

Trains ``--steps`` steps (warm-up), then times: the step without a save; a synchronous save (the
whole pause); loading it back; an asynchronous save (the pause until training resumes, each of
the ``--steps`` steps that follow while it is written, and the time until it is complete). The
checkpoint is the full training state (model, optimizer, schedule, data position) and is
deleted after each measurement, so the disk needs room for one. Prints a JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import commit, hardware  # noqa: E402

from dtrain import Trainer, load_config  # noqa: E402
from dtrain.checkpoint import Checkpointer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--folder", required=True, help="where the checkpoints are written")
    parser.add_argument("--steps", type=int, default=4, help="steps before and after saves")
    parser.add_argument("--second-save", action="store_true",
                        help="also time a second async save (pinned buffers already allocated)")
    args, overrides = parser.parse_known_args()
    overrides += ["--checkpoint.enabled", "true", "--checkpoint.async_save", "true",
                  "--checkpoint.folder", args.folder, "--metrics.tensorboard", "false"]
    trainer = Trainer(load_config(args.recipe, overrides))
    folder = Path(args.folder)
    sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)

    def barrier() -> None:
        sync()
        if dist.is_initialized():
            dist.barrier()

    def timed(fn, what: str = "") -> float:
        barrier()
        start = time.perf_counter()
        fn()
        barrier()
        seconds = time.perf_counter() - start
        if what and trainer.rank == 0:  # as it goes: a run cut short still reports
            print(f"{what}: {seconds:.2f}s", flush=True)
        return seconds

    def steps(n: int) -> float:
        """Mean seconds per training step over ``n`` steps."""
        return timed(lambda: [trainer.train_step() for _ in range(n)]) / n

    class DataPosition:
        """The loader's position, saved as in training; a loader that has started cannot
        rewind, so the load keeps it where it is (its state is a few integers)."""

        state_key = "global"

        def state_dict(self):
            return trainer.loader.state_dict()

        def load_state_dict(self, state):
            pass

    def checkpointer(async_save: bool) -> Checkpointer:
        cfg = dataclasses.replace(trainer.config.checkpoint, folder=str(folder),
                                  async_save=async_save, keep_last=1, load_step=0)
        trainer.checkpointer = Checkpointer(cfg, trainer.run_dir, trainer.model_parts,
                                            trainer.optimizer, trainer.scheduler,
                                            DataPosition(), trainer.config.training.steps,
                                            trainer.cpu_group)
        return trainer.checkpointer

    def clear() -> None:
        barrier()
        if trainer.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
        barrier()

    clear()
    steps(args.steps)  # warm-up: compilation, allocator
    step_time = steps(args.steps)
    if trainer.rank == 0:
        print(f"step without a save: {step_time:.3f}s", flush=True)

    ckpt = checkpointer(async_save=False)
    sync_save = timed(lambda: ckpt.save(1), "synchronous save")
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    load = timed(ckpt.load, "load")
    clear()

    ckpt = checkpointer(async_save=True)
    barrier()
    start = time.perf_counter()
    async_pause = timed(lambda: ckpt.save(2), "asynchronous save: training paused")
    # Each step separately: the first waits for the copy off the device, if unfinished.
    during = [steps(1) for _ in range(args.steps)]
    steps_during = sum(during) / len(during)
    if trainer.rank == 0:
        print("steps during the asynchronous write: "
              + ", ".join(f"{s:.2f}s" for s in during), flush=True)
    timed(ckpt.wait, "asynchronous save: waiting for the write after the steps")
    async_total = time.perf_counter() - start
    clear()
    if args.second_save:  # reuses the pinned staging buffers of the first
        pause = timed(lambda: ckpt.save(3), "second asynchronous save: training paused")
        summary_extra = {"async_second_pause_s": round(pause, 2)}
        timed(ckpt.wait)
        clear()
    else:
        summary_extra = {}
    timed(ckpt.close)

    summary = {
        "checkpoint_gb": round(size / 1e9, 1),
        "step_time_s": round(step_time, 3),
        "sync_save_s": round(sync_save, 2),
        "load_s": round(load, 2),
        "async_pause_s": round(async_pause, 2),
        "step_time_during_async_write_s": round(steps_during, 3),
        "steps_during_async_write_s": [round(s, 3) for s in during],
        "async_complete_s": round(async_total, 2),
        **summary_extra,
        "commit": commit(),
        "hardware": hardware(trainer.device, trainer.world_size),
        "command": " ".join(["tools/bench_checkpoint.py", *sys.argv[1:]]),
    }
    if trainer.rank == 0:
        print("BENCH_CHECKPOINT " + json.dumps(summary), flush=True)
    trainer.loader.close()
    trainer.close()


if __name__ == "__main__":
    main()
