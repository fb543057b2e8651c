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

BLOCK = 128  # the recipe's tile: the sums' slices, the rows of a tile, a weight block's side


@triton.jit
def _grouped_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, ends_ptr, out_ptr, M, N, K, E,
                    E_POW2: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Programs walk GROUP_M row tiles for each column tile, for the weight blocks' reuse in L2.
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK), tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m
    rows = pid_m * BLOCK + tl.arange(0, BLOCK)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_mask = (rows < M)[:, None] & (cols < N)[None, :]
    # The tile's expert: the groups ending at or before its first row.
    e = tl.arange(0, E_POW2)
    ends = tl.load(ends_ptr + e, mask=e < E, other=2**31 - 1)
    expert = tl.sum((ends <= pid_m * BLOCK).to(tl.int32), axis=0)
    acc = tl.zeros([BLOCK, BLOCK_N], dtype=tl.float32)
    if expert < E:
        w = w_ptr + expert.to(tl.int64) * N * K
        w_scale = w_scale_ptr + (expert * tl.cdiv(N, BLOCK) + pid_n * BLOCK_N // BLOCK) \
            * tl.cdiv(K, BLOCK)
        ks = tl.arange(0, BLOCK)
        for kb in range(0, tl.cdiv(K, BLOCK)):
            k = kb * BLOCK + ks
            a = tl.load(a_ptr + rows.to(tl.int64)[:, None] * K + k[None, :],
                        mask=(rows < M)[:, None] & (k < K)[None, :], other=0.0)
            b = tl.load(w + cols.to(tl.int64)[None, :] * K + k[:, None],
                        mask=(k < K)[:, None] & (cols < N)[None, :], other=0.0)
            a_scale = tl.load(a_scale_ptr + rows.to(tl.int64) * tl.cdiv(K, BLOCK) + kb,
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
    block_n = BLOCK
    grid = (triton.cdiv(m, BLOCK) * triton.cdiv(n, block_n),)
    _grouped_kernel[grid](a, a_scales, w, w_scales, ends, out, m, n, k, n_experts,
                          E_POW2=triton.next_power_of_2(n_experts), BLOCK_N=block_n, GROUP_M=8,
                          num_warps=8, num_stages=3)
    return out


@triton.jit
def _weight_gradient_kernel(g_ptr, g_scale_ptr, a_ptr, a_scale_ptr, ends_ptr, total_ptr, M, N, K,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    expert, pid_n, pid_k = tl.program_id(2), tl.program_id(0), tl.program_id(1)
    start = tl.load(ends_ptr + expert - 1, mask=expert > 0, other=0)
    stop = tl.load(ends_ptr + expert)
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    tokens = tl.arange(0, BLOCK)
    tiles = tl.cdiv(M, BLOCK)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for tile in range(start // BLOCK, stop // BLOCK):
        t = tile * BLOCK + tokens
        g = tl.load(g_ptr + rows_n.to(tl.int64)[:, None] * M + t[None, :],
                    mask=(rows_n < N)[:, None], other=0.0)
        a = tl.load(a_ptr + rows_k.to(tl.int64)[None, :] * M + t[:, None],
                    mask=(rows_k < K)[None, :], other=0.0)
        g_scale = tl.load(g_scale_ptr + rows_n * tiles + tile, mask=rows_n < N, other=0.0)
        a_scale = tl.load(a_scale_ptr + rows_k * tiles + tile, mask=rows_k < K, other=0.0)
        acc += tl.dot(g, a) * (g_scale[:, None] * a_scale[None, :])
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
    grid = (triton.cdiv(n, BLOCK), triton.cdiv(k, BLOCK), n_experts)
    _weight_gradient_kernel[grid](g_t, g_scales, a_t, a_scales, ends, total, g_t.shape[1], n, k,
                                  BLOCK_N=BLOCK, BLOCK_K=BLOCK, num_warps=8, num_stages=3)
