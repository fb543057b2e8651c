"""Activation checkpointing: recompute a block's activations in backward instead of storing them."""

from __future__ import annotations

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from dtrain.config import ActivationCheckpointConfig
from dtrain.models.llama import Transformer


def apply_activation_checkpointing(model: Transformer, cfg: ActivationCheckpointConfig) -> None:
    """none; full: every block; selective: every ``every_n_layers``-th block (counting from 1)."""
    if cfg.mode == "none":
        return
    for i, (name, block) in enumerate(list(model.layers.items())):
        if cfg.mode == "full" or (i + 1) % cfg.every_n_layers == 0:
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)
