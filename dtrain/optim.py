"""AdamW and gradient clipping over (possibly sharded) parameters."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from dtrain.config import ConfigError, OptimizerConfig


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
        impl = "foreach" if device_type != "cuda" else \
            "triton" if triton_takes(params) else "fused"
    if impl == "triton":
        check_optimizer(cfg, torch.device(device_type), offload=False)
        from dtrain.kernels import adamw

        return adamw.TritonAdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    kwargs = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **kwargs)


def triton_takes(params: list[torch.Tensor]) -> bool:
    """Whether ``implementation = "auto"`` on CUDA takes dtrain's Triton AdamW (a faster step
    than torch's fused one, docs/benchmarks.md): where Triton is installed and every parameter is
    a contiguous tensor on the GPU (not offloaded to the CPU); else torch's fused AdamW."""
    try:
        from dtrain.kernels import adamw
    except ImportError:
        return False
    return all(t.device.type == "cuda" and t.is_contiguous() for t in map(adamw._local, params))


def check_optimizer(cfg: OptimizerConfig, device: torch.device | None, offload: bool) -> None:
    """``implementation = "triton"`` needs Triton and the parameters on a CUDA device (or
    Triton's interpreter, for the CPU tests); raises ConfigError naming the fix."""
    if cfg.implementation != "triton" or device is None:
        return
    fix = "set optimizer.implementation = 'auto'"
    try:
        from dtrain.kernels import adamw
    except ImportError as e:
        raise ConfigError(f"optimizer.implementation = 'triton' needs Triton ({e}): {fix}"
                          ) from None
    if offload:
        raise ConfigError("optimizer.implementation = 'triton' updates the parameters on the "
                          f"GPU; parallel.fsdp_cpu_offload keeps them on the CPU: {fix}")
    if not adamw.runs_on(device):
        raise ConfigError(f"optimizer.implementation = 'triton' runs on CUDA; this run is on "
                          f"{device.type}: {fix}")


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

    def describe(self) -> None:
        return None
