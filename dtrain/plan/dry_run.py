"""Dry run: one rank of a recipe at its full world size, on a fake process group, on ``meta``.

The mesh is built at the real world size over torch's fake backend (collectives are no-ops),
the model is built and parallelized by the trainer's own ``dtrain.build.build_model`` as rank
``rank`` would, and the bytes of its local shards are counted: parameters, gradients (same dtype
and sharding) and AdamW's two moments. Activations and communication buffers come from the memory
model (``dtrain.plan.memory``). No weight is materialised and no GPU is needed.

Before building, it opens what a launch opens, as the launch opens it (``check_inputs``): the
tokenizer, the data's files and indexes (not the data), and the initial weights' metadata. After
counting, the report holds the predicted peak against a memory budget (``Budget``, the
planner's usable share of one GPU); ``dtrain.plan.over_budget`` turns a peak over it into one
error naming the layout the planner would choose instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from dtrain.config import Config, ConfigError
from dtrain.dtensor import local
from dtrain.plan.constants import H200, Constants
from dtrain.plan.memory import GIB, Layout, MemoryEstimate, Workload, rank_memory, rank_stages


@dataclass(frozen=True)
class Budget:
    """The memory of one GPU the dry run plans for, and where the figure comes from (or why
    there is none)."""
    gpu_memory_gb: float | None = None
    source: str = "none given"

    @classmethod
    def of(cls, given_gb: float | None) -> Budget:
        """``--gpu-memory-gb`` when given, else this machine's GPU's total memory, else none."""
        if given_gb is not None:
            if not given_gb > 0:
                raise ConfigError(f"--gpu-memory-gb {given_gb:g} must be a number > 0: the "
                                  "memory of one GPU in GB, e.g. 80")
            return cls(given_gb, "--gpu-memory-gb")
        if torch.cuda.is_available():
            device = torch.cuda.get_device_properties(0)
            return cls(device.total_memory / 1e9, f"this machine's {device.name}")
        return cls(None, "no GPU here: give --gpu-memory-gb")

    def usable_bytes(self, constants: Constants) -> float | None:
        """What the allocated peak may reach: the planner's ``usable_memory`` share of the
        GPU (``planner.evaluate`` excludes a layout past it)."""
        if self.gpu_memory_gb is None:
            return None
        return self.gpu_memory_gb * 1e9 * constants.usable_memory


@dataclass
class DryRunReport:
    world_size: int
    rank: int
    mesh: str
    stages: list[int]
    num_stages: int
    local_params: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    estimate: MemoryEstimate
    grads_live: bool
    """Gradients live through the step (several micro-batches, or a pipeline)."""
    inputs: list[str] = field(default_factory=list)
    """One line per input the launch opens (``check_inputs``)."""
    budget: Budget = Budget()
    usable_bytes: float | None = None
    work: Workload | None = None
    layout: Layout | None = None
    """What was dry-run, as the planner sees it (``over_budget`` plans from it)."""

    @property
    def over_budget(self) -> bool:
        """The predicted peak is over the budget's usable memory."""
        return self.usable_bytes is not None and self.peak_bytes > self.usable_bytes

    @property
    def peak_bytes(self) -> float:
        """Counted parameter, gradient and optimizer bytes plus the modelled activations and
        buffers, combined as the memory model combines them (``memory.rank_memory``)."""
        e = self.estimate
        live = self.grad_bytes + e.activations if self.grads_live \
            else max(self.grad_bytes, e.activations)
        return self.param_bytes + self.optimizer_bytes + e.buffers + live

    def format(self) -> str:
        e = self.estimate
        stages = (f" | pipeline stages {self.stages} of {self.num_stages}"
                  if self.num_stages > 1 else "")
        return "\n".join([
            f"dry run: rank {self.rank} of {self.world_size} | mesh {self.mesh}{stages}",
            f"  local parameters   {self.local_params / 1e9:10.3f} B "
            f"(memory model: {e.local_params / 1e9:.3f} B)",
            f"  parameters (fp32)  {self.param_bytes / GIB:10.2f} GiB",
            f"  gradients          {self.grad_bytes / GIB:10.2f} GiB",
            f"  optimizer (AdamW)  {self.optimizer_bytes / GIB:10.2f} GiB",
            f"  activations (est.) {e.activations / GIB:10.2f} GiB",
            f"  buffers (est.)     {e.buffers / GIB:10.2f} GiB",
            f"  peak (est.)        {self.peak_bytes / GIB:10.2f} GiB allocated",
            self._budget_line(),
            *(f"  {'inputs (found)' if i == 0 else '':<18} {line}"
              for i, line in enumerate(self.inputs)),
        ])

    def _budget_line(self) -> str:
        b = self.budget
        if self.usable_bytes is None:
            return f"  memory budget: none ({b.source})"
        share = self.usable_bytes / (b.gpu_memory_gb * 1e9)
        return (f"  usable memory      {self.usable_bytes / GIB:10.2f} GiB ({share:.0%} of the "
                f"{b.gpu_memory_gb:.4g} GB GPU, {b.source})\n"
                f"  headroom           {(self.usable_bytes - self.peak_bytes) / GIB:10.2f} GiB")


