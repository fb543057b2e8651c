"""FP8 for the MoE experts' grouped GEMMs (``fp8.experts``, torchao backend).

Each of the experts' three grouped GEMMs runs through torchao's FP8 grouped matmul
(``_to_fp8_rowwise_then_scaled_grouped_mm``): the tokens and gradients are cast to float8 with
one power-of-two scale per row, the stacked weights with one per expert and output channel,
and the forward, input-gradient and weight-gradient products all run in FP8
(``torch._scaled_grouped_mm`` on sm90+). Those kernels take groups of whole multiples of 16
rows, so the sorted tokens are spread, on the device, into a buffer where each expert's group
starts on a multiple of 16 (``pad_groups``): its size is fixed by the number of rows, never by
the counts, so nothing is read on the host. ``fp8.emulate`` runs the same scaling in high
precision (``EmulatedFP8GroupedMM``), on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ALIGN = 16  # rows per group: a multiple of this, for the FP8 grouped GEMM
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max

GroupedMM = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def pad_groups(x: torch.Tensor, counts: torch.Tensor,
               align: int = ALIGN) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of ``x`` grouped by expert (``counts[e]`` rows for expert e, any rows past
    ``counts.sum()`` last) -> (``padded``, ``ends``, ``dest``): ``padded[dest[i]] = x[i]``, with
    each group starting at a multiple of ``align`` and zeros between, ``ends`` the int32 end
    offset of each padded group. Rows past ``counts.sum()`` are placed after the last group,
    as zeros. ``padded`` has ``rows + E * (align - 1)`` rows rounded up to a multiple of
``align``, whatever the counts (the transposed FP8 operand of the weight gradient needs row
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
    size = -(-(rows + n_groups * (align - 1)) // align) * align  # row strides of 16 bytes
    padded = x.new_zeros(size, x.shape[1]).index_copy(
        0, dest, torch.where(valid, x, 0))
    return padded, padded_ends.to(torch.int32), dest


def unpad_groups(out: torch.Tensor, dest: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The rows ``pad_groups`` moved, back in their order: zero for rows past ``counts.sum()``
    (nothing is defined there: the grouped GEMMs write only their groups)."""
    valid = (torch.arange(dest.numel(), device=out.device) < counts.sum()).unsqueeze(1)
    return torch.where(valid, out[dest], 0)


def fp8_swiglu(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
               w3: torch.Tensor, mm: GroupedMM) -> torch.Tensor:
    """``grouped_swiglu`` with the FP8 grouped matmul ``mm(rows, w_t, ends)`` on groups padded to
    multiples of 16 rows. ``x`` bf16; the weights as stored (fp32 or bf16: ``mm`` casts them to
    FP8 itself). Rows past ``counts.sum()`` are zero in the output."""
    padded, ends, dest = pad_groups(x, counts)
    h = F.silu(mm(padded, w1.transpose(-2, -1), ends)) * mm(padded, w3.transpose(-2, -1), ends)
    return unpad_groups(mm(h, w2.transpose(-2, -1), ends), dest, counts)


def torchao_grouped_mm(a: torch.Tensor, b_t: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """torchao's differentiable FP8 rowwise grouped matmul, on groups already padded."""
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    return _to_fp8_rowwise_then_scaled_grouped_mm(
        a, b_t, ends, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False)


def quantize(t: torch.Tensor, dim: int | tuple[int, ...]) -> torch.Tensor:
    """``t`` through float8 e4m3 and back, with one power-of-two scale per slice reduced over
    ``dim`` (torchao's rowwise scaling: ``2^floor(log2(448 / amax))``), in fp32."""
    amax = t.detach().abs().float().amax(dim=dim, keepdim=True)
    return _scaled_round_trip(t, amax)


def _scaled_round_trip(t: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax.clamp(min=1e-12))))
    fp8 = (t.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return fp8.float() / scale


def quantize_per_group(t: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``t`` (rows, cols) through float8 with one scale per group of rows and column (the
    weight-gradient product's scaling: its sum runs over each group's rows)."""
    group = torch.searchsorted(ends, torch.arange(t.shape[0], device=t.device), right=True)
    amax = t.new_zeros(ends.numel() + 1, t.shape[1], dtype=torch.float32).index_reduce_(
        0, group, t.detach().abs().float(), "amax")
    return _scaled_round_trip(t, amax[group])


class EmulatedFP8GroupedMM(torch.autograd.Function):
    """torchao's FP8 rowwise grouped matmul with the products computed in fp32 on the rounded
    values: the forward on rowwise ``a`` and per-output-channel ``b_t``, the input gradient on
    rowwise ``grad`` and per-input-channel ``b_t``, the weight gradient on ``grad`` and ``a``
    scaled per group and column. For machines without FP8 units (``fp8.emulate``)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b_t: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        assert not (ends % ALIGN).any(), "FP8 grouped GEMM groups must be multiples of 16 rows"
        ctx.save_for_backward(a, b_t, ends)
        out = torch._grouped_mm(quantize(a, -1), quantize(b_t, 1), offs=ends)
        return out.to(a.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b_t, ends = ctx.saved_tensors
        grad_a = torch._grouped_mm(quantize(grad, -1), quantize(b_t, 2).transpose(-2, -1),
                                   offs=ends)
        grad_b_t = torch._grouped_mm(quantize_per_group(a, ends).t(),
                                     quantize_per_group(grad, ends), offs=ends)
        return grad_a.to(a.dtype), grad_b_t.to(b_t.dtype), None


def emulated_grouped_mm(a: torch.Tensor, b_t: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    return EmulatedFP8GroupedMM.apply(a, b_t, ends)
