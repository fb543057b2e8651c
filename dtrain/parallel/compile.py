"""torch.compile per transformer block: each block compiles once and the graph is reused."""

from __future__ import annotations

import torch

from dtrain.models.llama import Transformer


def apply_compile(model: Transformer) -> None:
    """Wraps each block in ``torch.compile(fullgraph=True)`` (names gain ``_orig_mod``, which
    ``canonical_name`` removes). Applied after checkpointing and before FSDP."""
    for name, block in list(model.layers.items()):
        model.layers[name] = torch.compile(block, fullgraph=True)
