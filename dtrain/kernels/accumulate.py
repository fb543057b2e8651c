"""``total += a @ b`` into an fp32 ``total`` in place, with ``a`` and ``b`` in the compute dtype:
on a GPU one GEMM that accumulates into ``total`` (cuBLAS with beta = 1: the product is summed in
fp32 in the GEMM's epilogue, never rounded to bf16, and no second pass reads it back), as
Megatron-LM's gradient-accumulation fusion writes weight gradients into its fp32 main gradients;
elsewhere the product, then an add. ``gemm_accumulates(device)`` says whether the first works
on a device (checked once, against an exact sum); where it does not, the second runs, after one
warning. With ``tune``, the GEMM is cuBLASLt's, with the fastest of its algorithms for the
shapes (``dtrain.kernels.cublaslt_binding``). The FP8 GEMM of the same kind is
``dtrain.kernels.cublaslt``.

``accumulate_grouped_matmul`` does the same for the MoE experts' stacked weight gradients,
``total[e] += a[:, rows of e] @ b[rows of e]``: on a GPU, for experts whose weight is large
(``LOOPED_VALUES``), one accumulating GEMM per expert, with the groups' ends read on the host
(once per MoE layer and micro-batch, shared by its three weights: ``host_ends``; from a copy
started in the forward, ``stage_ends``, so the read waits for nothing queued after it);
elsewhere one grouped GEMM (``torch._grouped_mm``, bf16 out), then an add.
"""

from __future__ import annotations

import functools
import itertools

import torch
from torch.utils.weak import WeakIdKeyDictionary

from dtrain.kernels.cublaslt_binding import FAILURES, matmul_into, takes
from dtrain.log import logger

# An expert's weight of at least this many values gets its own accumulating GEMM. The add that
# the loop saves passes over 10 bytes a value (the bf16 product read, the fp32 gradient read and
# written): 17 us at the H200's 4.8 TB/s for 2^23 values, more than a GEMM's launch (5-10 us)
# costs. Mixtral 8x7B's experts (14,336 x 4,096) are 7 times this; DeepSeek-V3's (1,408 x
# 2,048 in 64 experts), whose GEMMs would be launch-bound, are a third of it.
LOOPED_VALUES = 1 << 23


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
def accumulate_matmul(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      tune: bool = False) -> None:
    """``total += a @ b`` in place: ``a`` and ``b`` in the compute dtype, ``total`` a weight's
    fp32 gradient. On a GPU one GEMM that accumulates into ``total`` (cuBLAS's beta = 1: the
    product is summed in fp32, never rounded to bf16, and no second pass reads it back: Megatron's
    gradient-accumulation fusion); elsewhere the product, then an add. The dtypes are the
    operands' own, whatever autocast is on. ``tune``: on a GPU, cuBLASLt's fastest algorithm
    for these shapes, timed at their first call (``dtrain.kernels.cublaslt_binding``), for
    products whose shapes repeat; operands it does not take (``takes``) run the GEMM above, and
    so does a call where cuBLASLt fails, after a warning."""
    if total.is_cuda and tune and total.is_contiguous() and takes(a) and takes(b):
        try:
            matmul_into(total, a, b, tune=True)
            return
        except FAILURES as error:
            warn_untuned(str(error).splitlines()[0])
    if total.is_cuda and gemm_accumulates(total.device):
        with torch.autocast("cuda", enabled=False):
            torch.addmm(total, a, b, out_dtype=total.dtype, out=total)
    else:
        total.add_(a @ b)


@accumulate_matmul.register_fake
def _(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor, tune: bool = False) -> None:
    return None


@functools.cache
def warn_untuned(reason: str) -> None:
    """Logs that a tuned accumulating GEMM runs as torch's ``addmm`` instead, and why: once
    per distinct ``reason``."""
    logger.warning("the tuned accumulating GEMM (cuBLASLt) failed (%s): torch's addmm runs it, "
                   "with cuBLAS's own choice of algorithm", reason)


