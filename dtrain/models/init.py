"""Weight initialisation that gives the same values on every device and every parallel layout.

Each element's value is a pure function of (seed, parameter name, element index): a counter-based
hash turned into a normal sample by the inverse CDF. No generator state is carried between
parameters, so a model built on ``meta``, sharded any way and materialised on CPU or CUDA gets the
same weights as the single-device model (bitwise on one device type; CPU and CUDA ``erfinv`` may
differ in the last bit of float32).
"""

import math
import zlib

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from dtrain.dtensor import local

_M32 = 0xFFFFFFFF
_CHUNK = 1 << 24  # elements hashed at a time: bounds the int64/float64 temporaries


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x < 2**32 without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (lowbias32): distinct inputs give well-spread outputs."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _uniform(start: int, count: int, key: int, device: torch.device) -> torch.Tensor:
    """float64 samples in (0, 1) for element indices [start, start + count)."""
    idx = torch.arange(start, start + count, dtype=torch.int64, device=device)
    bits = _hash32(_hash32((idx & _M32) ^ (key & _M32)) ^ (idx >> 32) ^ (key >> 32))
    return (bits.to(torch.float64) + 0.5) / 2.0**32


def param_key(seed: int, name: str) -> int:
    """A 64-bit stream key for one parameter."""
    return ((seed & _M32) << 32) | zlib.crc32(name.encode())


def normal_(tensor: torch.Tensor, std: float, seed: int, name: str,
            cutoff: float | None = None) -> torch.Tensor:
    """Fills ``tensor`` (plain or DTensor) with N(0, std^2) samples, truncated to
    ``|x| <= cutoff * std`` when ``cutoff`` is given. Values depend only on seed, name, index."""
    key = param_key(seed, name)
    lo, hi = (0.0, 1.0)
    if cutoff is not None:
        lo, hi = (0.5 * (1 + math.erf(-cutoff / math.sqrt(2))),
                  0.5 * (1 + math.erf(cutoff / math.sqrt(2))))
    shard = local(tensor)
    full = torch.empty(tensor.shape, dtype=shard.dtype, device=shard.device).view(-1)
    for start in range(0, full.numel(), _CHUNK):
        count = min(_CHUNK, full.numel() - start)
        u = lo + (hi - lo) * _uniform(start, count, key, shard.device)
        z = math.sqrt(2) * torch.erfinv((2 * u - 1).clamp(-1 + 1e-15, 1 - 1e-15))
        full[start:start + count] = (z * std).to(full.dtype)
    return _fill(tensor, full.view(tensor.shape))


def constant_(tensor: torch.Tensor, value: float) -> torch.Tensor:
    """Fills ``tensor`` (plain or DTensor) with ``value``."""
    with torch.no_grad():
        local(tensor).fill_(value)
    return tensor


def _fill(tensor: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """Copies the part of the full-shape ``full`` that ``tensor`` holds into it."""
    with torch.no_grad():
        if isinstance(tensor, DTensor):
            # src_data_rank=None: every rank holds ``full`` already, so sharding is a local slice.
            full = distribute_tensor(full, tensor.device_mesh, tensor.placements,
                                     src_data_rank=None).to_local()
        local(tensor).copy_(full)
    return tensor
