"""Rotary position embedding: the frequencies of each channel pair (plain, Llama 3.1's scaling or
YaRN), the cache of rotations per position, and the rotation of Meta's interleaved pairs
(2i, 2i+1) of each head."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dtrain.kernels.rope import kernel_applies as rope_kernel_applies
from dtrain.kernels.rope import rope, rotate_pairs


@dataclass
class RopeScaling:
    """Frequency scaling of RoPE for a context ``factor`` times the ``original_max_seq_len`` the
    model was trained with, as Hugging Face transformers computes it (``modeling_rope_utils``).

    ``kind="llama3"`` (Llama 3.1): wavelengths above original / ``low_freq_factor`` are
    stretched by ``factor``, those below original / ``high_freq_factor`` kept, those between
    blended. ``kind="yarn"``: frequencies that turn fewer than ``beta_slow`` times over the
    original context are stretched, more than ``beta_fast`` times kept, with a linear ramp
    between (its ends rounded outwards with ``truncate``), and cos and sin scaled by the
    attention factor ``rope_attention_factor`` (from ``mscale`` and ``mscale_all_dim``)."""
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192
    kind: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True

    def __post_init__(self):
        if self.kind not in ("llama3", "yarn"):
            raise ValueError(f"RoPE scaling kind {self.kind!r}: use llama3 or yarn")


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Rotation frequency of each pair of channels, shape (head_dim // 2,), float64."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return freqs
    if scaling.kind == "yarn":
        return _yarn_frequencies(freqs, head_dim, theta, scaling)
    wavelen = 2 * math.pi / freqs
    low_wavelen = scaling.original_max_seq_len / scaling.low_freq_factor
    high_wavelen = scaling.original_max_seq_len / scaling.high_freq_factor
    smooth = ((scaling.original_max_seq_len / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    blended = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    return torch.where(wavelen > low_wavelen, freqs / scaling.factor,
                       torch.where(wavelen < high_wavelen, freqs, blended))


def _yarn_frequencies(freqs: torch.Tensor, head_dim: int, theta: float,
                      scaling: RopeScaling) -> torch.Tensor:
    """YaRN's blend of ``freqs`` (extrapolated) and ``freqs / factor`` (interpolated): pair i
    is interpolated by ramp(i), 0 up to the pair that turns ``beta_fast`` times over the
    original context, 1 from the one that turns ``beta_slow`` times."""
    def pair_turning(rotations: float) -> float:  # fractional pair index with that many turns
        return (head_dim * math.log(scaling.original_max_seq_len / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low, high = pair_turning(scaling.beta_fast), pair_turning(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return freqs / scaling.factor * ramp + freqs * (1 - ramp)


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """The factor cos and sin are multiplied by: YaRN's ``0.1 ln(factor) + 1``, or with
    ``mscale`` and ``mscale_all_dim`` both set the ratio of that formula's value with each as
    its coefficient (DeepSeek); 1 without scaling or with llama3's."""
    if scaling is None or scaling.kind != "yarn":
        return 1.0

    def mscale(coefficient: float = 1.0) -> float:
        return 1.0 if scaling.factor <= 1 else 0.1 * coefficient * math.log(scaling.factor) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.mscale) / mscale(scaling.mscale_all_dim)
    return mscale()


def rope_cache(seq_len: int, head_dim: int, theta: float,
               scaling: RopeScaling | None) -> torch.Tensor:
    """attention_factor * exp(i * position * frequency) per position and channel pair, shape
    (seq_len, head_dim // 2), complex64: rotating q and k by it also scales both by YaRN's
    attention factor (1 otherwise)."""
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64),
                         rope_frequencies(head_dim, theta, scaling))
    magnitude = torch.full_like(angles, rope_attention_factor(scaling))
    return torch.polar(magnitude, angles).to(torch.complex64)


def apply_rope(x: torch.Tensor, cache: torch.Tensor, kernel: bool = False) -> torch.Tensor:
    """Rotates channel pairs (2i, 2i+1) of x (batch, seq, heads, head_dim) by the cached angles
    (Meta's interleaved layout), in fp32 for 16-bit x.

    ``kernel``: the ``dtrain::rope`` custom op, a Triton kernel on CUDA (``dtrain.kernels``)
    that reads and writes whole rows, where Inductor's code for the pairs loads every other
    channel. Otherwise, eager: one complex multiply (three kernels); under ``torch.compile``:
    the same products in real arithmetic, which Inductor fuses into one kernel with the casts
    around them (it has no code generation for complex tensors)."""
    cache = cache[: x.shape[1]]
    if kernel and rope_kernel_applies(x):
        return rope(x, torch.view_as_real(cache))
    cache = cache[:, None, :]
    real = x.to(torch.promote_types(x.dtype, torch.float32))  # bf16 rotates in fp32
    if torch.compiler.is_compiling():
        return rotate_pairs(real, torch.view_as_real(cache)).type_as(x)
    pairs = torch.view_as_complex(real.unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * cache.to(pairs.dtype)).flatten(-2).type_as(x)
