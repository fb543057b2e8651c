"""``total += a @ b`` into an fp32 ``total`` in place, with ``a`` and ``b`` in the compute dtype:
on a GPU one GEMM that accumulates into ``total`` (cuBLAS with beta = 1: the product is summed in
fp32 in the GEMM's epilogue, never rounded to bf16, and no second pass reads it back), as
Megatron-LM's gradient-accumulation fusion writes weight gradients into its fp32 main gradients;
elsewhere the product, then an add. ``gemm_accumulates(device)`` says whether the first works
on a device (checked once, against an exact sum); where it does not, the second runs, after one
warning. The FP8 GEMM of the same kind is ``dtrain.kernels.cublaslt``.
"""

from __future__ import annotations

import functools

import torch

from dtrain.log import logger


@functools.cache
def gemm_accumulates(device: torch.device) -> bool:
    """Whether this GPU's ``addmm`` takes bf16 operands into an fp32 output in place (cuBLAS
    with beta 1; ``out_dtype``, torch 2.9 and later): checked once per device against the exact
    sum of a small product of small integers, with autocast off (the backward runs inside the
    forward's autocast, which would compute the check in bf16) and no random numbers drawn (it
    runs inside the first backward). Where it does not work, a warning says so: the gradients
    are then added in a second pass."""
    a = (torch.arange(64 * 48, device=device) % 7 - 3).reshape(64, 48).to(torch.bfloat16)
    b = (torch.arange(48 * 32, device=device) % 5 - 2).reshape(48, 32).to(torch.bfloat16)
    expected = 1 + a.double().cpu() @ b.double().cpu()  # small integers: exact in fp32
    total = torch.ones(64, 32, device=device)
    try:
        with torch.autocast(device.type, enabled=False):
            torch.addmm(total, a, b, out_dtype=torch.float32, out=total)
        works = torch.equal(total.double().cpu(), expected)
    except (RuntimeError, TypeError) as error:
        works, why = False, str(error).splitlines()[0]
    else:
        why = "its result differs from the exact sum"
    if not works:
        logger.warning("the accumulating GEMM (torch.addmm(..., out_dtype=torch.float32, "
                       "out=grad)) does not work on %s (%s): the step weights' gradients are "
                       "added in a second pass", device, why)
    return works


@torch.library.custom_op("dtrain::accumulate_matmul", mutates_args=("total",))
def accumulate_matmul(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``total += a @ b`` in place: ``a`` and ``b`` in the compute dtype, ``total`` a weight's
    fp32 gradient. On a GPU one GEMM that accumulates into ``total`` (cuBLAS's beta = 1: the
    product is summed in fp32, never rounded to bf16, and no second pass reads it back: Megatron's
    gradient-accumulation fusion); elsewhere the product, then an add. The dtypes are the
    operands' own, whatever autocast is on."""
    if total.is_cuda and gemm_accumulates(total.device):
        with torch.autocast("cuda", enabled=False):
            torch.addmm(total, a, b, out_dtype=total.dtype, out=total)
    else:
        total.add_(a @ b)


@accumulate_matmul.register_fake
def _(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    return None
