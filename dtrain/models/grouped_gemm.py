"""The MoE experts' grouped GEMMs: rows sorted by expert, one product per stacked weight, in bf16
or FP8, with the weight cast once per optimizer step.

``GroupedLinear`` computes ``a[rows of e] @ weight[e].T`` for each expert e of a stacked weight
``[E, out, in]``, with its own backward: the input gradient is a grouped GEMM of the gradient
and the weight, and the weight gradient one grouped GEMM of the gradient and the input, written
as the whole stacked tensor (no per-expert slices in autograd). The weight enters the products
as an operand cast from the parameter (``cast_weight``):

- ``plain``: the weight in the compute dtype (``torch._grouped_mm``; fast in bf16 on sm90+).
- ``fp8`` and ``fp8_emulated``: the forward and the input gradient in float8 e4m3 with rowwise,
  power-of-two scales (``torch._scaled_grouped_mm`` on sm90+): one scale per row of the input and
  of the gradient, one per expert and output channel of the weight for the forward and per
  expert and input channel for the input gradient. The weight gradient is a bf16 product
  (a grouped FP8 one needs per-group column scales of both operands, whose extra passes cost
  more than the product saves; docs/benchmarks.md), or, with ``fp8_weight_gradient`` where it
  is added into ``.grad`` in place, each expert's FP8 product with tensorwise scales (the
  gradient e5m2, the input e4m3, one scale each a micro-batch, as torchao's tensorwise linears
  and Transformer Engine's grouped linear compute it) added inside cuBLASLt's GEMM
  (``dtrain.kernels.cublaslt.accumulate_grouped_scaled_mm``). FP8 takes groups of whole
  multiples of 16 rows: ``pad_groups`` spreads the sorted rows on the device into a buffer
  whose size does not depend on the counts, so nothing is read on the host in the forward.
  ``fp8_emulated`` computes the same rounded values in fp32 (on the CPU: tests, and machines
  without FP8 units).
- ``blockwise`` and ``blockwise_emulated``: DeepSeek-V3's blockwise recipe
  (``dtrain.kernels.blockwise_mm``'s casts): the rows in 1x128 tiles along the features, each
  expert's weight in 128x128 blocks (and its transpose's, the same values, for the input
  gradient), and for the weight gradient the output gradient and the rows in tiles of 128 rows
  along the tokens, which groups padded to multiples of 128 rows keep within one expert. The
  products are ``dtrain.kernels.grouped_blockwise``'s: on the GPU Triton kernels that apply the
  scales inside the sums and add the weight gradient into ``.grad`` inside the kernel;
  ``blockwise_emulated`` multiplies the dequantised operands in fp32 (the CPU, and
  ``fp8.emulate``).

The operands come from ``GroupedExperts.weight_operands`` (``dtrain.models.moe``): cast in each
forward, or by a variant once per optimizer step (``step_cast_weight``: every micro-batch's
forward and backward then use that operand, and each backward adds its weight gradient into the
weight's ``.grad`` in place, ``grad_into``: ``dtrain.kernels.accumulate``'s
``accumulate_grouped_matmul``, on a GPU one accumulating GEMM per expert for large experts). A
weight frozen at a step (``requires_grad`` False, read at each step) gets no gradient either
way, and its product is not computed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dtrain.kernels.accumulate import accumulate_grouped_matmul
from dtrain.kernels.blockwise_mm import BLOCK, quantize_blocks, quantize_tiles
from dtrain.kernels.cublaslt import accumulate_grouped_scaled_mm
from dtrain.kernels.grouped_blockwise import accumulate_grouped_blockwise, grouped_blockwise_mm
from dtrain.kernels.lazy_compile import compile_on_first_call

ALIGN = 16  # FP8 grouped GEMMs: rows per group a multiple of this
E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max
E5M2 = torch.float8_e5m2


def rowwise_fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` in float8 e4m3 with one power-of-two scale per slice along its last dim
    (``2^floor(log2(448 / amax))``): the FP8 bits and the inverse scales (``t``'s shape without
    its last dim, fp32), which multiply the product back."""
    amax = t.abs().amax(dim=-1, keepdim=True).float()
    scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax.clamp(min=1e-12))))
    bits = (t.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return bits, scale.reciprocal().squeeze(-1)


def tensorwise_fp8(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` in FP8 ``dtype`` with one scale (``max / amax``, as torchao's tensorwise casts):
    the bits and the fp32 inverse scale."""
    most = torch.finfo(dtype).max
    scale = most / t.abs().amax().float().clamp(min=1e-12)
    return (t.float() * scale).clamp(-most, most).to(dtype), scale.reciprocal()


def fp8_weight_gradient(grad_into: torch.Tensor, grad: torch.Tensor, a: torch.Tensor,
                        ends: torch.Tensor) -> None:
    """``grad_into[e] += grad[rows of e]^T a[rows of e]`` in FP8 for each expert: both operands
    transposed (the tokens along the rows the GEMM sums over) and cast with one scale each,
    the gradient to e5m2 and ``a`` to e4m3; rows past ``ends[-1]`` (unspecified) left out of
    the scales and the products."""
    valid = (torch.arange(a.shape[0], device=a.device) < ends[-1]).unsqueeze(1)
    grad_bits, grad_inverse = tensorwise_fp8(torch.where(valid, grad, 0).t().contiguous(), E5M2)
    a_bits, a_inverse = tensorwise_fp8(torch.where(valid, a, 0).t().contiguous(), E4M3)
    accumulate_grouped_scaled_mm(grad_into, grad_bits, a_bits, grad_inverse, a_inverse, ends)


BLOCKWISE = ("blockwise", "blockwise_emulated")


def group_rows(mode: str) -> int:
    """The multiple of rows each expert's group is padded to in an FP8 ``mode``."""
    return BLOCK if mode in BLOCKWISE else ALIGN


def cast_weight(weight: torch.Tensor, mode: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The operands ``GroupedLinear`` takes for a stacked weight ``[E, out, in]``: plain, the
    weight in ``dtype`` (the compute dtype); FP8, its bits and inverse scales per (expert, out)
    for the forward, and those of its transpose ``[E, in, out]`` per (expert, in) for the input
    gradient; blockwise, the same two in 128x128 blocks per expert."""
    weight = weight.detach()
    if mode == "plain":
        return (weight.to(dtype),)
    cast = quantize_blocks if mode in BLOCKWISE else rowwise_fp8
    return (*cast(weight), *cast(weight.transpose(-2, -1).contiguous()))


_compiled_cast_weight = compile_on_first_call(cast_weight, fullgraph=True, dynamic=False)


def step_cast_weight(weight: torch.Tensor, mode: str,
                     dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """``cast_weight`` once per step: compiled on the GPU (one reduction and one cast kernel an
    operand), eager elsewhere."""
    with torch.no_grad():
        return (_compiled_cast_weight if weight.is_cuda else cast_weight)(weight, mode, dtype)


def _dequantized(bits: torch.Tensor, inverse_scale: torch.Tensor) -> torch.Tensor:
    return bits.float() * inverse_scale.unsqueeze(-1)


def fp8_product(a: torch.Tensor, bits: torch.Tensor, inverse_scale: torch.Tensor,
                ends: torch.Tensor, emulated: bool) -> torch.Tensor:
    """Each group of rows of ``a`` (bf16; groups ending at ``ends``) times the transposed FP8
    weight ``bits [E, n, k]`` (inverse scales ``inverse_scale [E, n]``), ``a`` rounded to FP8
    with rowwise scales too; bf16 out, computed in fp32 where ``emulated``."""
    a_bits, a_inverse = rowwise_fp8(a)
    if emulated:
        return torch._grouped_mm(_dequantized(a_bits, a_inverse),
                                 _dequantized(bits, inverse_scale).transpose(-2, -1),
                                 offs=ends).to(a.dtype)
    return torch._scaled_grouped_mm(a_bits, bits.transpose(-2, -1), a_inverse, inverse_scale,
                                    offs=ends, out_dtype=torch.bfloat16, use_fast_accum=True)


def blockwise_product(a: torch.Tensor, bits: torch.Tensor, scales: torch.Tensor,
                      ends: torch.Tensor, emulate: bool) -> torch.Tensor:
    """Each group of rows of ``a`` times the transposed weight ``bits [E, n, k]`` in 128x128
    blocks (``scales [E, n / 128, k / 128]``), ``a`` cast in 1x128 tiles; ``a``'s dtype out."""
    return grouped_blockwise_mm(*quantize_tiles(a), bits, scales, ends, a.dtype, emulate)


def add_blockwise_weight_product(total: torch.Tensor, grad: torch.Tensor, a: torch.Tensor,
                                 ends: torch.Tensor, emulate: bool) -> None:
    """``total[e] += grad[rows of e]^T a[rows of e]`` (fp32 ``total [E, out, in]``), both cast
    in tiles of 128 rows along the tokens (groups start at multiples of 128: no tile spans two
    experts)."""
    grad_t, a_t = (quantize_tiles(t.t().contiguous()) for t in (grad, a))
    accumulate_grouped_blockwise(total, *grad_t, *a_t, ends, emulate)


def weight_product(grad: torch.Tensor, a: torch.Tensor, ends: torch.Tensor,
                   mode: str) -> torch.Tensor:
    """The stacked weight gradient ``[E, out, in]``: each group's ``grad^T a``; blockwise in
    fp32 (``add_blockwise_weight_product``)."""
    if mode not in BLOCKWISE:
        return torch._grouped_mm(grad.t(), a, offs=ends)
    total = a.new_zeros(ends.numel(), grad.shape[1], a.shape[1], dtype=torch.float32)
    add_blockwise_weight_product(total, grad, a, ends, mode == "blockwise_emulated")
    return total


def _product(a: torch.Tensor, operands: Sequence[torch.Tensor], ends: torch.Tensor,
             mode: str) -> torch.Tensor:
    """``GroupedLinear``'s product of ``a`` with one weight's operands (the forward's, or the
    transpose's for the input gradient)."""
    if mode == "plain":
        return torch._grouped_mm(a, operands[0].transpose(-2, -1), offs=ends)
    if mode in BLOCKWISE:
        return blockwise_product(a, operands[0], operands[1], ends, mode == "blockwise_emulated")
    return fp8_product(a, operands[0], operands[1], ends, mode == "fp8_emulated")


class GroupedLinear(torch.autograd.Function):
    """``a [rows, in]`` (rows sorted by expert, groups ending at ``ends``, int32) times each
    expert's ``weight [E, out, in]`` transposed -> ``[rows, out]`` (``a``'s dtype; FP8: bf16),
    from the operands of ``cast_weight(weight, mode, a.dtype)``. Rows past ``ends[-1]`` are
    unspecified in the output and get no gradient. The weight's gradient is one stacked tensor
    in the weight's dtype, returned, or with ``grad_into`` (the weight's ``.grad``) added to it
    in place, the weight then getting none from autograd (as Megatron's gradient-accumulation
    fusion: no cast to the weight's dtype, no second pass to accumulate), in FP8 where
    ``fp8_grad`` (``fp8_weight_gradient``; FP8 modes only)."""

    @staticmethod
    def forward(ctx, a, weight, ends, mode, grad_into, fp8_grad, *operands):
        ctx.mode, ctx.weight_dtype, ctx.accumulate = mode, weight.dtype, grad_into is not None
        ctx.fp8_grad = fp8_grad and mode in ("fp8", "fp8_emulated")
        ctx.save_for_backward(a, ends, grad_into, *operands)
        return _product(a, operands[:2], ends, mode)

    @staticmethod
    def backward(ctx, grad):
        a, ends, grad_into, *operands = ctx.saved_tensors
        grad = grad.contiguous()
        if ctx.mode == "plain":
            grad_a = torch._grouped_mm(grad, operands[0], offs=ends)
        else:
            grad_a = _product(grad, operands[2:], ends, ctx.mode)
        grad_weight = None
        if ctx.accumulate and ctx.fp8_grad:
            fp8_weight_gradient(grad_into, grad, a, ends)
        elif ctx.accumulate and ctx.mode in BLOCKWISE:  # on a GPU inside the kernel
            add_blockwise_weight_product(grad_into, grad, a, ends,
                                         ctx.mode == "blockwise_emulated")
        elif ctx.accumulate:
            # into the weight's gradient, in place: on a GPU inside each expert's GEMM
            accumulate_grouped_matmul(grad_into, grad.t(), a, ends)
        elif ctx.needs_input_grad[1]:  # else a frozen weight: no product
            grad_weight = weight_product(grad, a, ends, ctx.mode).to(ctx.weight_dtype)
        return grad_a, grad_weight, None, None, None, None, *([None] * len(operands))


def grouped_linear(a: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, mode: str,
                   given: tuple[Sequence[torch.Tensor], torch.Tensor | None] | None = None,
                   fp8_grad: bool = False) -> torch.Tensor:
    """``GroupedLinear`` with the given operands and the gradient to add into (None: returned)
    where given, else casting ``weight`` and returning its gradient; ``fp8_grad``: the
    gradient added into in FP8."""
    operands, grad_into = given if given is not None else (cast_weight(weight, mode, a.dtype),
                                                           None)
    return GroupedLinear.apply(a, weight, ends, mode, grad_into, fp8_grad, *operands)


def pad_groups(x: torch.Tensor, counts: torch.Tensor,
               align: int = ALIGN) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of ``x`` grouped by expert (``counts[e]`` rows for expert e, any rows past
    ``counts.sum()`` last) -> (``padded``, ``ends``, ``dest``): ``padded[dest[i]] = x[i]``, with
    each group starting at a multiple of ``align`` and zeros between, ``ends`` the int32 end
    offset of each padded group. Rows past ``counts.sum()`` are placed after the last group,
    as zeros. ``padded`` has ``rows + E * (align - 1)`` rows rounded up to a multiple of
    ``align``, whatever the counts (the transposed operand of the weight gradient needs row
    strides of a multiple of 16 bytes)."""
    rows, n_groups = x.shape[0], counts.numel()
    padded_counts = (counts + align - 1) // align * align
    ends, padded_ends = torch.cumsum(counts, 0), torch.cumsum(padded_counts, 0)
    # starts of the groups and of the rows past the end (an extra group)
    starts = torch.cat([ends - counts, ends[-1:]])
    padded_starts = torch.cat([padded_ends - padded_counts, padded_ends[-1:]])
    row = torch.arange(rows, device=x.device)
    group = torch.searchsorted(ends, row, right=True)
    dest = row - starts[group] + padded_starts[group]
    valid = (group < n_groups).unsqueeze(1)
    size = -(-(rows + n_groups * (align - 1)) // align) * align
    padded = x.new_zeros(size, x.shape[1]).index_copy(0, dest, torch.where(valid, x, 0))
    return padded, padded_ends.to(torch.int32), dest


def unpad_groups(out: torch.Tensor, dest: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The rows ``pad_groups`` moved, back in their order: zero for rows past ``counts.sum()``
    (nothing is defined there: the grouped GEMMs write only their groups)."""
    valid = (torch.arange(dest.numel(), device=out.device) < counts.sum()).unsqueeze(1)
    return torch.where(valid, out[dest], 0)
