"""A dry run's predicted peak over its memory budget, answered with the planner's choice.

``check_budget`` turns a ``DryRunReport`` whose peak is over the budget's usable memory into one
ConfigError that names the layout the planner (``planner.plan_like``) finds
fastest among those that fit the same GPUs, with the command-line overrides that select it.
(Apart from ``dry_run``, which the planner's own modules import: no import cycle.)
"""

from __future__ import annotations

from dtrain.config import Config, ConfigError
from dtrain.plan.constants import H200, Constants
from dtrain.plan.dry_run import DryRunReport
from dtrain.plan.memory import GIB, Layout, Workload
from dtrain.plan.planner import Candidate, Cluster, plan_like


def check_budget(report: DryRunReport, cfg: Config, gpus_per_node: int = 8,
                 constants: Constants = H200) -> None:
    """Raises one ConfigError when ``report``'s predicted peak is over its budget: the peak, the
    usable memory, and the layout the planner finds fastest among those that fit the dry run's
    GPUs (``gpus_per_node`` to a node; with the recipe's compile and FP8 settings), as
    --flags; or, when none fits, that more GPUs are needed."""
    if gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node {gpus_per_node} must be an integer >= 1")
    if not report.over_budget:
        return
    b, work, layout = report.budget, report.work, report.layout
    cluster = Cluster(report.world_size, gpus_per_node, b.gpu_memory_gb)
    head = (f"rank {report.rank}'s predicted peak {report.peak_bytes / GIB:.1f} GiB is over the "
            f"{b.gpu_memory_gb:.4g} GB GPU's usable {report.usable_bytes / GIB:.1f} GiB "
            f"({constants.usable_memory:.0%}; {b.source})")
    where = f"{cluster.gpus} GPUs ({cluster.gpus_per_node} per node)"
    choice = planner_choice(work, layout, cluster, constants)
    if choice is None:
        raise ConfigError(
            f"{head}: no layout the planner knows fits {where}: use more GPUs "
            "(--dry-run-world-size), a shorter training.seq_len or a smaller "
            f"training.global_batch_size{_plan_command(cfg, work, cluster, '; compare with ')}")
    flags = layout_flags(choice.layout, layout, cfg, work.global_batch)
    raise ConfigError(
        f"{head}: the planner's fastest fitting layout for {where} is "
        f"{choice.layout.describe()} ({flags}), predicted peak "
        f"{choice.memory.peak / GIB:.1f} GiB; or use more GPUs (--dry-run-world-size)"
        f"{_plan_command(cfg, work, cluster, ', or compare layouts with ')}")


def planner_choice(work: Workload, current: Layout, cluster: Cluster,
                   constants: Constants) -> Candidate | None:
    """The fastest layout other than ``current`` that fits ``cluster``, among the planner's
    layouts with ``current``'s compile, FP8 and CP exchange (``planner.plan_like``); None if
    none fits."""
    return next((x for x in plan_like(work, cluster, current, constants)
                 if not x.excluded and x.layout != current), None)


_FLAGS = {"tp": "parallel.tp", "pp": "parallel.pp", "pp_schedule": "parallel.pp_schedule",
          "pp_virtual_stages": "parallel.pp_virtual_stages", "cp": "parallel.cp",
          "cp_comm_type": "parallel.cp_comm_type", "ep": "parallel.ep",
          "dp_shard": "parallel.dp_shard", "dp_replicate": "parallel.dp_replicate",
          "micro_batch": "training.micro_batch_size", "ac": "activation_checkpoint.mode"}
"""``Layout`` field -> the config key that sets it."""


def layout_flags(new: Layout, current: Layout, cfg: Config, global_batch: int) -> str:
    """The command-line overrides that turn ``cfg`` (laid out as ``current``) into ``new`` with
    the same global batch."""
    was = {**vars(current), "ac": cfg.activation_checkpoint.mode}
    flags = [f"--{key} {getattr(new, name)}" for name, key in _FLAGS.items()
             if getattr(new, name) != was[name]]
    t = cfg.training
    if (new.micro_batch, new.dp) != (current.micro_batch, current.dp):
        if t.global_batch_size == 0:
            flags.append(f"--training.global_batch_size {global_batch}")
        if t.grad_accum_steps:
            flags.append("--training.grad_accum_steps 0")
    if cfg.parallel.pp_layout and (new.pp, new.pp_virtual_stages) != (current.pp,
                                                                       current.pp_virtual_stages):
        flags.append("--parallel.pp_layout ''")
    return " ".join(flags)


def _plan_command(cfg: Config, work: Workload, cluster: Cluster, lead: str) -> str:
    """``lead`` and the planner's command for this model and cluster; "" when the model's
    shape is overridden (the planner takes presets only)."""
    if cfg.model.n_layers or cfg.model.vocab_size:
        return ""
    return (f"{lead}python -m dtrain.plan --model {cfg.model.name} --gpus {cluster.gpus} "
            f"--gpus-per-node {cluster.gpus_per_node} --gpu-memory-gb "
            f"{cluster.gpu_memory_gb:.4g} --seq-len {work.seq_len} --global-batch "
            f"{work.global_batch}")