def layout_of(cfg: Config, dims) -> Layout:
    """The memory model's ``Layout`` of a config and its resolved degrees."""
    ac = cfg.activation_checkpoint.mode
    return Layout(tp=dims.tp, pp=dims.pp, cp=dims.cp, ep=dims.ep, dp_shard=dims.dp_shard,
                  dp_replicate=dims.dp_replicate,
                  pp_virtual_stages=cfg.parallel.pp_virtual_stages,
                  pp_schedule=cfg.parallel.pp_schedule, micro_batch=cfg.training.micro_batch_size,
                  ac="full" if ac == "layer" else ac, compiled=cfg.compile.enabled,
                  fp8=cfg.fp8.enabled, cp_comm_type=cfg.parallel.cp_comm_type,
                  pp_layout=cfg.parallel.pp_layout if dims.pp > 1 else "")


def default_world_size(cfg: Config) -> int:
    """The world size a recipe describes: the product of its degrees (dp_shard must be set)."""
    p = cfg.parallel
    if p.dp_shard == -1:
        raise ConfigError("the dry run needs a world size: the recipe has parallel.dp_shard = -1, "
                          "so give --dry-run-world-size N (or set parallel.dp_shard)")
    return p.dp_replicate * p.dp_shard * p.cp * p.tp * p.pp


def dry_run(cfg: Config, world_size: int | None = None, rank: int = 0,
            constants: Constants = H200, budget: Budget = Budget()) -> DryRunReport:
    """Builds rank ``rank`` of ``cfg`` at ``world_size`` (default: ``default_world_size``) on a
    fake process group and reports its bytes against ``budget``. The config is checked first, as
    the trainer checks it (``dtrain.checks``), then the inputs a launch opens
    (``check_inputs``); the model is built by the trainer's own builders (``dtrain.build``).
    Raises ConfigError for a layout the trainer refuses or a missing input. The process group is
    destroyed before returning."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dtrain.build import batch_arithmetic, build_model
    from dtrain.checks import validate

    world_size = world_size or default_world_size(cfg)
    if not 0 <= rank < world_size:
        raise ConfigError(f"--dry-run-rank {rank} is outside the world size {world_size}")
    dims = validate(cfg, world_size, device=None)
    global_batch, accum = batch_arithmetic(cfg.training, dims.dp)
    vocab, inputs = check_inputs(cfg)
    if dist.is_initialized():
        raise RuntimeError("the dry run needs a process without a process group")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        mesh = dims.build_mesh("cpu")
        built = build_model(cfg, dims, mesh, "cuda", vocab, accum)
        numel = param_bytes = 0
        for part in built.parts:
            for p in part.parameters():
                shard = local(p)
                numel += shard.numel()
                param_bytes += shard.numel() * shard.element_size()
        args = built.parts[0].args
        work = Workload(args, cfg.training.seq_len, global_batch)
        layout = layout_of(cfg, dims)
        # This rank's pipeline stages: stage_indices[0] is its pipeline rank (looped or V).
        est = rank_memory(work, layout, constants,
                          rank_stages(args, layout, built.stage_indices[0]))
        shape = ", ".join(f"{name} {size}" for name, size in
                          zip(mesh.mesh_dim_names, mesh.mesh.shape, strict=True))
        report = DryRunReport(world_size, rank, shape, built.stage_indices, built.num_stages,
                              numel, param_bytes, param_bytes, 2 * 4 * numel, est,
                              accum > 1 or dims.pp > 1, inputs, budget,
                              budget.usable_bytes(constants), work, layout)
    finally:
        dist.destroy_process_group()
    return report


def check_inputs(cfg: Config) -> tuple[int, list[str]]:
    """Opens what a launch opens before it trains, through the launch's own functions and
    without reading the data: the tokenizer (``build.build_tokenizer``), the training and
    held-out data (``data.loader.check_data_path``: files, indexed headers and indexes) and, for
    a run that starts afresh, the initial weights' metadata
    (``checkpoint.check_initial_weights``). Returns the tokenizer's vocabulary and one line per
    input; the first missing one raises the launch's error (ConfigError, or FileNotFoundError
    for the tokenizer), naming the key and the fix."""
    from dtrain.build import build_tokenizer, validation_data
    from dtrain.checkpoint import check_initial_weights, resumable
    from dtrain.data.loader import check_data_path

    tokenizer = build_tokenizer(cfg.data)
    lines = [f"data.tokenizer = {cfg.data.tokenizer!r} (vocabulary {tokenizer.vocab_size:,})"]
    sources = [(cfg.data, "data.path")]
    if cfg.validation.enabled and cfg.validation.path:
        held_out, _, key = validation_data(cfg.data, cfg.validation)
        sources.append((held_out, key))
    for data, key in sources:
        note = check_data_path(data, key)
        lines.append(note or f"{key} = {data.path!r} ({data.source})")
    if weights := cfg.checkpoint.initial_weights:
        run_dir = Path(cfg.job.output_dir) / cfg.job.name
        if resumable(cfg.checkpoint, run_dir):
            lines.append(f"checkpoint.initial_weights not read: the run resumes from its "
                         f"checkpoint in {run_dir}")
        else:
            check_initial_weights(weights)
            lines.append(f"checkpoint.initial_weights = {weights!r}")
    return tokenizer.vocab_size, lines
