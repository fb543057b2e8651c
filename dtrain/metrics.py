"""Throughput and MFU arithmetic, memory readings, and the console / TensorBoard / JSON-lines log.

Conventions (torchtitan's, so figures compare directly): tokens/s per GPU = tokens in the step /
step time / number of GPUs; FLOPs per token = 6 x non-embedding parameters (active parameters for
MoE) + 12 x layers x heads x head_dim x seq_len (6 x heads x (qk + v head widths) where they
differ, as in MLA); MFU against the dense bf16 peak of the device, also for FP8 runs.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dtrain.config import MetricsConfig
from dtrain.log import logger
from dtrain.models.llama import Transformer
from dtrain.tensorboard_log import TensorBoardWriter

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
                    seq_len: int, v_head_dim: int | None = None) -> int:
    """Training FLOPs per token: 6N for the matmuls over weights (forward 2N, backward 4N)
    and 6 L H (d + d_v) T for attention scores and values (causal masking not discounted):
    12 L H d T where the value heads are as wide as the query/key heads (``v_head_dim`` None),
    as they are not in DeepSeek's latent attention."""
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    return 6 * num_params + 6 * n_layers * n_heads * (head_dim + v_head_dim) * seq_len


def model_flops_per_token(model: Transformer, seq_len: int) -> int:
    """``flops_per_token`` for a whole (unsharded, possibly meta) model: the parameters of its
    modules as built (any head width, biases, the dense blocks of an MoE model whole, the
    multi-token prediction depths), the routed experts of MoE blocks by the share a token uses
    (top_k of n_experts), the output layer once more for each MTP depth (each depth's logits
    come from it), and attention scores and values in every block (the depths' too) over
    n_heads x the query/key and value head widths (MLA's qk_nope + qk_rope and v_head_dim)."""
    args = model.args
    depths = len(model.mtp) if model.mtp is not None else 0
    params = model.num_params(exclude_embedding=True, active=True)
    params += depths * args.vocab_size * args.dim
    if args.attention == "mla":
        qk, v = args.qk_nope_head_dim + args.qk_rope_head_dim, args.v_head_dim
    else:
        qk = v = args.head_dim
    return flops_per_token(params, args.n_layers + depths, args.n_heads, qk, seq_len, v)


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
    """Writes one record per logged step to the console, TensorBoard (``<run>/tb/<job>``, see
    ``dtrain.tensorboard_log``: grouped tags, ``config_toml`` as text) and
    ``<run>/metrics.jsonl``. Only the rank given ``enabled=True`` writes. The files open at the
    first record and again after ``close`` (a notebook's second ``train()``). Opening
    metrics.jsonl drops its lines that do not parse (a torn last line: the process was stopped
    while writing it); a run resumed at ``resume_step`` also drops the records after that step,
    which it trains again, from metrics.jsonl and TensorBoard (``purge_step``), so each step is
    there once. The JSON lines are strict JSON: a non-finite number is written as null. A write
    to either file that fails (a full or read-only disk) is reported once; the records then go
    to the console only and training goes on."""

    def __init__(self, cfg: MetricsConfig, run_dir: Path, enabled: bool, resume_step: int = 0,
                 config_toml: str = ""):
        self.cfg, self.run_dir, self.enabled = cfg, run_dir, enabled
        self.jsonl_path = run_dir / "metrics.jsonl"
        self.tensorboard_dir = run_dir / "tb" / run_dir.name  # the run folder is the job's name
        self._purge = resume_step
        self._config_toml = config_toml  # written once, at the first open
        self._writer: TensorBoardWriter | None = None
        self._jsonl = None
        self._last_step = resume_step
        self._files_failed = False

    def describe(self) -> str | None:
        """The start-up summary's line: how to open TensorBoard (None without it)."""
        return self.tensorboard_command if self.cfg.tensorboard else None

    @property
    def tensorboard_command(self) -> str:
        """How to see this run in TensorBoard, and where to look."""
        return (f"tensorboard --logdir {self.tensorboard_dir.parent} (Custom Scalars tab: the "
                "loss first; Text tab: the config)")

    def _open(self) -> None:
        if self._jsonl is not None or self._files_failed:
            return
        purge, self._purge = self._purge, 0
        self._to_file(self.jsonl_path, self._open_jsonl, purge)
        if self.cfg.tensorboard:
            self._to_file(self.tensorboard_dir, self._open_tensorboard, purge)

    def _open_jsonl(self, purge: int) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _drop_unparsed_and_later_records(self.jsonl_path, after_step=purge)
        self._jsonl = open(self.jsonl_path, "a")

    def _open_tensorboard(self, purge: int) -> None:
        config, self._config_toml = self._config_toml, ""
        self._writer = TensorBoardWriter(self.tensorboard_dir, purge + 1 if purge else None,
                                         config, config_step=purge)

    def _to_file(self, path: Path, write: Callable[..., object], *args) -> None:
        """``write(*args)``, a write to ``path`` in the run folder, unless one failed before.
        The first OSError is reported in one line and ends the writes to both files (they share
        the run folder's disk): the records go on to the console alone."""
        if self._files_failed:
            return
        try:
            write(*args)
        except OSError as error:
            self._files_failed = True
            logger.warning(f"metrics: writing {path} failed ({type(error).__name__}: {error}); "
                           f"this run's metrics go to the console only from step "
                           f"{self._last_step} on; training goes on")
            self._release()

    def _write_jsonl(self, record: dict) -> None:
        self._jsonl.write(json.dumps(_strict(record), allow_nan=False) + "\n")
        self._jsonl.flush()

    def _record(self, step: int, record: dict) -> None:
        """``record`` to metrics.jsonl and TensorBoard."""
        self._last_step = step
        self._open()
        self._to_file(self.jsonl_path, self._write_jsonl, record)
        if self._writer is not None:
            self._to_file(self.tensorboard_dir, self._writer.write, step, record)

    def log(self, step: int, total_steps: int, record: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **record, "time": time.time()}
        self._record(step, record)
        logger.info(self.format_line(step, total_steps, record))

    def log_validation(self, step: int, loss: float) -> None:
        """Validation loss and perplexity: console, TensorBoard (train/val_loss,
        train/val_perplexity) and metrics.jsonl."""
        if not self.enabled:
            return
        perplexity = math.exp(min(loss, 50.0))
        self._record(step, {"step": step, "val_loss": loss, "val_perplexity": perplexity,
                            "time": time.time()})
        logger.info(f"validation step {step} | loss {loss:.4f} | perplexity {perplexity:.2f}")

    @staticmethod
    def format_line(step: int, total_steps: int, r: dict[str, float]) -> str:
        parts = [f"step {step:>{len(str(total_steps))}}/{total_steps}",
                 f"loss {r['loss']:.4f}", f"grad_norm {r['grad_norm']:.3f}",
                 f"lr {r['lr']:.2e}", f"{r['tokens_per_second_per_device']:,.0f} tok/s/dev",
                 f"{r['tflops_per_device']:.1f} TFLOP/s"]
        if "mfu_percent" in r:
            parts.append(f"MFU {r['mfu_percent']:.1f}%")
        if "mtp_loss" in r:
            parts.append(f"mtp {r['mtp_loss']:.4f}")
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
        """Closes the files (the next record opens them again); a failed final write is reported
        like any other, never raised."""
        if self._writer is not None:
            self._to_file(self.tensorboard_dir, self._writer.close)
        if self._jsonl is not None:
            self._to_file(self.jsonl_path, self._jsonl.close)
        self._release()

    def _release(self) -> None:
        """Closes what is open, its errors already reported or not worth a second line."""
        for file in (self._writer, self._jsonl):
            if file is not None:
                with contextlib.suppress(OSError):
                    file.close()
        self._writer = self._jsonl = None


