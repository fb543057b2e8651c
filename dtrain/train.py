"""The trainer: ``torchrun --nproc_per_node=N -m dtrain.train --recipe debug`` or, from Python,
``Trainer(load_config("debug")).train()``.

One run, in order: config -> distributed init and mesh -> tokenizer and data loader -> model on
``meta`` -> parallelize -> ``to_empty`` + ``init_weights`` -> optimizer and LR schedule -> the loop
(gradient accumulation, clipping, step, metrics).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from dtrain.checkpoint import Checkpointer, load_model_weights
from dtrain.config import (
    Config,
    ConfigError,
    ModelConfig,
    TrainingConfig,
    help_text,
    load_config,
)
from dtrain.data.loader import Prefetcher, build_loader
from dtrain.data.tokenizer import Tokenizer, padded_vocab_size
from dtrain.metrics import (
    MetricsLogger,
    alloc_retries,
    mfu,
    model_flops_per_token,
    peak_memory_gib,
    peak_reserved_gib,
    peak_tflops,
)
from dtrain.models import Transformer, model_args
from dtrain.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_
from dtrain.parallel import ParallelDims, parallelize
from dtrain.parallel.context import check_cp, load_balanced_positions
from dtrain.parallel.expert import (
    check_ep,
    gather_moe_stats,
    moe_layers,
    moe_record,
    reset_moe_stats,
    update_expert_bias,
)
from dtrain.parallel.fp8 import (
    UnitScales,
    check_fp8,
    convert_to_fp8,
    fp8_all_gather,
    fuse_fp8_weight_cast,
    precompute_fp8_scales,
)
from dtrain.parallel.fsdp import keep_gathered
from dtrain.parallel.overlap import OverlappedStep, compute_stream
from dtrain.parallel.pipeline import (
    Pipeline,
    check_pipeline,
    ideal_bubble,
    parse_layout,
    split_model,
    stages_of_rank,
)
from dtrain.parallel.tensor import check_async_tp, check_tp


def init_distributed(device_kind: str, cpu_collectives: bool = False
                     ) -> tuple[torch.device, int, int]:
    """Joins the torchrun process group when there is one (NCCL on GPU, gloo on CPU; on GPU
    with ``cpu_collectives`` also gloo for CPU tensors, which asynchronous checkpoint saves
    need). Returns (device, rank, world size); a plain ``python`` process is rank 0 of 1."""
    use_cuda = device_kind == "cuda" or (device_kind == "auto" and torch.cuda.is_available())
    if device_kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device = 'cuda' but no CUDA device is visible: use 'auto' "
                          "or 'cpu'")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        backend = ("cuda:nccl,cpu:gloo" if cpu_collectives else "nccl") if use_cuda else "gloo"
        dist.init_process_group(backend,
                                device_id=device if use_cuda else None)
    rank = dist.get_rank() if dist.is_initialized() else 0
    return device, rank, world_size


def batch_arithmetic(cfg: TrainingConfig, dp: int) -> tuple[int, int]:
    """(global batch, gradient-accumulation steps) from the recipe: global = micro x dp x accum.
    Raises ConfigError when the given numbers do not divide."""
    micro = cfg.micro_batch_size
    if cfg.global_batch_size == 0:
        accum = cfg.grad_accum_steps or 1
        return micro * dp * accum, accum
    per_step = micro * dp
    if cfg.global_batch_size % per_step:
        raise ConfigError(
            f"training.global_batch_size = {cfg.global_batch_size} is not divisible by "
            f"micro_batch_size x data-parallel degree = {micro} x {dp} = {per_step}: use a "
            f"multiple of {per_step} or change micro_batch_size")
    accum = cfg.global_batch_size // per_step
    if cfg.grad_accum_steps not in (0, accum):
        raise ConfigError(
            f"training.grad_accum_steps = {cfg.grad_accum_steps} disagrees with "
            f"global_batch_size / (micro_batch_size x dp) = {accum}: set one of them to 0")
    return cfg.global_batch_size, accum


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy in fp32 (labels of -100 are ignored)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum",
                           ignore_index=-100)


def _plain(value: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (the loss under loss parallel) as a plain tensor."""
    return value.full_tensor() if isinstance(value, DTensor) else value


