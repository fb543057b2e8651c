"""FSDP2 (``fully_shard``) over the data-parallel mesh: ZeRO-3 sharding, HSDP on a 2-D mesh."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from dtrain.dtensor import local
from dtrain.hooks import StepHook
from dtrain.log import logger
from dtrain.models.llama import Transformer
from dtrain.models.moe import MoE


def apply_fsdp(model: Transformer, mesh: DeviceMesh, param_dtype: torch.dtype,
               reduce_dtype: torch.dtype, reshard_after_forward: str = "default",
               cpu_offload: bool = False, expert_mesh: DeviceMesh | None = None,
               router_mesh: DeviceMesh | None = None) -> None:
    """Shards each transformer block, the embeddings and the final norm + output layer as their
    own FSDP units, then the root. ``mesh`` is 1-D (FSDP) or 2-D ``(replicate, shard)`` (HSDP).
    Parameters become DTensors sharded on dim 0; compute uses ``param_dtype`` and gradients are
    reduced in ``reduce_dtype``.

    MoE layers under expert or tensor parallel get units of their own: the experts over
    ``expert_mesh`` (the data ranks outside ep, and tp), the router and shared expert over
    ``router_mesh`` (with tp > 1: tp ranks route different tokens). Their gradients are summed
    over those ranks and divided by the data-parallel degree, as the other weights'."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    common = {"mesh": mesh, "mp_policy": mp}
    if cpu_offload:
        common["offload_policy"] = CPUOffloadPolicy()
    # The blocks, then the multi-token prediction depths (each with its block) last.
    blocks = [*model.layers.values(), *(model.mtp.values() if model.mtp is not None else ())]
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1
        reshard = {"always": True, "never": False, "default": not last,
                   "auto": not last}[reshard_after_forward]
        for moe in [m for m in block.modules() if isinstance(m, MoE)]:
            _shard_moe(moe, expert_mesh, router_mesh, mesh.size(), reshard, common)
        fully_shard(block, reshard_after_forward=reshard, **common)
    if not model.args.tie_embeddings:  # a tied table must live in one unit: leave it to the root
        if model.tok_embeddings is not None:
            fully_shard(model.tok_embeddings,
                        reshard_after_forward=reshard_after_forward != "never", **common)
        tail = [m for m in (model.norm, model.output) if m is not None]
        if tail:
            fully_shard(tail, reshard_after_forward=reshard_after_forward == "always", **common)
    fully_shard(model, reshard_after_forward=reshard_after_forward == "always", **common)


def keep_gathered(model: Transformer, headroom_bytes: int, param_dtype: torch.dtype) -> int:
    """The ``auto`` reshard policy's second half: from the last block back, blocks whose gathered
    weights fit in ``headroom_bytes`` keep them from forward to backward (their backward needs
    no all-gather). Every block's gathered weights are held at the peak, at the end of the
    forward, so the cost is each block's size in ``param_dtype``. The last block keeps them
    already. Returns the number of blocks changed; ranks must pass the same headroom."""
    changed = 0
    for block in list(model.layers.values())[-2::-1]:
        size = sum(p.numel() for p in block.parameters()) * param_dtype.itemsize
        if size > headroom_bytes:
            break
        block.set_reshard_after_forward(False)
        headroom_bytes -= size
        changed += 1
    return changed


def fsdp_units_on_gpu(device: torch.device, world_size: int, fsdp: bool, pp: int,
                     cpu_offload: bool) -> bool:
    """Whether the run has FSDP units on the GPU, without pipeline stages or CPU offload: where
    the overlapped optimizer step and the ``auto`` reshard policy apply."""
    return device.type == "cuda" and world_size > 1 and fsdp and pp == 1 and not cpu_offload


class AutoReshard(StepHook):
    """The ``auto`` reshard policy, once the second step has shown the steady peak (the first
    has no optimizer state yet): the last blocks keep their gathered weights from forward to
    backward while the peak stays within ``fraction`` of the device's memory
    (``keep_gathered``). The ranks take the smallest headroom among them, so that all skip the
    same all-gathers."""

    def __init__(self, model: Transformer, device: torch.device, fraction: float,
                 param_dtype: torch.dtype):
        self.model, self.device, self.fraction = model, device, fraction
        self.param_dtype = param_dtype
        self.steps = 0

    def after_step(self, step: int) -> None:
        self.steps += 1
        if self.steps == 2:
            self.fit()

    def fit(self) -> None:
        total = torch.cuda.get_device_properties(self.device).total_memory
        peak = torch.cuda.max_memory_allocated(self.device)
        budget = self.fraction * total
        headroom = torch.tensor(budget - peak, dtype=torch.float64, device=self.device)
        dist.all_reduce(headroom, op=dist.ReduceOp.MIN)
        kept = keep_gathered(self.model, max(int(headroom.item()), 0), self.param_dtype)
        logger.info(f"fsdp auto: {kept} of {self.model.args.n_layers - 1} blocks keep their "
                    f"gathered weights from forward to backward (peak {peak / 2**30:.1f} GiB, "
                    f"budget {budget / 2**30:.1f} GiB)")


def _shard_moe(moe: MoE, expert_mesh: DeviceMesh | None, router_mesh: DeviceMesh | None,
               dp_degree: int, reshard: bool, common: dict) -> None:
    """FSDP units for one MoE layer's experts and router (see ``apply_fsdp``)."""
    options = {k: v for k, v in common.items() if k != "mesh"}
    if expert_mesh is not None:
        experts = local(moe.experts.w1).shape[0]
        # Fewer local experts than shards: shard each expert's hidden dimension instead.
        placement = Shard(0) if experts % expert_mesh.size() == 0 else Shard(1)
        fully_shard(moe.experts, mesh=expert_mesh, reshard_after_forward=reshard,
                    shard_placement_fn=lambda param: placement, **options)
        _divide_gradients(moe.experts, dp_degree, expert_mesh)
    if router_mesh is not None:
        units = [m for m in (moe.router, moe.shared_expert) if m is not None]
        fully_shard(units, mesh=router_mesh, reshard_after_forward=reshard, **options)
        _divide_gradients(moe.router, dp_degree, router_mesh)


def _divide_gradients(unit, factor: int, mesh: DeviceMesh) -> None:
    """Reduced gradients of ``unit`` are summed and divided by ``factor`` (not the mesh size)."""
    unit.set_gradient_divide_factor(factor)
    # gloo has no pre-multiplied sum: sum, then divide (one rank: FSDP divides without comms)
    if mesh.device_type != "cuda" and mesh.size() > 1:
        unit.set_force_sum_reduction_for_comms(True)
