"""What one training run is made of, built from its config in the order of docs' flow of a run:
checks -> process group and mesh -> tokenizer and data -> model (meta, FP8, stages, parallelize)
-> materialised weights -> optimizer, schedule and update -> checkpoint resume -> metrics,
validation and the step hooks. ``dtrain.trainer.Trainer`` is a ``Run`` that trains.

Each piece comes from the builder next to its code; the cross-section decisions of a run (which
step strategy, which hooks, which update) are made here and nowhere else.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from dtrain.build import (
    batch_arithmetic,
    build_loaders,
    build_loss,
    build_model,
    build_optimizer_and_schedule,
    build_tokenizer,
    data_settings,
    init_distributed,
    local_device,
    world_size,
)
from dtrain.checkpoint import Checkpointer, load_model_weights, resumable
from dtrain.checks import validate
from dtrain.config import Config
from dtrain.hooks import Hooks, StepHook
from dtrain.log import logger, setup_logging
from dtrain.metrics import MetricsLogger, StepMetrics
from dtrain.nonfinite import NonFiniteSteps
from dtrain.parallel import (
    AutoReshard,
    MoEStats,
    OverlappedStep,
    Pipeline,
    UnitScales,
    build_update,
    eager_fp8_warning,
    fp8_step_hooks,
    fsdp_units_on_gpu,
    moe_layers,
)
from dtrain.preemption import Preemption, forget_preemption, stop_if_restarted_after_preemption
from dtrain.run_folder import RunFolder
from dtrain.step import Accumulation, DeviceBatches, step_context
from dtrain.step_weights import StepPlan, step_weight_hooks
from dtrain.validation import Validator
from dtrain.watchdog import HangWatchdog, collective_timeout_s, nccl_debug_env


class Run:
    """Builds every component of a run from ``config``; raises ConfigError (before any process
    group exists, for everything ``validate`` checks)."""

    def __init__(self, config: Config):
        self.config = cfg = config
        device = local_device(cfg.training.device)
        self.dims = validate(cfg, world_size(), device)
        self.device = device
        self.run_dir = Path(cfg.job.output_dir) / cfg.job.name
        # Collectives time out a minute after the watchdog (dtrain.watchdog) would have ended a
        # rank without progress: the watchdog, which writes the stacks, speaks first.
        timeout = collective_timeout_s(cfg.training)
        if device.type == "cuda":
            nccl_debug_env(self.run_dir, int(os.environ.get("RANK", "0")))
        self.rank, self.world_size = init_distributed(device, timeout)
        setup_logging(self.rank)
        stop_if_restarted_after_preemption(self.run_dir)
        # Host-side agreements (preemption, checkpoint checks) over CPU tensors: no device sync.
        self.cpu_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout)) \
            if self.world_size > 1 else None
        self.folder = RunFolder.claim(self.run_dir, resumable(cfg.checkpoint, self.run_dir),
                                      cfg.job.overwrite, self.rank, self.cpu_group)
        try:
            self._build()
        except BaseException:  # a run that cannot start leaves its folder free for the next
            self.folder.release()
            raise

    def _build(self) -> None:
        cfg, device = self.config, self.device
        if self.rank == 0:
            forget_preemption(self.run_dir)
        self.mesh = self.dims.build_mesh(device.type) if self.world_size > 1 else None
        self.watchdog = HangWatchdog.for_training(cfg.training, self.run_dir, self.rank)
        self.preemption = Preemption(self.cpu_group, interrupt=cfg.checkpoint.enabled)
        self.global_batch, self.grad_accum = batch_arithmetic(cfg.training, self.dims.dp)
        self.tokens_per_step = self.global_batch * cfg.training.seq_len
        torch.manual_seed(cfg.training.seed)
        if cfg.training.deterministic:
            torch.use_deterministic_algorithms(True)
        self._build_data()
        self._build_model()
        self._build_training()
        self._build_reporting()
        self._announce()

    def _build_data(self) -> None:
        cfg, dp_mesh = self.config, self.dims.mesh("dp")
        self.dp_rank = dp_mesh.get_local_rank() if dp_mesh is not None else 0
        self.tokenizer = build_tokenizer(cfg.data)
        self.loader, self.val_loader = build_loaders(
            cfg.data, cfg.validation, cfg.training, self.tokenizer, self.dp_rank, self.dims.dp,
            self.global_batch, pin_memory=self.device.type == "cuda")

    def _build_model(self) -> None:
        cfg, dims = self.config, self.dims
        built = build_model(cfg, dims, self.mesh, self.device.type, self.tokenizer.vocab_size,
                            self.grad_accum)
        self.num_params, self.flops_per_token = built.num_params, built.flops_per_token
        self.fp8_layers, self.fp8_all_gather = built.fp8_layers, built.fp8_all_gather
        self.model_features = built.features
        self.compute_dtype, self.model_parts = built.compute_dtype, built.parts
        for part in self.model_parts:
            part.to_empty(device=self.device)
            part.init_weights(cfg.training.seed, buffer_device=self.device)
            part.train()
        self.model = self.model_parts[0]
        # FSDP casts parameters itself; without it, autocast gives bf16 compute on fp32 weights.
        self.autocast = self.compute_dtype == torch.bfloat16 and not (
            self.mesh is not None and dims.fsdp_enabled)
        # With loss parallel the logits are vocabulary-sharded DTensors: the loss runs under
        # loss_parallel() and is left uncompiled.
        sharded_loss = dims.tp > 1 and cfg.parallel.loss_parallel
        self.loss_fn = build_loss(cfg, dims, self.device, self.model.args, self.tokens_per_step,
                                  [dims.mesh(n).get_group() for n in ("dp_cp", "pp")
                                   if dims.mesh(n) is not None])
        self.context = step_context(self.device.type, self.compute_dtype, self.autocast,
                                    sharded_loss)
        # Each rank's gradient is averaged over dp x cp by FSDP (a cp rank's loss covers only its
        # tokens): scaled so that the result is the gradient of the global batch's mean loss.
        scale = dims.dp * dims.cp / self.tokens_per_step
        self.pipeline = None
        if dims.pp > 1:
            self.pipeline = Pipeline(
                self.model_parts, built.stage_indices, built.num_stages,
                cfg.parallel.pp_schedule, self.grad_accum, dims.mesh("pp"), self.device,
                self.loss_fn, loss_scale=scale, context=self.context)
        self.forward_backward = self.pipeline or Accumulation(
            self.model, self.loss_fn, self.grad_accum, scale, self.context)
        self.batches = DeviceBatches(self.loader, self.device, self.model.positions,
                                     self.model.args.mtp_depths)

    def _build_training(self) -> None:
        cfg, tcfg = self.config, self.config.training
        self.optimizer, self.scheduler = build_optimizer_and_schedule(cfg, self.model_parts,
                                                                       self.device.type)
        units_on_gpu = fsdp_units_on_gpu(self.device, self.world_size, self.dims.fsdp_enabled,
                                         self.dims.pp, cfg.parallel.fsdp_cpu_offload)
        overlap = cfg.optimizer.overlap_step and (units_on_gpu or self.whole_weights_on_gpu())
        # FP8 all-gather under the overlapped step: each unit's scales right after its update,
        # on a communicator of their own (fp8.UnitScales).
        unit_scales = UnitScales(self.model_parts, dist.new_group()) \
            if overlap and self.fp8_all_gather else None
        self.update = build_update(self.optimizer, self.model_parts, self.device, overlap,
                                   after_unit=unit_scales)
        self.checkpointer = None
        self.step = 0
        if cfg.checkpoint.enabled:
            self.checkpointer = Checkpointer(cfg.checkpoint, self.run_dir, self.model_parts,
                                             self.optimizer, self.scheduler, self.loader,
                                             tcfg.steps, self.cpu_group,
                                             data_settings(cfg.data, tcfg.seq_len))
            self.step = self.checkpointer.load()
        if cfg.checkpoint.initial_weights and self.step == 0:
            load_model_weights(self.model_parts, cfg.checkpoint.initial_weights)
        moe = moe_layers(self.model_parts)  # by layer index; empty for dense models
        args = self.model.args
        groups = [self.dims.mesh(n).get_group() for n in ("dp_cp", "tp", "pp")
                  if self.dims.mesh(n) is not None]
        dp_cp = self.dims.mesh("dp_cp")
        self.nonfinite = NonFiniteSteps(tcfg.nonfinite, tcfg.max_nonfinite_steps,
                                        dp_cp.get_group() if dp_cp is not None else None)
        self.nonfinite.on_skip = self.scheduler.uncount_step  # the schedule counts updates
        self.hooks = Hooks([
            self.nonfinite,
            self.checkpointer,
            self.loss_fn if isinstance(self.loss_fn, StepHook) else None,  # MTP's log
            MoEStats(moe, args.n_layers + args.mtp_depths, args.n_experts, groups,
                     cfg.model.moe_bias_update_rate)
            if moe else None,
            *fp8_step_hooks(self.model_parts, cfg.fp8, self.dims.fsdp_enabled,
                            self.fp8_all_gather, overlap),
            *step_weight_hooks(self.model_parts, self._step_plan()),
            AutoReshard(self.model, self.device, cfg.parallel.fsdp_auto_memory_fraction,
                        self.compute_dtype)
            if cfg.parallel.fsdp_reshard_after_forward == "auto" and units_on_gpu else None,
        ])

    def whole_weights_on_gpu(self) -> bool:
        """One GPU holding a model's whole weights (no FSDP, TP, EP nor pipeline): where the
        overlapped step runs block by block, its hooks' weight casts each block's in turn (the
        linears', and an MoE block's experts'). Not with Transformer Engine's linears (not
        measured with them)."""
        dims, fp8 = self.dims, self.config.fp8
        return (self.device.type == "cuda" and not dims.fsdp_enabled and dims.tp == 1
                and dims.ep == 1 and dims.pp == 1
                and not (fp8.enabled and fp8.backend == "te"))

    def _step_plan(self) -> StepPlan:
        """What decides which weights ``dtrain.step_weights`` casts once per step."""
        cfg, dims = self.config, self.dims
        return StepPlan(
            compute_dtype=self.compute_dtype, micro_batches=self.grad_accum,
            autocast=self.autocast, pipeline=self.pipeline is not None,
            whole_weights=not dims.fsdp_enabled and dims.tp == 1 and dims.ep == 1,
            # the overlapped step without FSDP: each unit's casts wait for its update
            units=self.overlapped_step.modules if self.overlapped_step is not None else (),
            linears=cfg.model.cast_weights_once_per_step,
            experts=cfg.model.moe_cast_weights_once_per_step,
            fp8=cfg.fp8.enabled and cfg.fp8.backend != "te" and cfg.fp8.cast_weights_once_per_step,
            tune=cfg.compile.tune_gemms and not cfg.training.deterministic)

    def _build_reporting(self) -> None:
        cfg, tcfg = self.config, self.config.training
        self.metrics_logger = MetricsLogger(cfg.metrics, self.run_dir, enabled=self.rank == 0,
                                            resume_step=self.step, config_toml=cfg.to_toml())
        self.metrics = StepMetrics(cfg.metrics, self.metrics_logger, self.device,
                                   self.tokens_per_step, self.world_size, self.flops_per_token,
                                   tcfg.steps, self.mean_loss)
        self.peak_tflops = self.metrics.peak_tflops
        val_batches = DeviceBatches(self.val_loader, self.device, self.model.positions) \
            if self.val_loader is not None else None
        val_tokens = cfg.validation.steps * tcfg.micro_batch_size * self.dims.dp * tcfg.seq_len
        self.validator = Validator(cfg.validation, val_batches, self.model, self.loss_fn,
                                   self.context, self.reduce_sum, val_tokens, tcfg.steps,
                                   self.metrics_logger)
        self.history: list[dict[str, float]] = []
        self.val_history = self.validator.history

    @property
    def overlapped_step(self) -> OverlappedStep | None:
        """The overlapped optimizer step, when the run has one."""
        return self.update if isinstance(self.update, OverlappedStep) else None

    def reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks that hold different data (in place)."""
        if (mesh := self.dims.mesh("dp_cp")) is not None and mesh.size() > 1:
            dist.all_reduce(value, group=mesh.get_group())
        return value

    def mean_loss(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """Mean token loss over the global batch from each rank's summed step loss."""
        return self.reduce_sum(loss_sum.clone()) / self.tokens_per_step

    def write_config(self) -> None:
        """The run folder's config.toml: the whole resolved config (rank 0 writes it)."""
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.toml").write_text(self.config.to_toml())

    def _announce(self) -> None:
        """The run folder's config.toml (the whole resolved config), and on the console a short
        summary: the model, the mesh, the batch arithmetic, the run folder, a line per feature."""
        cfg, tcfg = self.config, self.config.training
        self.write_config()
        dims = self.dims
        mesh = " x ".join(f"{n} {getattr(dims, n)}" for n in
                          ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
                          if getattr(dims, n) > 1) or "one rank"
        name = "model.hf_config's shape" if cfg.model.hf_config else cfg.model.name
        logger.info(f"{cfg.job.name}: {name}, {self.num_params / 1e6:,.1f}M parameters"
                    f" | world {self.world_size} ({self.device.type}): {mesh} | "
                    f"{str(self.compute_dtype).removeprefix('torch.')} compute")
        logger.info(f"batch: {self.global_batch} sequences x {tcfg.seq_len} tokens = micro "
                    f"{tcfg.micro_batch_size} x dp {dims.dp} x accum {self.grad_accum} | "
                    f"{tcfg.steps} steps | "
                    + self.scheduler.describe())
        logger.info(f"run folder: {self.run_dir} (config.toml: the resolved config)")
        for line in feature_lines(self):
            logger.info(f"  {line}")
        if warning := eager_fp8_warning(cfg.fp8, cfg.compile.enabled):
            logger.warning(warning)

    def close(self) -> None:
        """Stops the background work and leaves the process group (for notebooks that build
        several trainers)."""
        if self.checkpointer:
            self.checkpointer.close()
        self.loader.close()
        self.metrics_logger.close()
        self.watchdog.stop()
        self.folder.release()
        if dist.is_initialized():
            dist.destroy_process_group()


def feature_lines(run: Run) -> list[str]:
    """One line per feature of ``run``, each from its component's ``describe()``, for the
    start-up summary."""
    cfg = run.config
    if run.step:
        lines = [f"resumed from step {run.step} ({run.checkpointer.folder})"]
    elif cfg.checkpoint.initial_weights:
        lines = [f"weights: from {cfg.checkpoint.initial_weights} (checkpoint.initial_weights)"]
    else:
        lines = [f"weights: initialised from seed {cfg.training.seed}"]
    if run.pipeline is not None:
        lines.append(run.pipeline.describe())
    lines += run.model_features  # what parallelize applied
    lines += run.hooks.describe_each()  # checkpoints, the step's weight casts, ...
    for component in (run.update, run.validator, run.metrics_logger):
        if line := component.describe():
            lines.append(line)
    return lines