@dataclasses.dataclass
class BuiltModel:
    """Steps 4-7 of a run for this rank: the parallelized model parts, still on ``meta``."""
    parts: list[Transformer]
    stage_indices: list[int]
    num_stages: int
    num_params: int
    flops_per_token: int
    compute_dtype: torch.dtype
    fp8_layers: tuple[list[str], list[str]] | None
    fp8_all_gather: bool


def build_model(cfg: Config, dims: ParallelDims, mesh: DeviceMesh | None, device_type: str,
                tokenizer_vocab: int, microbatches: int) -> BuiltModel:
    """Builds the model of ``cfg.model`` on ``meta`` (vocabulary at least ``tokenizer_vocab``,
    padded for tp), checks it against the layout, converts it to FP8, splits this rank's
    pipeline stages (``microbatches`` per step) and parallelizes each over ``mesh``. Nothing
    is materialised: the trainer calls ``to_empty`` and ``init_weights``; the dry run
    (``dtrain.plan.dry_run``) counts the local shards. Raises ConfigError."""
    tcfg = cfg.training
    args = model_args(cfg.model.name, n_layers=cfg.model.n_layers,
                      vocab_size=cfg.model.vocab_size,
                      attention_backend=cfg.model.attention_backend)
    if args.n_experts:
        args = dataclasses.replace(args, **moe_overrides(cfg.model))
    # The embedding and output rows: at least the tokenizer's, padded so they split
    # evenly over tensor-parallel ranks; labels never use the padding rows.
    args.vocab_size = padded_vocab_size(max(args.vocab_size, tokenizer_vocab),
                                        cfg.data.vocab_size_divisible_by * dims.tp)
    if tcfg.seq_len > args.max_seq_len:
        raise ConfigError(f"training.seq_len = {tcfg.seq_len} exceeds the model's "
                          f"max_seq_len {args.max_seq_len}: use a shorter sequence")
    with torch.device("meta"):
        model = Transformer(args)
    if dims.tp > 1:
        check_tp(model, dims.tp, tcfg.seq_len)
        if cfg.parallel.async_tp:
            check_async_tp(device_type, cfg.compile.enabled)
    if dims.ep > 1:
        check_ep(model, dims.ep)
        if cfg.activation_checkpoint.mode == "op":
            raise ConfigError("activation_checkpoint.mode = 'op' is not available with "
                              "parallel.ep > 1 (the all-to-all dispatch breaks selective "
                              "recomputation): use 'full' or 'layer'")
    if args.n_experts and dims.tp > 1 and dims.ep == 1:
        raise ConfigError("an MoE model with parallel.tp > 1 needs parallel.ep > 1 (the MoE "
                          "runs on each rank's sequence shard): set parallel.ep")
    if dims.cp > 1:
        check_cp(model, dims.cp, dims.tp, tcfg.seq_len, cfg.parallel.cp_comm_type)
    num_params = model.num_params()
    flops = model_flops_per_token(model, tcfg.seq_len)
    fsdp = mesh is not None and dims.fsdp_enabled
    # (converted, kept) linear layer names; FP8 all-gather precomputes scales after each step.
    fp8_layers = convert_to_fp8(model, cfg.fp8, fsdp) if cfg.fp8.enabled else None
    all_gather_fp8 = fp8_all_gather(cfg.fp8, fsdp)
    if all_gather_fp8 and cfg.fp8.fused_weight_cast:
        fuse_fp8_weight_cast()

    parts, stage_indices, num_stages = [model], [0], 1
    if dims.pp > 1:
        pcfg = cfg.parallel
        check_pipeline(pcfg.pp_schedule, dims.pp, pcfg.pp_virtual_stages, microbatches,
                       cfg.compile.enabled)
        num_stages = dims.pp * pcfg.pp_virtual_stages
        specs = parse_layout(pcfg.pp_layout, args.n_layers, num_stages)
        stage_indices = stages_of_rank(dims.mesh("pp").get_local_rank(), dims.pp,
                                       pcfg.pp_virtual_stages, pcfg.pp_schedule)
        parts = split_model(model, specs, stage_indices)

    bf16 = tcfg.mixed_precision == "bf16" or (
        tcfg.mixed_precision == "auto" and device_type == "cuda")
    compute_dtype = torch.bfloat16 if bf16 else torch.float32
    # Each pipeline stage (or the whole model) is parallelized and initialised alike.
    parts = [parallelize(part, dims, mesh, cfg.parallel, cfg.activation_checkpoint, cfg.compile,
                         compute_dtype, cfg.fp8) for part in parts]
    return BuiltModel(parts, stage_indices, num_stages, num_params, flops, compute_dtype,
                      fp8_layers, all_gather_fp8)