def _drop_unparsed_and_later_records(path: Path, after_step: int = 0) -> None:
    """Drops from the JSON lines at ``path`` (if any) each line that is not a JSON object, with
    one warning (a torn last line: the process was stopped while writing it), and when
    ``after_step`` is set the records of later steps. Rewritten only when something changes,
    through a synced temporary file, so a crash or a full disk midway leaves the old file."""
    if not path.is_file():
        return
    old = path.read_bytes()
    lines = [line for line in old.split(b"\n") if line.strip()]
    records = [_json_object(line) for line in lines]
    kept = [line for line, record in zip(lines, records, strict=True) if record is not None
            and (not after_step or record.get("step", 0) <= after_step)]
    torn_last = bool(records) and records[-1] is None
    unparsed = records.count(None) - torn_last
    dropped = ["a torn last line (the process was stopped while writing it)"] * torn_last
    if unparsed:
        dropped.append(f"{unparsed} {'earlier ' * torn_last}line{'s' * (unparsed > 1)} that "
                       f"{'do' if unparsed > 1 else 'does'} not parse as a JSON object")
    new = b"".join(line + b"\n" for line in kept)
    if new != old:
        _replace(path, new)
    if dropped:
        logger.warning(f"{path}: dropped {' and '.join(dropped)}")


def _json_object(line: bytes) -> dict | None:
    with contextlib.suppress(ValueError):
        if isinstance(record := json.loads(line), dict):
            return record
    return None


def _replace(path: Path, data: bytes) -> None:
    """``path`` holds ``data``, or (a crash or an error midway) what it held before."""
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        with open(temporary, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        raise


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
        try:
            outputs = ": " + ", ".join(sorted(p.name + "/" * p.is_dir() for p in run_dir.iterdir()
                                              if not p.name.startswith(".")))  # the lock
        except OSError as error:
            outputs = f" (not listed: {error.strerror})"
        return (f"done: {span} in {format_eta(time.perf_counter() - self.run_start)}{loss} | "
                f"outputs in {run_dir}{outputs}")
