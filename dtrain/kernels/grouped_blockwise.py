"""The MoE experts' blockwise FP8 GEMMs (``fp8.recipe = "blockwise"``): each expert's rows times
its weight, and each expert's weight gradient added into its fp32 gradient, in DeepSeek-V3's
tiles and blocks (``dtrain.kernels.blockwise_mm``'s casts).

Rows come sorted by expert in groups that end at ``ends`` (int32, on the device) and start at
multiples of 128 (``dtrain.models.grouped_gemm.pad_groups``): a 1x128 tile of the rows, a
128-row tile of the product and a 128-token tile of the weight gradient's sum each lie in one
expert. On a GPU (and in Triton's interpreter) both are Triton kernels
(``dtrain.kernels.gpu_blockwise``) that read the ends on the device and apply the scales to
each 128-wide slice of the sum; elsewhere, or with ``emulate``, the operands are dequantised
and multiplied in fp32, one matmul per expert after the ends are read on the host (the same
products, summed in another order). ``gpu_kernels_failure(device)`` says why the Triton
kernels do not run on a GPU (None where they do), checked once against the emulated products.
"""

from __future__ import annotations

import functools
import os

import torch

from dtrain.kernels.accumulate import groups
from dtrain.kernels.blockwise_mm import CONTIGUOUS, dequantize, quantize_blocks, quantize_tiles

TOLERANCE = 1e-3  # of the largest value: the GPU kernels against the emulated products
# Triton's interpreter runs the kernels on CPU tensors (the tests, on machines without CUDA).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _kernels_run(t: torch.Tensor, emulate: bool) -> bool:
    return not emulate and (t.is_cuda or INTERPRETED)


