"""Throughput benchmark: trains a recipe for a few steps and reports steady-state figures.

    python tools/bench.py --recipe llama3_1b --steps 30 --warmup 10 [--section.key value ...]
    torchrun --nproc_per_node=2 tools/bench.py --recipe llama3_8b ...

Steps are timed in intervals of ``--log-every`` (one device sync per interval); intervals that
start within the first ``--warmup`` steps (compilation, allocator growth) are left out. The summary
gives the median interval's tokens/s per device, TFLOP/s, MFU and peak memory (allocated and
reserved), as a JSON line and as a row for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dtrain import Trainer, load_config  # noqa: E402


def commit() -> str:
    """The checkout's commit; DTRAIN_COMMIT where the tree travels without .git."""
    if os.environ.get("DTRAIN_COMMIT"):
        return os.environ["DTRAIN_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def hardware(device: torch.device, world_size: int) -> str:
    if device.type == "cuda":
        return f"{world_size}x {torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return f"{world_size}x CPU ({os.cpu_count()} cores), torch {torch.__version__}"


def profile_steps(trainer: Trainer, steps: int) -> None:
    """Profiles ``steps`` further training steps; rank 0 prints where device time goes and the
    share of wall time the device was busy; every rank prints its compute-kernel time and idle
    share (the pipeline bubble). Each rank saves ``profile_rank<N>.json`` (Chrome trace) in its run
    folder."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if trainer.device.type == "cuda" else [])
    sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
    sync()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            trainer.run_step()  # as the training loop runs it (updates overlap the next step)
        sync()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in kernels) / 1e6
    # Communication kernels also run while a rank only waits for its peer (a pipeline bubble):
    # the idle share is measured against compute kernels alone.
    compute = sum(e.self_device_time_total for e in kernels if "nccl" not in e.key.lower()) / 1e6
    idle = max(wall - compute, 0.0)
    print(f"PROFILE rank {trainer.rank}, {steps} steps: wall {wall:.3f}s, device kernels "
          f"{busy:.3f}s ({100 * busy / wall:.1f}% of wall), compute kernels {compute:.3f}s, "
          f"idle {100 * idle / wall:.1f}% of wall = {100 * idle / max(compute, 1e-9):.1f}% of "
          "compute", flush=True)
    trainer.run_dir.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trainer.run_dir / f"profile_rank{trainer.rank}.json"))
    if trainer.rank != 0:
        return
    sort = "self_device_time_total" if trainer.device.type == "cuda" else "self_cpu_time_total"
    print(events.table(sort_by=sort, row_limit=30, max_name_column_width=70), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the figures")
    parser.add_argument("--label", default="", help="name of this configuration in the table")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="after the run, profile this many more steps: rank 0 prints the "
                             "top device kernels and writes a Chrome trace to the run folder")
    parser.add_argument("--log-every", type=int, default=5,
                        help="steps per timing interval (each interval ends in one device sync)")
    args, overrides = parser.parse_known_args()
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    overrides += ["--training.steps", str(args.steps), "--metrics.log_every", str(args.log_every),
                  "--metrics.tensorboard", "false"]
    trainer = Trainer(load_config(args.recipe, overrides))
    history = trainer.train()
    steady = [r for r in history if r["step"] > args.warmup + args.log_every - 1]
    median = statistics.median(r["step_time_s"] for r in steady)
    tokens = trainer.global_batch * trainer.config.training.seq_len
    tps = tokens / median / trainer.world_size
    summary = {
        "label": args.label or args.recipe,
        "tokens_per_second_per_device": round(tps),
        "tflops_per_device": round(tps * trainer.flops_per_token / 1e12, 1),
        "mfu_percent": (round(100 * tps * trainer.flops_per_token / 1e12 / trainer.peak_tflops, 1)
                        if trainer.peak_tflops else None),
        "step_time_s": round(median, 4),
        "peak_memory_gib": round(max(r["peak_memory_gib"] for r in history), 1),
        "peak_reserved_gib": round(max(r.get("peak_reserved_gib", 0.0) for r in history), 1),
        # CUDA caching-allocator retries in the timed steps (each one stalls its step).
        "alloc_retries": sum(r.get("alloc_retries", 0) for r in steady),
        "final_loss": round(history[-1]["loss"], 4),
        "commit": commit(),
        "hardware": hardware(trainer.device, trainer.world_size),
        "command": " ".join(["tools/bench.py", *sys.argv[1:]]),
    }
    if args.profile:
        profile_steps(trainer, args.profile)
    if trainer.rank == 0:
        print("BENCH " + json.dumps(summary), flush=True)
        mfu = f"{summary['mfu_percent']}%" if summary["mfu_percent"] is not None else "-"
        print(f"| {summary['label']} | {summary['tokens_per_second_per_device']:,} | "
              f"{summary['tflops_per_device']} | {mfu} | {summary['peak_memory_gib']} GiB "
              f"({summary['peak_reserved_gib']} GiB reserved) |",
              flush=True)
    trainer.close()


if __name__ == "__main__":
    main()
