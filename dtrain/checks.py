"""Every check of a config against the world size it is to run on, before anything is built.

``validate`` runs in ``python -m dtrain.train`` (through the trainer's first line) before the
process group exists, and in the dry run, so a layout that cannot run fails in the same way, at
once, on every rank and without a GPU. Each check lives next to the code it protects
(``check_tp`` with tensor parallel, ``check_pipeline`` with the schedules, ...); this module only
calls them, in order, with what they need: the resolved degrees, the model's shape (from its
preset, without building it), the batch arithmetic.
"""

from __future__ import annotations

import torch

from dtrain.build import batch_arithmetic
from dtrain.config import Config, ConfigError, check_ranges
from dtrain.lr_schedule import check_lr_schedule
from dtrain.model_shape import check_shape, model_args_of
from dtrain.optim import check_optimizer
from dtrain.parallel.context import check_cp
from dtrain.parallel.dims import ParallelDims
from dtrain.parallel.expert import check_ep
from dtrain.parallel.fp8 import check_fp8
from dtrain.parallel.pipeline import check_pipeline, parse_layout
from dtrain.parallel.tensor import check_async_tp, check_tp


def validate(cfg: Config, world_size: int, device: torch.device | None) -> ParallelDims:
    """Checks ``cfg`` for ``world_size`` processes on ``device`` (None: a dry run, which plans
    for GPUs it does not have and skips the device's own checks). Returns the resolved degrees;
    raises ConfigError naming the problem and the fix."""
    check_ranges(cfg)
    dims = ParallelDims.from_config(cfg.parallel, world_size)
    _, microbatches = batch_arithmetic(cfg.training, dims.dp)
    try:
        args = model_args_of(cfg.model)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"model.name: {e}") from None
    check_shape(args)
    tcfg, pcfg = cfg.training, cfg.parallel
    if tcfg.seq_len > args.max_seq_len:
        raise ConfigError(f"training.seq_len = {tcfg.seq_len} exceeds the model's "
                          f"max_seq_len {args.max_seq_len}: use a shorter sequence")
    if dims.tp > 1:
        check_tp(args, dims.tp, tcfg.seq_len)
        if pcfg.async_tp:
            check_async_tp(device.type if device is not None else "cuda", cfg.compile.enabled)
    if dims.ep > 1:
        check_ep(args, dims.ep)
        if cfg.activation_checkpoint.mode == "op":
            raise ConfigError("activation_checkpoint.mode = 'op' is not available with "
                              "parallel.ep > 1 (the all-to-all dispatch breaks selective "
                              "recomputation): use 'full' or 'layer'")
    if args.n_experts and dims.tp > 1 and dims.ep == 1:
        raise ConfigError("an MoE model with parallel.tp > 1 needs parallel.ep > 1 (the MoE "
                          "runs on each rank's sequence shard): set parallel.ep")
    if dims.cp > 1:
        check_cp(args, dims.cp, dims.tp, tcfg.seq_len, pcfg.cp_comm_type)
    if dims.pp > 1:
        check_pipeline(pcfg.pp_schedule, dims.pp, pcfg.pp_virtual_stages, microbatches,
                       cfg.compile.enabled)
        parse_layout(pcfg.pp_layout, args.n_layers, dims.pp * pcfg.pp_virtual_stages)
    check_lr_schedule(cfg.lr_schedule, cfg.optimizer.lr)
    check_optimizer(cfg.optimizer, device, pcfg.fsdp_cpu_offload)
    _check_validation(cfg, dims)
    if cfg.fp8.enabled:
        check_fp8(cfg.fp8, device, dims.tp, tcfg.micro_batch_size * tcfg.seq_len // dims.cp)
    return dims


def _check_validation(cfg: Config, dims: ParallelDims) -> None:
    """Validation needs held-out data and runs without pipeline stages."""
    if not cfg.validation.enabled:
        return
    if dims.pp > 1:
        raise ConfigError("validation.enabled with parallel.pp > 1 is not available in "
                          "this version: set validation.enabled = false")
    if not cfg.validation.path and cfg.data.source != "indexed":
        raise ConfigError(f"validation.enabled with data.source = '{cfg.data.source}' needs "
                          "validation.path: set it to a held-out file")
