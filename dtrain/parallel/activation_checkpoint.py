"""Activation checkpointing: recompute a block's activations in backward instead of storing them.

Modes: ``full`` wraps every block; ``layer`` every Nth block; ``op`` wraps every block with a
selective policy that saves the outputs of expensive operators (attention, matmuls, tensor-parallel
reductions) and recomputes the cheap elementwise rest (norms, RoPE, SwiGLU activations, casts).
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from dtrain.config import ActivationCheckpointConfig
from dtrain.models.llama import Transformer
from dtrain.parallel.context import CP_ATTENTION_OPS

_aten = torch.ops.aten
# Outputs worth keeping: expensive to recompute relative to their size.
SAVE_OPS = {
    _aten.mm.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_reduce.default,
    # FP8: the absolute maximum that scales a tensor costs a full read for one number.
    _aten.max.default,
    # Context-parallel attention: recomputing it would attend and communicate again.
    *CP_ATTENTION_OPS,
}


def _op_policy(every_second_mm: bool):
    """A selective-checkpoint policy; its counter is per forward (fresh contexts per call)."""
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func == _aten.mm.default:
            counts["recompute" if ctx.is_recompute else "forward"] += 1
            n = counts["recompute" if ctx.is_recompute else "forward"]
            if every_second_mm and n % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return (CheckpointPolicy.MUST_SAVE if func in SAVE_OPS
                else CheckpointPolicy.PREFER_RECOMPUTE)

    return policy


def op_context(every_second_mm: bool):
    """The forward and recompute contexts of ``op`` mode's selective policy (a ``context_fn``)."""
    return create_selective_checkpoint_contexts(_op_policy(every_second_mm))


def apply_activation_checkpointing(model: Transformer, cfg: ActivationCheckpointConfig) -> None:
    """Wraps the blocks of ``model`` (the multi-token prediction depths' too) in place
    according to ``cfg.mode``."""
    if cfg.mode == "none":
        return

    def wrap(i: int, block: nn.Module) -> nn.Module:
        if cfg.mode == "op":
            context_fn = partial(op_context, cfg.op_recompute_every_second_mm)
            return checkpoint_wrapper(block, context_fn=context_fn, preserve_rng_state=False)
        if cfg.mode == "full" or (i + 1) % cfg.every_n_layers == 0:
            return checkpoint_wrapper(block, preserve_rng_state=False)
        return block

    model.wrap_blocks(wrap)
