"""torch.compile per transformer block: each block compiles once and the graph is reused."""

from __future__ import annotations

import torch

from dtrain.models.llama import Transformer


def apply_compile(model: Transformer, fullgraph: bool = True) -> None:
    """Wraps each block in ``torch.compile`` (names gain ``_orig_mod``, which ``canonical_name``
    removes). Applied after checkpointing and before FSDP. ``fullgraph=False`` lets the block
    break around code compile must not trace (MoE layers' host reads of expert counts)."""
    for name, block in list(model.layers.items()):
        model.layers[name] = torch.compile(block, fullgraph=fullgraph)