class Trainer:
    """Builds everything a run needs from ``config`` and trains with ``train()``."""

    def __init__(self, config: Config):
        self.config = cfg = config
        async_save = cfg.checkpoint.enabled and cfg.checkpoint.async_save
        self.device, self.rank, self.world_size = init_distributed(cfg.training.device,
                                                                   cpu_collectives=async_save)
        self.dims = ParallelDims.from_config(cfg.parallel, self.world_size)
        # FSDP units on the GPU, without pipeline stages or offload: where the overlapped step
        # and the auto reshard policy apply.
        fsdp_units_on_gpu = (self.device.type == "cuda" and self.world_size > 1
                             and self.dims.fsdp_enabled and self.dims.pp == 1
                             and not cfg.parallel.fsdp_cpu_offload)
        # Each FSDP unit's update overlaps the next forward (dtrain.parallel.overlap). The
        # forward and backward then run on a stream of higher priority than the updates', so
        # that the GPU's block scheduler starts their kernels first.
        overlap = cfg.optimizer.overlap_step and fsdp_units_on_gpu
        if overlap:
            torch.cuda.set_stream(compute_stream(self.device))
        self.mesh = self.dims.build_mesh(self.device.type) if self.world_size > 1 else None
        if cfg.fp8.enabled:
            check_fp8(cfg.fp8, self.device, self.dims.tp, cfg.compile.enabled)
        self.global_batch, self.grad_accum = batch_arithmetic(cfg.training, self.dims.dp)
        self.tokens_per_step = self.global_batch * cfg.training.seq_len
        torch.manual_seed(cfg.training.seed)
        if cfg.training.deterministic:
            torch.use_deterministic_algorithms(True)

        tcfg = cfg.training
        self.tokenizer = Tokenizer(cfg.data.tokenizer, bos=cfg.data.bos_token or None,
                                   eos=cfg.data.eos_token or None)
        dp_mesh = self.dims.mesh("dp")
        dp_rank = dp_mesh.get_local_rank() if dp_mesh is not None else 0
        self.loader = Prefetcher(
            build_loader(cfg.data, self.tokenizer, tcfg.seq_len, tcfg.micro_batch_size, dp_rank,
                         self.dims.dp, tcfg.seed, num_samples=tcfg.steps * self.global_batch),
            pin_memory=self.device.type == "cuda")
        self.val_loader = self._build_val_loader(dp_rank)
        self._val_start = self.val_loader.state_dict() if self.val_loader else None

        if self.dims.pp > 1 and cfg.validation.enabled:
            raise ConfigError("validation.enabled with parallel.pp > 1 is not available in "
                              "this version: set validation.enabled = false")
        built = build_model(cfg, self.dims, self.mesh, self.device.type,
                            self.tokenizer.vocab_size, self.grad_accum)
        # Context parallel: each rank trains on its two chunks of every sequence, at these
        # positions (None without it).
        self.positions = None
        if self.dims.cp > 1:
            self.positions = load_balanced_positions(
                tcfg.seq_len, self.dims.cp, self.dims.mesh("cp").get_local_rank()).to(self.device)
        self.num_params, self.flops_per_token = built.num_params, built.flops_per_token
        self.fp8_layers, self.fp8_all_gather = built.fp8_layers, built.fp8_all_gather
        stage_indices, num_stages = built.stage_indices, built.num_stages
        self.compute_dtype = built.compute_dtype
        self.model_parts = built.parts
        # FSDP casts parameters itself; without it, autocast gives bf16 compute on fp32 weights.
        bf16 = self.compute_dtype == torch.bfloat16
        self.autocast = bf16 and not (self.mesh is not None and self.dims.fsdp_enabled)
        for part in self.model_parts:
            part.to_empty(device=self.device)
            part.init_weights(tcfg.seed, buffer_device=self.device)
            part.train()
        self.model = self.model_parts[0]
        # MoE aux losses: averaged over the forwards that see different tokens, as the LM loss.
        self.moe_layers = moe_layers(self.model_parts)  # by layer index; empty for dense models
        for moe in self.moe_layers.values():
            moe.aux_grad_scale = 1 / (self.grad_accum * self.dims.tp)
        # With loss parallel the logits are vocabulary-sharded DTensors: forward, loss and
        # backward run under loss_parallel(), and the loss is left uncompiled.
        self.loss_parallel = self.dims.tp > 1 and cfg.parallel.loss_parallel
        self.loss_fn = torch.compile(cross_entropy_sum) \
            if cfg.compile.enabled and not self.loss_parallel else cross_entropy_sum

        self.pipeline = None
        if self.dims.pp > 1:
            self.pipeline = Pipeline(
                self.model_parts, stage_indices, num_stages, cfg.parallel.pp_schedule,
                self.grad_accum, self.dims.mesh("pp"), self.device, self.loss_fn,
                loss_scale=self.dims.dp * self.dims.cp / self.tokens_per_step)
            for part in self.model_parts:  # stages are called with their input alone
                part.positions = self.positions
        self.optimizer = build_optimizer(self.model_parts, cfg.optimizer, self.device.type)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.lr_schedule, tcfg.steps,
                                            cfg.optimizer.lr)
        self.overlapped_step = None
        if overlap:
            # FP8 all-gather: each unit's scales right after its update, on a communicator of
            # their own (fp8.UnitScales).
            scales = UnitScales(self.model_parts, dist.new_group()) if self.fp8_all_gather \
                else None
            self.overlapped_step = OverlappedStep(self.optimizer, self.model_parts, self.device,
                                                  after_unit=scales)
        # parallel.fsdp_reshard_after_forward = "auto": fitted to the memory after two steps.
        self._auto_reshard = (cfg.parallel.fsdp_reshard_after_forward == "auto"
                              and fsdp_units_on_gpu)
        self.step = 0
        self.checkpointer = None
        if cfg.checkpoint.enabled:
            rank_local = cfg.data.source == "hf"  # streamed data keeps a state per data rank
            self.checkpointer = Checkpointer(
                cfg.checkpoint, Path(cfg.job.output_dir) / cfg.job.name, self.model_parts,
                self.optimizer, self.scheduler, self.loader,
                data_key=f"dp{dp_rank}" if rank_local else "global")
            load_start = time.perf_counter()
            self.step = self.checkpointer.load()
            if self.step and self.rank == 0:
                print(f"checkpoint step {self.step} loaded in "
                      f"{time.perf_counter() - load_start:.2f}s", flush=True)
        if cfg.checkpoint.initial_weights and self.step == 0:
            load_model_weights(self.model_parts, cfg.checkpoint.initial_weights)
        self.history: list[dict[str, float]] = []
        self.val_history: list[dict[str, float]] = []

        self.run_dir = Path(cfg.job.output_dir) / cfg.job.name
        self.metrics = MetricsLogger(cfg.metrics, self.run_dir, enabled=self.rank == 0)
        self.peak_tflops = peak_tflops(self.device, cfg.metrics.peak_tflops)
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.toml").write_text(cfg.to_toml())
            print(cfg.to_toml())
            print(f"model {cfg.model.name}: {self.num_params / 1e6:,.1f}M parameters | "
                  f"world {self.world_size} ({self.device.type}) | dp {self.dims.dp} | global "
                  f"batch {self.global_batch} x {tcfg.seq_len} tokens = micro "
                  f"{tcfg.micro_batch_size} x dp {self.dims.dp} x accum {self.grad_accum} | "
                  f"{self.compute_dtype} compute | run folder {self.run_dir}", flush=True)
            if self.fp8_layers is not None:
                converted, kept = self.fp8_layers
                print(f"fp8: {cfg.fp8.backend} {cfg.fp8.recipe}"
                      f"{' with FP8 all-gather' if self.fp8_all_gather else ''} | "
                      f"{len(converted)} linear layers in FP8, {len(kept)} kept "
                      f"({', '.join(kept[:4])}{', ...' if len(kept) > 4 else ''})", flush=True)
            if self.pipeline is not None:
                pcfg = cfg.parallel
                bubble = ideal_bubble(pcfg.pp_schedule, self.dims.pp, pcfg.pp_virtual_stages,
                                      self.grad_accum)
                print(f"pipeline: {pcfg.pp_schedule}, pp {self.dims.pp} x "
                      f"{pcfg.pp_virtual_stages} stages per rank, {self.grad_accum} "
                      f"microbatches: ideal bubble {100 * bubble:.1f}% of compute time",
                      flush=True)

    def _build_val_loader(self, dp_rank: int):
        """The validation loader: ``validation.path`` in the training source's format, or the
        indexed source's valid split; None when validation is off."""
        vcfg, data, tcfg = self.config.validation, self.config.data, self.config.training
        if not vcfg.enabled:
            return None
        if vcfg.path:
            data, split_name = dataclasses.replace(data, path=vcfg.path, split="1,0,0"), "train"
        elif data.source == "indexed":
            split_name = "valid"
        else:
            raise ConfigError(f"validation.enabled with data.source = '{data.source}' needs "
                              "validation.path: set it to a held-out file")
        samples = vcfg.steps * tcfg.micro_batch_size * self.dims.dp
        return build_loader(data, self.tokenizer, tcfg.seq_len, tcfg.micro_batch_size, dp_rank,
                            self.dims.dp, tcfg.seed, num_samples=samples, split_name=split_name)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean token loss over the validation batches (the same ones at every call)."""
        steps, seq = self.config.validation.steps, self.config.training.seq_len
        self.val_loader.load_state_dict(self._val_start)
        self.model.eval()  # validation runs without pipeline parallel (refused at start-up)
        total = torch.zeros((), device=self.device)
        for _ in range(steps):
            inputs, labels = self._local_tokens(*self.val_loader.next_batch())
            with self._step_context():
                loss = self.loss_fn(self.model(inputs, self.positions), labels)
            total += _plain(loss)
        self.model.train()
        tokens = steps * self.config.training.micro_batch_size * self.dims.dp * seq
        return (self._reduce_sum(total) / tokens).item()

    def _local_tokens(self, inputs: torch.Tensor,
                      labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A micro-batch on the device, cut to this rank's tokens under context parallel."""
        inputs = inputs.to(self.device, non_blocking=True)
        labels = labels.to(self.device, non_blocking=True)
        if self.positions is None:
            return inputs, labels
        return inputs[:, self.positions], labels[:, self.positions]

    def _step_context(self):
        """Autocast (bf16 without FSDP) and loss parallel, as the run needs."""
        stack = contextlib.ExitStack()
        if self.autocast:
            stack.enter_context(torch.autocast(self.device.type, dtype=self.compute_dtype))
        if self.loss_parallel:
            stack.enter_context(loss_parallel())
        return stack

    def _reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks that hold different data."""
        if (mesh := self.dims.mesh("dp_cp")) is not None and mesh.size() > 1:
            dist.all_reduce(value, group=mesh.get_group())
        return value

    def moe_stats(self) -> torch.Tensor:
        """The MoE layers' statistics of the last step over all ranks (``gather_moe_stats``)."""
        groups = [self.dims.mesh(n).get_group() for n in ("dp_cp", "tp", "pp")
                  if self.dims.mesh(n) is not None]
        args = self.model.args
        return gather_moe_stats(self.moe_layers, args.n_layers, args.n_experts, groups)

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimizer step over the global batch. Returns (mean token loss, gradient norm)
        as device tensors and the seconds spent waiting for data."""
        loss_sum, grad_norm, data_wait = self._run_step()
        self.wait_for_update()
        return self._mean_loss(loss_sum), grad_norm, data_wait

    def _mean_loss(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """Mean token loss over the global batch from each rank's ``_run_step`` loss sum."""
        return self._reduce_sum(loss_sum) / self.tokens_per_step

    def _run_step(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """``train_step`` as the training loop runs it: returns this rank's summed token loss
        (``_mean_loss`` reduces it, a synchronisation of the ranks the loop makes only when it
        logs), and with the overlapped step (``optimizer.overlap_step``) the weight updates may
        still be running on their side stream. The next step's forward waits for them unit by
        unit; anything else reading the weights calls ``wait_for_update()`` first."""
        tcfg = self.config.training
        # Each rank's gradient is averaged over dp x cp by FSDP (a cp rank's loss covers only
        # its tokens); scale so the result is the gradient of the mean token loss over the whole
        # global batch.
        scale = self.dims.dp * self.dims.cp / self.tokens_per_step
        loss_sum = torch.zeros((), device=self.device)
        data_wait = 0.0
        reset_moe_stats(self.moe_layers)
        if self.pipeline is not None:
            start = time.perf_counter()
            batches = [self.loader.next_batch() for _ in range(self.grad_accum)]
            inputs, labels = self._local_tokens(torch.cat([b[0] for b in batches]),
                                                torch.cat([b[1] for b in batches]))
            data_wait += time.perf_counter() - start
            with self._step_context():
                loss_sum = self.pipeline.step(inputs, labels)
            # The last stage holds the loss: sum over the stages gives it to every rank.
            dist.all_reduce(loss_sum, group=self.dims.mesh("pp").get_group())
        for _ in range(self.grad_accum if self.pipeline is None else 0):
            start = time.perf_counter()
            inputs, labels = self._local_tokens(*self.loader.next_batch())
            data_wait += time.perf_counter() - start
            with self._step_context():
                loss = self.loss_fn(self.model(inputs, self.positions), labels)
                (loss * scale).backward()
            loss_sum += _plain(loss.detach())
        pp_mesh = self.dims.mesh("pp")
        grad_norm = clip_grad_norm_([p for part in self.model_parts for p in part.parameters()],
                                    tcfg.max_norm, pp_mesh.get_group() if pp_mesh else None,
                                    self.optimizer)
        if self.checkpointer:
            self.checkpointer.wait_staged()  # an async save may still be copying the weights
        if self.overlapped_step is not None:
            self.overlapped_step.step()
        else:
            self.optimizer.step()
        if self.model.args.n_experts and self.model.args.moe_router == "sigmoid":
            update_expert_bias(self.moe_layers, self.moe_stats(),
                               self.config.model.moe_bias_update_rate)
        if self.fp8_all_gather and self.overlapped_step is None:  # else set unit by unit
            precompute_fp8_scales(self.model_parts)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, grad_norm, data_wait

    def wait_for_update(self) -> None:
        """The device's compute stream waits for the last step's weight updates (a no-op
        unless ``_run_step`` left them running)."""
        if self.overlapped_step is not None:
            self.overlapped_step.wait()

    def train(self, until: int | None = None) -> list[dict[str, float]]:
        """Runs to ``training.steps`` (or stops after step ``until``: the schedule still spans
        ``training.steps``); returns the logged records (also in metrics.jsonl)."""
        tcfg = self.config.training
        last = min(until or tcfg.steps, tcfg.steps)
        run_start, first_step = time.perf_counter(), self.step  # first_step > 0 after a resume
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._retries_logged = alloc_retries(self.device) or 0
        with manual_gc(tcfg.gc_interval) as collect:
            self._train_loop(last, first_step, run_start, collect)
        self.wait_for_update()  # the weights are the last step's for whatever reads them next
        if self.checkpointer:
            self.checkpointer.close()
        self.loader.close()
        self.metrics.close()
        return self.history

    def _train_loop(self, last: int, first_step: int, run_start: float, collect) -> None:
        tcfg, mcfg = self.config.training, self.config.metrics
        interval_start, interval_steps, data_wait = run_start, 0, 0.0
        while self.step < last:
            lr = self.optimizer.param_groups[0]["lr"]
            # The updates may overlap the next step's forward; saves and the end wait for them.
            loss_sum, grad_norm, wait = self._run_step()
            self.step += 1
            collect(self.step)
            if self._auto_reshard and self.step - first_step == 2:
                self._fit_resharding()
            interval_steps += 1
            data_wait += wait
            ckpt = self.config.checkpoint
            if self.checkpointer and (self.step % ckpt.interval == 0 or self.step == tcfg.steps):
                save_start = time.perf_counter()
                self.wait_for_update()
                self.checkpointer.save(self.step)
                stall = time.perf_counter() - save_start
                interval_start += stall  # not counted as step time
                if self.rank == 0:
                    print(f"checkpoint step {self.step}: training paused {stall:.2f}s"
                          + (" (written in the background)" if ckpt.async_save else ""),
                          flush=True)
            vcfg = self.config.validation
            if vcfg.enabled and (self.step % vcfg.interval == 0 or self.step == tcfg.steps):
                eval_start = time.perf_counter()
                val_loss = self.evaluate()
                self.val_history.append({"step": self.step, "val_loss": val_loss})
                self.metrics.log_validation(self.step, val_loss)
                interval_start += time.perf_counter() - eval_start  # not counted as step time
            if self.step % mcfg.log_every and self.step != last:
                continue
            loss = self._mean_loss(loss_sum)
            loss_value, norm_value = loss.item(), grad_norm.item()  # waits for the device
            now = time.perf_counter()
            step_time = (now - interval_start) / interval_steps
            tps = self.tokens_per_step / step_time / self.world_size
            record = {
                "loss": loss_value, "grad_norm": norm_value, "lr": lr,
                "tokens_per_second_per_device": tps,
                "tflops_per_device": tps * self.flops_per_token / 1e12,
                "step_time_s": step_time,
                "data_wait_percent": 100 * data_wait / (now - interval_start),
                "peak_memory_gib": peak_memory_gib(self.device),
                "eta_s": (now - run_start) / (self.step - first_step)
                * (tcfg.steps - self.step),
            }
            if (reserved := peak_reserved_gib(self.device)) is not None:
                record["peak_reserved_gib"] = reserved
            if (retries := alloc_retries(self.device)) is not None:
                record["alloc_retries"] = retries - self._retries_logged  # in this interval
                self._retries_logged = retries
            if self.peak_tflops:
                record["mfu_percent"] = 100 * mfu(tps, self.flops_per_token, self.peak_tflops)
            # A pipeline's first step also runs each stage once on placeholder inputs (shape
            # inference), which the MoE statistics would count.
            if self.model.args.n_experts and not (self.pipeline and self.step == first_step + 1):
                record.update(moe_record(self.moe_stats()))
            self.history.append({"step": self.step, **record})
            self.metrics.log(self.step, tcfg.steps, record)
            interval_start, interval_steps, data_wait = time.perf_counter(), 0, 0.0

    def _fit_resharding(self) -> None:
        """The ``auto`` reshard policy, once the second step has shown the steady peak (the
        first has no optimizer state yet): the last blocks keep their gathered weights from
        forward to backward while the peak stays within ``fsdp_auto_memory_fraction`` of the
        device's memory (``keep_gathered``). The ranks take the smallest headroom among them,
        so that all skip the same all-gathers."""
        self._auto_reshard = False
        total = torch.cuda.get_device_properties(self.device).total_memory
        peak = torch.cuda.max_memory_allocated(self.device)
        budget = self.config.parallel.fsdp_auto_memory_fraction * total
        headroom = torch.tensor(budget - peak, dtype=torch.float64, device=self.device)
        dist.all_reduce(headroom, op=dist.ReduceOp.MIN)
        kept = keep_gathered(self.model, max(int(headroom.item()), 0), self.compute_dtype)
        if self.rank == 0:
            print(f"fsdp auto: {kept} of {self.model.args.n_layers - 1} blocks keep their "
                  f"gathered weights from forward to backward (peak {peak / 2**30:.1f} GiB, "
                  f"budget {budget / 2**30:.1f} GiB)", flush=True)

    def close(self) -> None:
        """Leaves the process group (for notebooks that build several trainers)."""
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def manual_gc(interval: int):
    """Python's automatic garbage collection off for the block, and a function of the step that
    collects the young generations every ``interval`` steps; the collector's state is restored
    after (notebooks go on with it). ``interval`` 0: nothing changes."""
    if interval <= 0:
        yield lambda step: None
        return
    was_enabled = gc.isenabled()
    gc.collect(1)  # the young generations (a full collection walks the whole heap)
    gc.disable()
    try:
        yield lambda step: gc.collect(1) if step % interval == 0 else None
    finally:
        if was_enabled:
            gc.enable()


def moe_overrides(cfg: ModelConfig) -> dict[str, object]:
    """``LlamaArgs`` fields an MoE preset takes from the [model] section."""
    fields: dict[str, object] = {"moe_capacity_factor": cfg.moe_capacity_factor,
                                 "moe_gemm": cfg.moe_gemm}
    if cfg.moe_aux_loss_coeff >= 0:
        fields["moe_aux_loss_coeff"] = cfg.moe_aux_loss_coeff
    if cfg.moe_z_loss_coeff >= 0:
        fields["moe_z_loss_coeff"] = cfg.moe_z_loss_coeff
    if cfg.moe_router != "preset":
        fields["moe_router"] = cfg.moe_router
    return fields


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dtrain.train", add_help=False,
        description="Train a model from a recipe; any config field can be overridden with "
                    "--section.key value.")
    parser.add_argument("--recipe", help="recipe name (recipes/NAME.toml) or path")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config and exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="build one rank at the full world size on a fake process group "
                             "(meta weights, no GPU) and print its memory, then exit")
    parser.add_argument("--dry-run-world-size", type=int, default=0,
                        help="world size of the dry run (default: the product of the recipe's "
                             "parallel degrees; needed when dp_shard = -1)")
    parser.add_argument("--dry-run-rank", type=int, default=0, help="rank the dry run builds")
    parser.add_argument("-h", "--help", action="store_true", help="show every config field")
    known, overrides = parser.parse_known_args(argv)
    if known.help:
        parser.print_help()
        print("\nconfig fields:\n" + help_text())
        return 0
    rank = int(os.environ.get("RANK", "0"))
    try:
        config = load_config(known.recipe, overrides)
        if known.print_config:
            print(config.to_toml())
            return 0
        if known.dry_run:
            from dtrain.plan.dry_run import dry_run

            print(dry_run(config, known.dry_run_world_size or None, known.dry_run_rank).format())
            return 0
        trainer = Trainer(config)
        trainer.train()
        trainer.close()
    except (ConfigError, FileNotFoundError) as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
