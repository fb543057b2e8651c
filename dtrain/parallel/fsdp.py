"""FSDP2 (``fully_shard``) over the data-parallel mesh: ZeRO-3 sharding, HSDP on a 2-D mesh."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from dtrain.models.llama import Transformer


def apply_fsdp(model: Transformer, mesh: DeviceMesh, param_dtype: torch.dtype,
               reduce_dtype: torch.dtype, reshard_after_forward: str = "default",
               cpu_offload: bool = False) -> None:
    """Shards each transformer block, the embeddings and the final norm + output layer as their
    own FSDP units, then the root. ``mesh`` is 1-D (FSDP) or 2-D ``(replicate, shard)`` (HSDP).
    Parameters become DTensors sharded on dim 0; compute uses ``param_dtype`` and gradients are
    reduced in ``reduce_dtype``."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    common = {"mesh": mesh, "mp_policy": mp}
    if cpu_offload:
        common["offload_policy"] = CPUOffloadPolicy()
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1
        reshard = {"always": True, "never": False, "default": not last}[reshard_after_forward]
        fully_shard(block, reshard_after_forward=reshard, **common)
    if not model.args.tie_embeddings:  # a tied table must live in one unit: leave it to the root
        if model.tok_embeddings is not None:
            fully_shard(model.tok_embeddings,
                        reshard_after_forward=reshard_after_forward != "never", **common)
        tail = [m for m in (model.norm, model.output) if m is not None]
        if tail:
            fully_shard(tail, reshard_after_forward=reshard_after_forward == "always", **common)
    fully_shard(model, reshard_after_forward=reshard_after_forward == "always", **common)
