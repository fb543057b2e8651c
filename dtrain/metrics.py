"""Throughput and MFU arithmetic, memory readings, and the console / TensorBoard / JSON-lines log.

Conventions (torchtitan's, so figures compare directly): tokens/s per GPU = tokens in the step /
step time / number of GPUs; FLOPs per token = 6 x non-embedding parameters (active parameters for
MoE) + 12 x layers x heads x head_dim x seq_len; MFU against the dense bf16 peak of the device,
also for FP8 runs.
"""

from __future__ import annotations

import contextlib
import json
import math
import resource
import sys
import time
from pathlib import Path

import torch

from dtrain.config import MetricsConfig
from dtrain.log import logger
from dtrain.models.llama import Transformer

# Dense bf16 peak TFLOP/s by device-name fragment, most specific first.
PEAK_TFLOPS = [
    ("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0),
    ("GH200", 989.0), ("H800", 989.0), ("H20", 148.0), ("B200", 2250.0), ("GB200", 2500.0),
    ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L4", 121.0), ("A10G", 70.0),
    ("RTX 4090", 165.0), ("MI300X", 1307.0), ("MI250X", 383.0),
]


def peak_tflops(device: torch.device, override: float = 0.0) -> float | None:
    """The device's dense bf16 peak in TFLOP/s: ``override`` if set, else looked up by name
    (None when unknown, e.g. on CPU, and MFU is then not reported)."""
    if override > 0:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS if key in name), None)


def flops_per_token(num_params: int, n_layers: int, n_heads: int, head_dim: int,
                    seq_len: int) -> int:
    """Training FLOPs per token: 6N for the matmuls over weights (forward 2N, backward 4N)
    and 12 L H d T for attention scores and values (causal masking not discounted)."""
    return 6 * num_params + 12 * n_layers * n_heads * head_dim * seq_len


def model_flops_per_token(model: Transformer, seq_len: int) -> int:
    """``flops_per_token`` for a whole (unsharded, possibly meta) model; an MoE counts the
    parameters a token uses (top_k of the experts)."""
    args = model.args
    return flops_per_token(model.num_params(exclude_embedding=True, active=True), args.n_layers,
                           args.n_heads, args.head_dim, seq_len)


def mfu(tokens_per_second_per_device: float, flops_per_token_: int, peak: float) -> float:
    """Model FLOPs utilisation in [0, 1]: achieved FLOP/s per device over the peak (TFLOP/s)."""
    return tokens_per_second_per_device * flops_per_token_ / (peak * 1e12)


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated GPU memory since the last reset, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 2**20 if sys.platform != "darwin" else kib / 2**30


def peak_reserved_gib(device: torch.device) -> float | None:
    """Peak memory held by the CUDA caching allocator (what nvidia-smi sees), None on CPU."""
    return torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None


def alloc_retries(device: torch.device) -> int | None:
    """How many times the CUDA caching allocator found no free block, released its cached memory
    and tried again since the process started (each a device-wide synchronisation: the steps
    where it happens stall); None on CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0)


def format_eta(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


class MetricsLogger:
    """Writes one record per logged step to the console, TensorBoard (``<run>/tb``) and
    ``<run>/metrics.jsonl``. Only the rank given ``enabled=True`` writes. The files open at the
    first record and again after ``close`` (a notebook's second ``train()``). A run resumed at
    ``resume_step`` first drops the records after that step, which it trains again, from
    metrics.jsonl and TensorBoard (``purge_step``), so each step is there once. The JSON lines
    are strict JSON: a non-finite number is written as null."""

    def __init__(self, cfg: MetricsConfig, run_dir: Path, enabled: bool, resume_step: int = 0):
        self.cfg, self.run_dir, self.enabled = cfg, run_dir, enabled
        self._purge = resume_step
        self._writer = None
        self._jsonl = None

    def _open(self) -> None:
        if self._jsonl is not None:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "metrics.jsonl"
        purge, self._purge = self._purge, 0
        if purge and path.is_file():
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= purge]
            path.write_text("".join(line + "\n" for line in kept))
        self._jsonl = open(path, "a")
        if self.cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.run_dir / "tb"),
                                         purge_step=purge + 1 if purge else None)

    def _write(self, record: dict) -> None:
        self._jsonl.write(json.dumps(_strict(record), allow_nan=False) + "\n")
        self._jsonl.flush()

    def log(self, step: int, total_steps: int, record: dict[str, float]) -> None:
        if not self.enabled:
            return
        self._open()
        record = {"step": step, **record, "time": time.time()}
        self._write(record)
        if self._writer is not None:
            for key, value in record.items():
                if key == "nonfinite_steps":  # step numbers: the count is the scalar
                    continue
                if isinstance(value, list):  # one scalar per element (MoE tokens per expert)
                    for i, item in enumerate(value):
                        self._writer.add_scalar(f"{key}/{i}", item, step)
                elif key not in ("step", "time"):
                    self._writer.add_scalar(key, value, step)
            self._writer.flush()
        logger.info(self.format_line(step, total_steps, record))

    def log_validation(self, step: int, loss: float) -> None:
        """Validation loss and perplexity: console, TensorBoard (val/...) and metrics.jsonl."""
        if not self.enabled:
            return
        self._open()
        perplexity = math.exp(min(loss, 50.0))
        self._write({"step": step, "val_loss": loss, "val_perplexity": perplexity,
                     "time": time.time()})
        if self._writer is not None:
            self._writer.add_scalar("val/loss", loss, step)
            self._writer.add_scalar("val/perplexity", perplexity, step)
            self._writer.flush()
        logger.info(f"validation step {step} | loss {loss:.4f} | perplexity {perplexity:.2f}")

    @staticmethod
    def format_line(step: int, total_steps: int, r: dict[str, float]) -> str:
        parts = [f"step {step:>{len(str(total_steps))}}/{total_steps}",
                 f"loss {r['loss']:.4f}", f"grad_norm {r['grad_norm']:.3f}",
                 f"lr {r['lr']:.2e}", f"{r['tokens_per_second_per_device']:,.0f} tok/s/dev",
                 f"{r['tflops_per_device']:.1f} TFLOP/s"]
        if "mfu_percent" in r:
            parts.append(f"MFU {r['mfu_percent']:.1f}%")
        if "aux_loss" in r:
            parts.append(f"aux {r['aux_loss']:.3f} z {r['z_loss']:.2f} "
                         f"imbalance {r['moe_load_imbalance']:.2f}")
        if r.get("nonfinite_steps"):
            steps = r["nonfinite_steps"]
            parts.append(f"{len(steps)} non-finite step{'s' * (len(steps) > 1)} skipped "
                         f"({', '.join(map(str, steps))})")
        parts += [f"step {r['step_time_s']:.3f}s", f"data {r['data_wait_percent']:.1f}%",
                  f"mem {r['peak_memory_gib']:.1f}GiB"]
        if r.get("alloc_retries"):
            parts.append(f"{r['alloc_retries']} allocator retries: memory is full, steps stall "
                         "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, more activation "
                         "checkpointing or a smaller micro-batch)")
        parts.append(f"{100 * step / total_steps:.0f}% ETA {format_eta(r['eta_s'])}")
        return " | ".join(parts)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._jsonl is not None:
            self._jsonl.close()
        self._writer = self._jsonl = None


def _strict(value):
    """``value`` with every non-finite float (in lists and dicts too) replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_strict(v) for v in value]
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    return value


