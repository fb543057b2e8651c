"""DeepSeek-V3's blockwise FP8: the casts (``quantize_tiles``: 1x128 tiles along the rows;
``quantize_blocks``: 128x128 blocks, of one matrix or of each in a stack) and the product.

``a @ b^T`` of two float8 e4m3 matrices scaled in small groups:
``a`` (M, K) in 1x128 tiles along K, one fp32 scale per tile (M, ceil(K / 128)); ``b`` (N, K)
either in the same tiles (N, ceil(K / 128)) or in 128x128 blocks (ceil(N / 128), ceil(K / 128)).
Scales dequantise (value = bits x scale).

On a Hopper GPU one cuBLASLt GEMM applies the scales inside its sums (``torch._scaled_mm``'s
blockwise scaling, CUDA 12.9 or newer). Both operands go in as 1x128 tiles: block scales are
repeated on each of their 128 rows (the same numbers), because torch 2.11's 1x128 x 128x128
combination returned wrong products on an H200 (docs/benchmarks.md, 2026-12-05). Elsewhere, or
with ``emulate``, the operands are dequantised and multiplied in fp32 (the same numbers up to
the order of the sums). ``blockwise_gemm_works(device)`` says whether the GPU path runs on a
device, checked once against the dequantised product.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

BLOCK = 128
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
EPS = 1e-12  # torchao's floor on a group's absolute maximum (an all-zero group)


def _cast(values: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` times ``448 / amax`` (fp64, rounded to fp32), saturated and cast to e4m3, and
    the fp32 scale that dequantises them (that factor's reciprocal, about ``amax / 448``)."""
    factor = (E4M3_MAX / amax.clamp(min=EPS).double()).float()
    bits = (values * factor).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return bits, factor.reciprocal()


