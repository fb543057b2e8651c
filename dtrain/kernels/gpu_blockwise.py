"""The Triton kernels of the experts' blockwise FP8 GEMMs (``dtrain.kernels.grouped_blockwise``;
CUDA only, imported where a CUDA tensor needs one).

Both take rows sorted by expert in groups that start at multiples of 128 (``pad_groups``), so a
128-row tile, or a 128-token tile of the weight gradient's sum, lies in one expert, and the
groups' ends stay on the device: nothing is read on the host. Each 128-wide slice of the sum is
one FP8 tensor-core product in fp32, multiplied by its two scales and added to an fp32
accumulator, as DeepSeek-V3's recipe and DeepGEMM apply the scales: the per-slice promotion
keeps the sum's precision that one long FP8 accumulation would lose.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dtrain.kernels.blockwise_mm import BLOCK  # the sums' slices, a row tile, a weight block

TILE = tl.constexpr(BLOCK)  # the same, as compiled kernels read a global
# Each kernel's launch (tools/hopper_compile.py compiles them for sm90 and shows their registers
# and pipelining). The product's tiles are 128 x 128, one weight block wide: a column tile
# takes one block scale per slice of the sum. The weight gradient's output tiles are 64 x 128
# on 4 warps: on one H100, at 8,192 tokens x 14,336 x 4,096, 2.04 ms against 3.17 for 128 x 64
# on 8 warps and 4.5-5.8 for 128 x 128 (docs/benchmarks.md, 2026-12-06).
PRODUCT = {"GROUP_M": 8, "num_warps": 8, "num_stages": 3}
WEIGHT_GRADIENT = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}


@triton.jit
def grouped_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, ends_ptr, out_ptr, M, N, K, E,
                   E_POW2: tl.constexpr, GROUP_M: tl.constexpr):
    # Programs walk GROUP_M row tiles for each column tile, for the weight blocks' reuse in L2.
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, TILE), tl.cdiv(N, TILE)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m
    rows = pid_m * TILE + tl.arange(0, TILE)
    cols = pid_n * TILE + tl.arange(0, TILE)
    out_mask = (rows < M)[:, None] & (cols < N)[None, :]
    # The tile's expert: the groups ending at or before its first row.
    e = tl.arange(0, E_POW2)
    ends = tl.load(ends_ptr + e, mask=e < E, other=2**31 - 1)
    expert = tl.sum((ends <= pid_m * TILE).to(tl.int32), axis=0)
    # Past the last group: no slices to sum (a loop bound, not a branch, so that it is pipelined)
    k_tiles = tl.where(expert < E, tl.cdiv(K, TILE), 0)
    expert = tl.minimum(expert, E - 1)
    w = w_ptr + expert.to(tl.int64) * N * K
    w_scale = w_scale_ptr + (expert * tl.cdiv(N, TILE) + pid_n) * tl.cdiv(K, TILE)
    ks = tl.arange(0, TILE)
    acc = tl.zeros([TILE, TILE], dtype=tl.float32)
    for kb in range(0, k_tiles):
        k = kb * TILE + ks
        a = tl.load(a_ptr + rows.to(tl.int64)[:, None] * K + k[None, :],
                    mask=(rows < M)[:, None] & (k < K)[None, :], other=0.0)
        b = tl.load(w + cols.to(tl.int64)[None, :] * K + k[:, None],
                    mask=(k < K)[:, None] & (cols < N)[None, :], other=0.0)
        a_scale = tl.load(a_scale_ptr + rows.to(tl.int64) * tl.cdiv(K, TILE) + kb,
                          mask=rows < M, other=0.0)
        acc += tl.dot(a, b) * (a_scale[:, None] * tl.load(w_scale + kb))
    # Rows past the last group get zeros.
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def grouped_mm(a: torch.Tensor, a_scales: torch.Tensor, w: torch.Tensor, w_scales: torch.Tensor,
               ends: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a [M, K]`` (1x128 tiles) times each expert's ``w [E, N, K]`` (128x128 blocks)
    transposed, on the groups of rows ending at ``ends``; all contiguous."""
    (m, k), (n_experts, n, _) = a.shape, w.shape
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    grid = (triton.cdiv(m, BLOCK) * triton.cdiv(n, BLOCK),)
    grouped_kernel[grid](a, a_scales, w, w_scales, ends, out, m, n, k, n_experts,
                         E_POW2=triton.next_power_of_2(n_experts), **PRODUCT)
    return out


@triton.jit
def weight_gradient_kernel(g_ptr, g_scale_ptr, a_ptr, a_scale_ptr, ends_ptr, total_ptr, M, N, K,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    expert, pid_n, pid_k = tl.program_id(2), tl.program_id(0), tl.program_id(1)
    start = tl.load(ends_ptr + expert - 1, mask=expert > 0, other=0)
    stop = tl.load(ends_ptr + expert)
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    tokens = tl.arange(0, TILE)
    tiles = tl.cdiv(M, TILE)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for tile in range(start // TILE, stop // TILE):
        t = tile * TILE + tokens
        g = tl.load(g_ptr + rows_n.to(tl.int64)[:, None] * M + t[None, :],
                    mask=(rows_n < N)[:, None], other=0.0)
        a = tl.load(a_ptr + rows_k.to(tl.int64)[None, :] * M + t[:, None],
                    mask=(rows_k < K)[None, :], other=0.0)
        g_scale = tl.load(g_scale_ptr + rows_n * tiles + tile, mask=rows_n < N, other=0.0)
        a_scale = tl.load(a_scale_ptr + rows_k * tiles + tile, mask=rows_k < K, other=0.0)
        acc += tl.dot(g, a) * g_scale[:, None] * a_scale[None, :]
    mask = (rows_n < N)[:, None] & (rows_k < K)[None, :]
    into = total_ptr + expert.to(tl.int64) * N * K + rows_n.to(tl.int64)[:, None] * K \
        + rows_k[None, :]
    tl.store(into, tl.load(into, mask=mask) + acc, mask=mask)


def accumulate_weight_gradient(total: torch.Tensor, g_t: torch.Tensor, g_scales: torch.Tensor,
                               a_t: torch.Tensor, a_scales: torch.Tensor,
                               ends: torch.Tensor) -> None:
    """``total[e] += g_t[:, rows of e] @ a_t[:, rows of e]^T`` for each expert, both operands
    in 128-token tiles along their rows (``g_t [N, M]``, ``a_t [K, M]``); all contiguous,
    ``total [E, N, K]`` fp32."""
    n_experts, n, k = total.shape
    grid = (triton.cdiv(n, WEIGHT_GRADIENT["BLOCK_N"]), triton.cdiv(k, WEIGHT_GRADIENT["BLOCK_K"]),
            n_experts)
    weight_gradient_kernel[grid](g_t, g_scales, a_t, a_scales, ends, total, g_t.shape[1], n, k,
                                 **WEIGHT_GRADIENT)