# Each groups' ends read on the host, by tensor (weakly: an entry goes with its tensor), with the
# tensor's version when read: the three weights of an MoE layer share one ends tensor, and so
# one read (one wait for the device) instead of three.
_host_ends = WeakIdKeyDictionary()
# The copies ``stage_ends`` started: tensor -> (its version, the pinned host copy, the event
# recorded after the copy).
_staged = WeakIdKeyDictionary()


@torch.library.custom_op("dtrain::stage_ends", mutates_args=())
def stage_ends(ends: torch.Tensor) -> torch.Tensor:
    """A copy of the groups' ``ends`` whose values the host will read later (``host_ends``): on
    a GPU their copy to pinned host memory is queued now, where they are computed. ``ends.tolist()``
    in the backward would wait for everything queued before it, the whole forward and backward
    so far, and leave the device idle while the host launches the next kernels; the staged copy
    waits only for an event recorded in the forward, long past by then."""
    staged = ends.clone()
    if staged.is_cuda:
        host = torch.empty(staged.shape, dtype=staged.dtype, pin_memory=True)
        host.copy_(staged, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        _staged[staged] = (staged._version, host, done)
    return staged


@stage_ends.register_fake
def _(ends: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(ends)


def host_ends(ends: torch.Tensor) -> list[int]:
    """``ends`` as a list, read once per tensor (again after an in-place change): from the copy
    ``stage_ends`` started if it made this tensor, else from the device."""
    seen = _host_ends.get(ends)
    if seen is None or seen[0] != ends._version:
        staged = _staged.pop(ends, None)
        if staged is not None and staged[0] == ends._version:
            staged[2].synchronize()
            values = staged[1].tolist()
        else:
            values = ends.tolist()
        seen = _host_ends[ends] = (ends._version, values)
    return seen[1]


def groups(ends: torch.Tensor) -> list[tuple[int, slice]]:
    """Each non-empty group of rows ending at ``ends`` (read on the host: ``host_ends``) and
    its rows."""
    bounds = [0, *host_ends(ends)]
    return [(e, slice(start, end)) for e, (start, end) in enumerate(itertools.pairwise(bounds))
            if end > start]


def accumulate_each_group(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                          ends: torch.Tensor) -> None:
    """``total[e] += a[:, rows of e] @ b[rows of e]`` for each group e of the rows ending at
    ``ends``: one ``accumulate_matmul`` per non-empty group."""
    for e, rows in groups(ends):
        accumulate_matmul(total[e], a[:, rows], b[rows])


@torch.library.custom_op("dtrain::accumulate_grouped_matmul", mutates_args=("total",))
def accumulate_grouped_matmul(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                              ends: torch.Tensor) -> None:
    """``total[e] += a[:, rows of e] @ b[rows of e]`` in place for each group e of the rows
    (columns of ``a [m, rows]``, rows of ``b [rows, n]``) ending at ``ends`` (int32, on the
    operands' device): ``total [E, m, n]``, the experts' stacked fp32 gradient; ``a`` and ``b``
    in the compute dtype (``a`` is the output gradient transposed, a view). Rows past
    ``ends[-1]`` are not read.

    On a GPU whose GEMM accumulates (``gemm_accumulates``) and experts of at least
    ``LOOPED_VALUES`` values: one GEMM per expert adding into ``total[e]`` (its product summed in
    fp32, never rounded to bf16: Transformer Engine's grouped linear does the same for Megatron);
    the ends are read on the host first, a sync that waits for work queued long before (they
    were computed in the forward). Elsewhere the grouped GEMM's bf16 product, then one add."""
    if total.is_cuda and total[0].numel() >= LOOPED_VALUES and gemm_accumulates(total.device):
        accumulate_each_group(total, a, b, ends)
    else:
        total.add_(torch._grouped_mm(a, b, offs=ends))


@accumulate_grouped_matmul.register_fake
def _(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> None:
    return None