class StepMetrics:
    """The figures of each logged step, timed by this object: tokens/s per device, TFLOP/s, MFU,
    step time (checkpoint saves and evaluations excluded: ``paused``), the share of time spent
    waiting for data, peak memory, allocator retries and the ETA. Logs every
    ``cfg.log_every`` steps and at the last step of a ``train()`` call through ``logger``;
    ``mean_loss`` turns a step's summed loss into the global mean (the one synchronisation of
    the ranks and the device a logged step makes)."""

    def __init__(self, cfg: MetricsConfig, logger_: MetricsLogger, device: torch.device,
                 tokens_per_step: int, world_size: int, flops_per_token: int, total_steps: int,
                 mean_loss):
        self.cfg, self.logger, self.device = cfg, logger_, device
        self.tokens_per_step, self.world_size = tokens_per_step, world_size
        self.flops_per_token, self.total_steps = flops_per_token, total_steps
        self.mean_loss = mean_loss
        self.peak_tflops = peak_tflops(device, cfg.peak_tflops)

    def start(self, step: int, last: int) -> None:
        """A ``train()`` call begins after ``step`` and ends after ``last``."""
        self.first_step, self.last = step, last
        self.run_start = self.interval_start = time.perf_counter()
        self.interval_steps, self.data_wait = 0, 0.0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.retries = alloc_retries(self.device) or 0

    @contextlib.contextmanager
    def paused(self):
        """Time inside the block is not step time."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.interval_start += time.perf_counter() - start

    def step_done(self, step: int, data_wait: float) -> bool:
        """Counts a finished step; whether it is logged."""
        self.interval_steps += 1
        self.data_wait += data_wait
        return step % self.cfg.log_every == 0 or step == self.last

    def log(self, step: int, result, extra: dict) -> dict:
        """The record of ``step`` (a ``dtrain.step.StepResult``; ``extra`` from the step hooks),
        logged and returned; the next interval starts."""
        loss, norm = self.mean_loss(result.loss_sum).item(), result.grad_norm.item()
        now = time.perf_counter()
        step_time = (now - self.interval_start) / self.interval_steps
        tps = self.tokens_per_step / step_time / self.world_size
        record = {
            "loss": loss, "grad_norm": norm, "lr": result.lr,
            "tokens_per_second_per_device": tps,
            "tflops_per_device": tps * self.flops_per_token / 1e12,
            "step_time_s": step_time,
            "data_wait_percent": 100 * self.data_wait / (now - self.interval_start),
            "peak_memory_gib": peak_memory_gib(self.device),
            "eta_s": (now - self.run_start) / (step - self.first_step)
            * (self.total_steps - step),
        }
        if (reserved := peak_reserved_gib(self.device)) is not None:
            record["peak_reserved_gib"] = reserved
        if (retries := alloc_retries(self.device)) is not None:
            record["alloc_retries"] = retries - self.retries  # in this interval
            self.retries = retries
        if self.peak_tflops:
            record["mfu_percent"] = 100 * mfu(tps, self.flops_per_token, self.peak_tflops)
        record.update(extra)
        self.logger.log(step, self.total_steps, record)
        self.interval_start, self.interval_steps, self.data_wait = time.perf_counter(), 0, 0.0
        return {"step": step, **record}

    def done_line(self, step: int, history: list[dict], run_dir: Path) -> str:
        """The line that ends a run: its steps, final loss, time, and where its outputs are."""
        steps = step - self.first_step
        span = f"steps {self.first_step + 1}-{step}" if self.first_step else f"{steps} steps"
        loss = f" | final loss {history[-1]['loss']:.4f}" if history else ""
        outputs = sorted(p.name + "/" * p.is_dir() for p in run_dir.iterdir())
        return (f"done: {span} in {format_eta(time.perf_counter() - self.run_start)}{loss} | "
                f"outputs in {run_dir}: {', '.join(outputs)}")
