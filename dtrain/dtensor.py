"""The one place that looks through a DTensor: the part of a tensor this process holds."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The shard this process holds of a DTensor (a sharded parameter, gradient or activation);
    any other tensor as it is. An isinstance check, which torch.compile traces (it does not
    trace ``hasattr`` on a DTensor)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of a DTensor (gathered from its shards, summed if partial); any other
    tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
