"""Parallelism applied from outside to a plain model: ``parallelize(model, dims, mesh, ...)``."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from dtrain.config import ActivationCheckpointConfig, CompileConfig, FP8Config, ParallelConfig
from dtrain.models.llama import Transformer
from dtrain.parallel.activation_checkpoint import apply_activation_checkpointing
from dtrain.parallel.compile import apply_compile, inductor_options
from dtrain.parallel.context import apply_cp
from dtrain.parallel.dims import ParallelDims
from dtrain.parallel.expert import MoEStats, apply_ep, moe_layers, split_moe_losses
from dtrain.parallel.fp8 import (
    UnitScales,
    describe_fp8,
    eager_fp8_warning,
    float8_tensor_parallel,
    fp8_step_hooks,
)
from dtrain.parallel.fsdp import AutoReshard, apply_fsdp, fsdp_units_on_gpu
from dtrain.parallel.overlap import OverlappedStep, build_update
from dtrain.parallel.pipeline import Pipeline
from dtrain.parallel.tensor import apply_tp, enable_async_tp

# What a run takes from parallelism beyond parallelize: the pipeline's schedule, the overlapped
# update, and the step hooks of FSDP, FP8 and MoE.
__all__ = ["AutoReshard", "MoEStats", "OverlappedStep", "ParallelDims", "Pipeline", "UnitScales",
           "build_update", "describe_parallelize", "eager_fp8_warning", "fp8_step_hooks",
           "fsdp_units_on_gpu", "inductor_options", "moe_layers", "parallelize"]


def parallelize(model: Transformer, dims: ParallelDims, mesh: DeviceMesh | None,
                parallel: ParallelConfig, ac: ActivationCheckpointConfig,
                compile: CompileConfig, param_dtype: torch.dtype,
                fp8: FP8Config | None = None, seq_len: int = 0) -> Transformer:
    """Applies, in order: tensor/sequence parallel -> expert parallel -> context parallel
    attention -> activation checkpointing -> torch.compile per block -> FSDP2/HSDP (over
    dp_shard x cp; MoE experts over the data ranks outside ep). ``mesh`` is
    None for a single process. ``param_dtype`` is the compute dtype FSDP casts to (without
    FSDP the trainer uses autocast). ``fp8``: the model's linears were converted
    (``fp8.convert_to_fp8``), so TP takes the float8 styles where they apply. ``seq_len``: the
    training sequence, which context parallel splits. Returns the same module, modified in
    place."""
    if dims.tp > 1:
        apply_tp(model, dims.mesh("tp"), parallel.loss_parallel, float8_tensor_parallel(fp8))
        if parallel.async_tp:
            enable_async_tp(dims.mesh("tp"))
    if dims.ep > 1:
        apply_ep(model, dims.mesh("ep"))
    if dims.cp > 1:
        apply_cp(model, dims.mesh("cp"), parallel.cp_comm_type, seq_len)
    if dims.cp * dims.tp > 1:  # a micro-batch's tokens are split over the cp x tp ranks
        split_moe_losses(model, dims.mesh("cp_tp").get_group(), dims.cp)
    apply_activation_checkpointing(model, ac)
    if compile.enabled:
        # MoE layers read their expert counts on the host (loop or all-to-all splits); TE's
        # linears run outside the graphs (dtrain.parallel.fp8), each a break in its block.
        te = fp8 is not None and fp8.enabled and fp8.backend == "te"
        apply_compile(model, fullgraph=not (model.args.n_experts or te),
                      options=inductor_options(fp8 is not None and fp8.enabled,
                                               compile.tune_kernels))
    if mesh is not None and dims.fsdp_enabled:
        reduce_dtype = torch.float32 if parallel.fsdp_reduce_dtype == "fp32" else torch.bfloat16
        apply_fsdp(model, dims.fsdp_mesh(), param_dtype, reduce_dtype,
                   parallel.fsdp_reshard_after_forward, parallel.fsdp_cpu_offload,
                   dims.mesh("ep_fsdp"), dims.mesh("moe_fsdp"))
    return model


def describe_parallelize(dims: ParallelDims, parallel: ParallelConfig,
                         ac: ActivationCheckpointConfig, compile: CompileConfig,
                         fp8: FP8Config, fp8_layers, fp8_all_gather: bool) -> list[str]:
    """The start-up summary's lines of what ``parallelize`` (and the FP8 conversion before it,
    ``fp8_layers``) applied beyond the mesh: context parallel, FP8, compile, activation
    checkpointing."""
    lines = []
    if dims.cp > 1:
        lines.append(f"context parallel: cp {dims.cp}, {parallel.cp_comm_type}")
    if fp8_layers is not None:
        lines.append(describe_fp8(fp8, fp8_layers, fp8_all_gather))
    if compile.enabled:
        lines.append("torch.compile: each block and the loss")
    if ac.mode != "none":
        lines.append(f"activation checkpointing: {ac.mode}")
    return lines