def quantize_tiles(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` (rows, cols) in 1x128 tiles along its rows: the e4m3 values (rows, cols) and one
    fp32 scale per tile (rows, ceil(cols / 128)); a last partial tile is scaled on its own."""
    rows, cols = t.shape
    padded = F.pad(t.float(), (0, -cols % BLOCK)).view(rows, -1, BLOCK)
    bits, scales = _cast(padded, padded.abs().amax(-1, keepdim=True))
    return bits.view(rows, -1)[:, :cols], scales.squeeze(-1)


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` (..., rows, cols) in 128x128 blocks (each matrix of a stack on its own): the e4m3
    values (..., rows, cols) and one fp32 scale per block (..., ceil(rows / 128),
    ceil(cols / 128))."""
    *lead, rows, cols = w.shape
    padded = F.pad(w.float(), (0, -cols % BLOCK, 0, -rows % BLOCK))
    r, c = padded.shape[-2] // BLOCK, padded.shape[-1] // BLOCK
    blocks = padded.view(*lead, r, BLOCK, c, BLOCK)
    bits, scales = _cast(blocks, blocks.abs().amax(dim=(-3, -1), keepdim=True))
    return bits.view(padded.shape)[..., :rows, :cols], scales[..., 0, :, 0]


def dequantize(bits: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 values of ``bits`` (..., rows, cols) and their scales, one per 1x128 tile (...,
    rows, ceil(cols / 128)) or per 128x128 block (..., ceil(rows / 128), ceil(cols / 128)): the
    scales' second-last dimension says which."""
    rows, cols = bits.shape[-2:]
    full = scales.repeat_interleave(BLOCK, dim=-1)
    if scales.shape[-2] != rows:  # blocks
        full = full.repeat_interleave(BLOCK, dim=-2)
    return bits.float() * full[..., :rows, :cols]


def _check(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor,
           b_scales: torch.Tensor) -> None:
    (m, k), (n, k_b) = a.shape, b.shape
    tiles = -(-k // BLOCK)
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn or k != k_b:
        raise ValueError(f"blockwise_mm multiplies e4m3 (M, K) by e4m3 (N, K): got {a.dtype} "
                         f"{tuple(a.shape)} and {b.dtype} {tuple(b.shape)}")
    if tuple(a_scales.shape) != (m, tiles) or b_scales.shape[1] != tiles or \
            b_scales.shape[0] not in (n, -(-n // BLOCK)):
        raise ValueError(f"blockwise_mm's scales do not match its operands: a {tuple(a.shape)} "
                         f"with {tuple(a_scales.shape)}, b {tuple(b.shape)} with "
                         f"{tuple(b_scales.shape)}")


def _scaled_mm(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    """cuBLASLt's blockwise product through ``torch._scaled_mm``, whose layouts are: ``a``
    row-major with its tile scales outer-dim-major (column-major); the right operand (K, N)
    column-major with its tile scales (ceil(K / 128), N) row-major."""
    if b_scales.shape[0] != b.shape[0]:  # blocks, as the same scale on each of their rows
        b_scales = b_scales.repeat_interleave(BLOCK, dim=0)[:b.shape[0]]
    scale_b = b_scales.t().contiguous()
    return torch._scaled_mm(a.contiguous(), b.contiguous().t(),
                            scale_a=a_scales.t().contiguous().t(), scale_b=scale_b,
                            out_dtype=out_dtype, use_fast_accum=False)


# Inductor hands the operands over contiguous, as the GEMM takes them: its fused casts then write
# them in that layout, where a strided copy inside the op cost 0.24 ms a product on an H200.
CONTIGUOUS = getattr(torch.Tag, "needs_contiguous_strides", torch.Tag.needs_exact_strides)


@torch.library.custom_op("dtrain::blockwise_mm", mutates_args=(), tags=(CONTIGUOUS,))
def blockwise_mm(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor,
                 b_scales: torch.Tensor, out_dtype: torch.dtype, emulate: bool) -> torch.Tensor:
    """``a @ b^T`` (module docstring) in ``out_dtype``: cuBLASLt's blockwise GEMM on a GPU where
    it works, else (or with ``emulate``) the dequantised product in fp32. Operands that break
    the contract raise ``ValueError``; on the GPU path K, N and M must be multiples of 16."""
    _check(a, a_scales, b, b_scales)
    if a.is_cuda and not emulate and blockwise_gemm_works(a.device):
        if a.shape[0] % 16 or a.shape[1] % 16 or b.shape[0] % 16:
            raise ValueError(f"blockwise FP8 GEMMs need every width a multiple of 16 (cuBLASLt): "
                             f"got {tuple(a.shape)} x {tuple(b.shape)}; for the weight "
                             f"gradient this is the tokens of a micro-batch")
        return _scaled_mm(a, a_scales, b, b_scales, out_dtype)
    with torch.autocast(a.device.type, enabled=False):
        return (dequantize(a, a_scales) @ dequantize(b, b_scales).t()).to(out_dtype)


@blockwise_mm.register_fake
def _(a, a_scales, b, b_scales, out_dtype, emulate):
    return a.new_empty(a.shape[0], b.shape[0], dtype=out_dtype)


@functools.cache
def blockwise_gemm_works(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` takes 1x128 / 128x128 scales on this GPU (Hopper with CUDA
    12.9 or newer): one small product of each kind the blockwise linear runs, compared with the
    dequantised product."""
    if device.type != "cuda":
        return False
    generator = torch.Generator(device=device).manual_seed(0)

    def operand(rows: int, scale_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        bits = torch.randn(rows, 256, device=device, generator=generator).to(torch.float8_e4m3fn)
        return bits, torch.rand(scale_rows, 2, device=device, generator=generator) + 0.5

    a, b = operand(128, 128), operand(256, 2)
    tiles_b = operand(256, 256)
    try:
        for right in (b, tiles_b):
            got = _scaled_mm(*a, *right, torch.float32)
            want = dequantize(*a) @ dequantize(*right).t()
            # The same products; cuBLASLt sums them in another order (measured 2e-4 of the
            # largest value on an H200).
            if (got - want).abs().max() > 1e-3 * want.abs().max():
                return False
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True
