"""Parallelism applied from outside to a plain model: ``parallelize(model, dims, mesh, ...)``."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from dtrain.config import ActivationCheckpointConfig, CompileConfig, ParallelConfig
from dtrain.models.llama import Transformer
from dtrain.parallel.activation_checkpoint import apply_activation_checkpointing
from dtrain.parallel.compile import apply_compile
from dtrain.parallel.dims import ParallelDims
from dtrain.parallel.fsdp import apply_fsdp
from dtrain.parallel.tensor import apply_tp, enable_async_tp

__all__ = ["ParallelDims", "parallelize"]


def parallelize(model: Transformer, dims: ParallelDims, mesh: DeviceMesh | None,
                parallel: ParallelConfig, ac: ActivationCheckpointConfig,
                compile: CompileConfig, param_dtype: torch.dtype) -> Transformer:
    """Applies, in order: tensor/sequence parallel -> activation checkpointing -> torch.compile
    per block -> FSDP2/HSDP. ``mesh`` is None for a single process. ``param_dtype`` is the
    compute dtype FSDP casts to (without FSDP the trainer uses autocast). Returns the same
    module, modified in place."""
    if dims.tp > 1:
        apply_tp(model, dims.mesh("tp"), parallel.loss_parallel)
        if parallel.async_tp:
            enable_async_tp(dims.mesh("tp"))
    apply_activation_checkpointing(model, ac)
    if compile.enabled:
        apply_compile(model)
    if mesh is not None and dims.fsdp_enabled:
        reduce_dtype = torch.float32 if parallel.fsdp_reduce_dtype == "fp32" else torch.bfloat16
        apply_fsdp(model, dims.fsdp_mesh(), param_dtype, reduce_dtype,
                   parallel.fsdp_reshard_after_forward, parallel.fsdp_cpu_offload)
    return model
