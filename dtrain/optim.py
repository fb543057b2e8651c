"""AdamW, learning-rate schedules and gradient clipping over (possibly sharded) parameters."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from dtrain.config import ConfigError, LRScheduleConfig, OptimizerConfig


def build_optimizer(model: nn.Module | list[nn.Module], cfg: OptimizerConfig, device_type: str
                    ) -> torch.optim.Optimizer:
    """AdamW over the module's (or the pipeline stages') parameters, with weight decay on
    matrices only (norm weights are not decayed)."""
    modules = model if isinstance(model, list) else [model]
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    impl = cfg.implementation
    if impl == "auto":
        impl = "fused" if device_type == "cuda" else "foreach"
    kwargs = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **kwargs)


def lr_factor(step: int, cfg: LRScheduleConfig, total_steps: int, peak_lr: float) -> float:
    """Multiplier of the peak learning rate for 1-based optimizer step ``step``.

    Warmup: step / warmup_steps. Then, over the steps after warmup, cosine or linear decay to
    min_lr at ``total_steps``, constant, or wsd (warmup-stable-decay: constant, then decay over the
    last ``wsd_decay_fraction`` of all steps)."""
    if step <= cfg.warmup_steps:
        return step / cfg.warmup_steps
    floor = cfg.min_lr / peak_lr
    if cfg.decay == "constant":
        return 1.0
    if cfg.decay == "wsd":
        decay_steps = round(cfg.wsd_decay_fraction * total_steps)
        decay_start = max(total_steps - decay_steps, cfg.warmup_steps)
        if step <= decay_start or total_steps == decay_start:
            return 1.0
        progress = (step - decay_start) / (total_steps - decay_start)
        shape = {"linear": 1 - progress,
                 "cosine": 0.5 * (1 + math.cos(math.pi * progress)),
                 "sqrt": 1 - math.sqrt(progress)}[cfg.wsd_decay_shape]
        return floor + (1 - floor) * shape
    span = total_steps - cfg.warmup_steps
    progress = min((step - cfg.warmup_steps) / span, 1.0) if span > 0 else 1.0
    if cfg.decay == "linear":
        return floor + (1 - floor) * (1 - progress)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def check_lr_schedule(cfg: LRScheduleConfig, peak_lr: float) -> None:
    """Refuses a floor above the peak (the "decay" would climb to it): ``min_lr`` is absolute,
    as Megatron-LM's ``--min-lr``, so a lower ``optimizer.lr`` needs a lower ``min_lr`` too."""
    if cfg.decay != "constant" and cfg.min_lr > peak_lr:
        raise ConfigError(
            f"lr_schedule.min_lr = {cfg.min_lr:g} is above optimizer.lr = {peak_lr:g}: the "
            f"{cfg.decay} decay would climb from the peak to it; set lr_schedule.min_lr at or "
            f"below optimizer.lr (e.g. --lr_schedule.min_lr {peak_lr / 10:g}, a tenth of it)")