def _emulated_product(a: torch.Tensor, a_scales: torch.Tensor, w: torch.Tensor,
                      w_scales: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``grouped_blockwise_mm`` in fp32, one product per expert after one host read of the
    ends (as ``torch._grouped_mm`` computes fp32 on a GPU; its meta function, which compiled
    graphs trace, refuses fp32); zero past the groups."""
    a, w = dequantize(a, a_scales), dequantize(w, w_scales)
    out = a.new_zeros(a.shape[0], w.shape[1])
    for e, rows in groups(ends):
        out[rows] = a[rows] @ w[e].t()
    return out


def _emulated_weight_gradient(g_t: torch.Tensor, g_scales: torch.Tensor, a_t: torch.Tensor,
                              a_scales: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """What ``accumulate_grouped_blockwise`` adds, in fp32, one product per expert."""
    g_t, a_t = dequantize(g_t, g_scales), dequantize(a_t, a_scales)
    total = g_t.new_zeros(ends.numel(), g_t.shape[0], a_t.shape[0])
    for e, rows in groups(ends):
        total[e] = g_t[:, rows] @ a_t[:, rows].t()
    return total


# Both ops ask Inductor for contiguous operands (CONTIGUOUS), as the kernels take them: its fused
# casts then write them so, where a copy inside the op would cost a pass over each.
@torch.library.custom_op("dtrain::grouped_blockwise_mm", mutates_args=(), tags=(CONTIGUOUS,))
def grouped_blockwise_mm(a: torch.Tensor, a_scales: torch.Tensor, w: torch.Tensor,
                         w_scales: torch.Tensor, ends: torch.Tensor, out_dtype: torch.dtype,
                         emulate: bool) -> torch.Tensor:
    """``a [M, K]`` (e4m3 in 1x128 tiles along K, scales ``[M, K / 128]``) times each expert's
    ``w [E, N, K]`` (e4m3 in 128x128 blocks, scales ``[E, N / 128, K / 128]``) transposed, on
    the groups of rows ending at ``ends``: ``[M, N]`` in ``out_dtype``, zero in the rows past
    ``ends[-1]``."""
    if _kernels_run(a, emulate):
        from dtrain.kernels import gpu_blockwise

        return gpu_blockwise.grouped_mm(a.contiguous(), a_scales.contiguous(), w.contiguous(),
                                        w_scales.contiguous(), ends, out_dtype)
    with torch.autocast(a.device.type, enabled=False):
        return _emulated_product(a, a_scales, w, w_scales, ends).to(out_dtype)


@grouped_blockwise_mm.register_fake
def _(a, a_scales, w, w_scales, ends, out_dtype, emulate):
    return a.new_empty(a.shape[0], w.shape[1], dtype=out_dtype)


@torch.library.custom_op("dtrain::accumulate_grouped_blockwise", mutates_args=("total",),
                         tags=(CONTIGUOUS,))
def accumulate_grouped_blockwise(total: torch.Tensor, g_t: torch.Tensor, g_scales: torch.Tensor,
                                 a_t: torch.Tensor, a_scales: torch.Tensor, ends: torch.Tensor,
                                 emulate: bool) -> None:
    """``total[e] += g_t[:, rows of e] @ a_t[:, rows of e]^T`` for each expert e, into the fp32
    ``total [E, N, K]``: ``g_t [N, M]`` and ``a_t [K, M]`` in e4m3, both in 1x128 tiles along
    the rows (128-token tiles: scales ``[N, M / 128]`` and ``[K, M / 128]``). On the GPU the sum
    is added inside the kernel (no second pass over ``total``); columns past ``ends[-1]`` are
    never read."""
    if _kernels_run(total, emulate):
        from dtrain.kernels import gpu_blockwise

        if not total.is_contiguous():  # the kernel adds into it in place, by its own strides
            raise ValueError(f"accumulate_grouped_blockwise adds into a contiguous [E, N, K] "
                             f"gradient; got strides {total.stride()}")
        gpu_blockwise.accumulate_weight_gradient(total, g_t.contiguous(), g_scales.contiguous(),
                                                 a_t.contiguous(), a_scales.contiguous(), ends)
        return
    with torch.autocast(total.device.type, enabled=False):
        total.add_(_emulated_weight_gradient(g_t, g_scales, a_t, a_scales, ends))


@accumulate_grouped_blockwise.register_fake
def _(total, g_t, g_scales, a_t, a_scales, ends, emulate):
    return None


@functools.cache
def gpu_kernels_failure(device: torch.device) -> str | None:
    """None where both Triton kernels run on ``device`` and equal the emulated products on two
    experts' small operands (one empty group, rows past the last), else what went wrong."""
    try:
        from dtrain.kernels import gpu_blockwise

        generator = torch.Generator(device=device).manual_seed(0)
        rows = torch.randn(384, 256, device=device, generator=generator)
        ends = torch.tensor([128, 128, 256], dtype=torch.int32, device=device)
        weight = torch.randn(3, 128, 256, device=device, generator=generator)
        grad = torch.randn(384, 128, device=device, generator=generator)
        a, w = quantize_tiles(rows), quantize_blocks(weight)
        g_t, a_t = quantize_tiles(grad.t().contiguous()), quantize_tiles(rows.t().contiguous())
        got = gpu_blockwise.grouped_mm(*a, *w, ends, torch.float32)[:256]
        want = _emulated_product(*a, *w, ends)[:256]
        got_grad = torch.zeros(3, 128, 256, device=device)
        gpu_blockwise.accumulate_weight_gradient(got_grad, *g_t, *a_t, ends)
        want_grad = _emulated_weight_gradient(*g_t, *a_t, ends)
    except Exception as e:  # no such device, or a Triton that cannot build them: said, not raised
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    for name, kernel, emulated in (("product", got, want),
                                   ("weight gradient", got_grad, want_grad)):
        # The same products summed in another order (6e-7 of the largest value in Triton's
        # interpreter), in Hopper's FP8 tensor cores with fewer bits within each 128-wide slice
        # (cuBLASLt's blockwise GEMM: 2e-4 on an H200).
        error = (kernel - emulated).abs().max()
        if not error <= TOLERANCE * emulated.abs().max():
            return f"the {name} differs from the emulated one by {error:.3g}"
    return None