def describe_lr_schedule(cfg: LRScheduleConfig, peak_lr: float, total_steps: int) -> str:
    """The schedule in words for the start-up line: peak, floor, warm-up, shape; and a warning
    when the warm-up covers the whole run (the peak is never reached)."""
    floor = "" if cfg.decay == "constant" else f" to {cfg.min_lr:g}"
    text = (f"lr {peak_lr:g}{floor} ({cfg.decay}), {cfg.warmup_steps} warm-up step"
            f"{'s' * (cfg.warmup_steps != 1)}")
    if cfg.warmup_steps >= total_steps:
        text += (f" (the warm-up covers all {total_steps} steps: the learning rate never reaches "
                 "its peak; lower lr_schedule.warmup_steps)")
    return text


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRScheduleConfig,
                       total_steps: int, peak_lr: float) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR whose ``last_epoch`` counts optimizer steps; the lr in use at step s (1-based)
    is ``peak_lr * lr_factor(s)``."""
    # LambdaLR evaluates the factor at 0 on construction and at n after the n-th step, so
    # shift by one: the n-th optimizer step runs with factor(n).
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda n: lr_factor(n + 1, cfg, total_steps, peak_lr))


def grad_norm(grads: list[torch.Tensor], pp_group=None) -> torch.Tensor:
    """L2 norm of the full, unsharded gradients: local sums of squares, summed over the mesh
    dimensions each DTensor is sharded on (replicated dimensions hold copies and are not), and
    over ``pp_group`` (pipeline stages hold different parameters)."""
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        if isinstance(g, DTensor) and any(p.is_partial() for p in g.placements):
            # Partial values are summands: squares of summands do not add up; reduce first.
            g = g.redistribute(placements=[Replicate() if p.is_partial() else p
                                           for p in g.placements])
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups[key].append(g.to_local() if isinstance(g, DTensor) else g)
    total = None
    for key, tensors in groups.items():
        if tensors[0].is_cuda:
            squares = torch.stack(torch._foreach_norm(tensors, 2.0)).float().pow(2).sum()
        else:  # the CPU norm kernel sums sequentially in fp32; pairwise sum() is exact enough
            squares = torch.stack([t.float().pow(2).sum() for t in tensors]).sum()
        if key is not None:
            mesh, placements = key
            for dim, placement in enumerate(placements):
                if not placement.is_replicate():  # Shard or _StridedShard (FSDP over TP)
                    dist.all_reduce(squares, group=mesh.get_group(dim))
        total = squares if total is None else total + squares
    if total is None:  # a stage without gradients contributes nothing
        total = torch.zeros(())
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


def clip_grad_norm_(parameters: list[nn.Parameter], max_norm: float, pp_group=None,
                    optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
    """Global L2 norm of all gradients (see ``grad_norm``) and, if ``max_norm > 0``, scales
    them so the norm is at most ``max_norm``.

    Given a fused AdamW ``optimizer``, the gradients are not rewritten: the optimizer's next
    step divides each gradient by ``optimizer.grad_scale`` as it reads it (the hook torch's
    fused kernels keep for loss scaling), which saves one pass over all gradients. The clipped
    update is the same to rounding."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = grad_norm(grads, pp_group)
    if optimizer is not None and folds_clipping(optimizer):
        # torch's clip: coefficient max_norm / (norm + 1e-6), at most 1; divide by its inverse.
        optimizer.grad_scale = ((norm + 1e-6) / max_norm).clamp(min=1.0) if max_norm > 0 \
            else None
    elif max_norm > 0:  # per mesh: foreach kernels take DTensors of one mesh (MoE experts differ)
        by_mesh: dict[object, list[nn.Parameter]] = defaultdict(list)
        for p in parameters:
            if p.grad is not None:
                by_mesh[getattr(p.grad, "device_mesh", None)].append(p)
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm


def folds_clipping(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` applies a gradient scale inside its step (torch's fused Adam and
    AdamW read ``optimizer.grad_scale``; the other implementations refuse it)."""
    return isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and \
        all(group.get("fused") for group in optimizer.param_groups)


def skip_update_if(optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> bool:
    """Arranges for the optimizer's next step to leave the weights and its state untouched
    where ``flag`` (a one-element tensor) is nonzero; returns whether the step is to be taken.
    Torch's fused Adam and AdamW read the flag inside their kernels (``found_inf``, as for loss
    scaling): the step is always taken and the host does not wait for the device. The other
    implementations cannot: the host reads the flag (a synchronisation) and skips the step."""
    if folds_clipping(optimizer):
        optimizer.found_inf = flag
        return True
    return not flag.item()


class WholeStep:
    """The weight update as one ``optimizer.step()``; ``wait()`` has nothing to wait for (the
    interface of ``dtrain.parallel.overlap.OverlappedStep``)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def step(self) -> None:
        self.optimizer.step()

    def wait(self) -> None:
        pass
