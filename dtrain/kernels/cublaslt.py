"""An FP8 GEMM that accumulates into its fp32 output: ``total += a @ b`` (cuBLASLt, beta = 1).

``torch._scaled_mm`` writes a new output (cuBLASLt with beta = 0), so a weight gradient summed
over micro-batches costs its product written in bf16 and a second pass that reads it back with
the fp32 gradient and writes the sum (10 bytes per parameter a micro-batch). cuBLASLt itself
takes ``C`` (here the fp32 gradient) and ``beta``, and adds in the GEMM's epilogue, in fp32:
Transformer Engine's weight-gradient GEMM does this for Megatron's fp32 main gradients. The call
into cuBLASLt is ``dtrain.kernels.cublaslt_binding.matmul_into``.

The operands are those of ``torch._scaled_mm``: ``a`` row-major ``[M, K]``, ``b`` column-major
``[K, N]`` (either may be a slice of a wider matrix's columns: its leading dimension is then the
wider one's), FP8 (e4m3 or e5m2, not both e5m2), each with the fp32 scalar that turns its FP8
values back into real ones (the inverse of torchao's scale). ``total`` is a row-major fp32
``[M, N]``, all on one device. Operands that break this contract raise ``ValueError``.

cuBLASLt's FP8 kernels need 16-byte aligned addresses and leading dimensions that are multiples
of 16 bytes (K a multiple of 16, N of 4); N must be a multiple of 16 too, as ``_scaled_mm``
requires of the same kernels. Operands that miss this, a device where the GEMM does not work
(``works``), or a cuBLASLt error on a call: the product is computed by torch (as ``_scaled_mm``
computes it) and added in a second pass, after one warning per reason
(``warn_fallback``); a backward never fails here. ``accumulate_grouped_scaled_mm`` loops it over
the MoE experts' groups of rows, for their weight gradients.
"""

from __future__ import annotations

import functools
import threading

import torch

from dtrain.kernels.accumulate import groups
from dtrain.kernels.cublaslt_binding import ALIGNMENT, FAILURES, matmul_into
from dtrain.log import logger

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_lock = threading.Lock()  # the warnings said


@functools.cache
def works(device: torch.device) -> bool:
    """Whether cuBLASLt's FP8 GEMM that adds into its output runs on ``device`` (a CUDA device)
    and gives the exact sum of a small product of small integers. Checked once per device
    (``works.cache_clear()`` forgets the answers), with no random numbers drawn (it runs inside
    the first backward). Where it does not, a warning says why, and ``accumulate_scaled_mm``
    adds torch's product in a second pass there. False on other devices."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    a = ((torch.arange(64 * 32, device=device) % 7 - 3).reshape(64, 32)
         .float().to(torch.float8_e5m2))
    b = ((torch.arange(48 * 32, device=device) % 5 - 2).reshape(48, 32)
         .float().to(torch.float8_e4m3fn).t())
    scale = torch.ones((), device=device)
    total = torch.ones(64, 48, device=device)
    expected = 1 + a.double().cpu() @ b.double().cpu()  # small integers: exact in fp32
    try:
        matmul_into(total, a, b, (scale, scale))
        exact = torch.equal(total.double().cpu(), expected)
        why = "its result differs from the exact sum"
    except FAILURES as error:
        exact, why = False, str(error).splitlines()[0]
    if not exact:
        logger.warning("the FP8 GEMM that adds into the weight gradient (cuBLASLt, beta 1) does "
                       "not work on %s (%s): FP8 weight gradients are added in a second pass",
                       device, why)
    return exact


@functools.cache
def warn_fallback(reason: str) -> None:
    """Logs that an FP8 product is computed by torch and added in a second pass, and why: once
    per distinct ``reason`` (``warn_fallback.cache_clear()`` forgets those said)."""
    logger.warning("the FP8 GEMM that adds into its fp32 output (cuBLASLt, beta 1) does not "
                   "take this product (%s): torch computes it, and it is added in a second pass",
                   reason)


def _strides_are(x: torch.Tensor, expected: tuple[int, int]) -> bool:
    """Whether ``x`` is laid out with ``expected`` strides (those of its dimensions of one or no
    element, and of an empty ``x``, are any)."""
    return x.numel() == 0 or all(
        size <= 1 or stride == want
        for size, stride, want in zip(x.shape, x.stride(), expected, strict=True))


def _leading_is(x: torch.Tensor, unit: int, k: int) -> bool:
    """Whether ``x``'s dimension ``unit`` has stride 1 and the other a stride of at least
    ``k`` (a leading dimension: a slice of a wider matrix's columns is one)."""
    other = 1 - unit
    return x.numel() == 0 or ((x.shape[unit] <= 1 or x.stride(unit) == 1)
                              and (x.shape[other] <= 1 or x.stride(other) >= k))


def _check_operands(total, a, b, a_inverse_scale, b_inverse_scale) -> None:
    """``ValueError`` naming each way the operands break the contract (the module's docstring):
    no path computes those."""
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"accumulate_scaled_mm: a and b must be matrices, got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    (m, k), (k2, n) = a.shape, b.shape
    problems = []
    if total.dtype != torch.float32 or tuple(total.shape) != (m, n) \
            or not _strides_are(total, (n, 1)):
        problems.append(f"total must be a contiguous fp32 [{m}, {n}], got {total.dtype} "
                        f"{tuple(total.shape)}")
    if k2 != k:
        problems.append(f"a is [{m}, {k}] but b is [{k2}, {n}]")
    if not (_leading_is(a, 1, k) and _leading_is(b, 0, k2)):
        problems.append(f"a must be row-major and b column-major (strides {a.stride()}, "
                        f"{b.stride()})")
    if a.dtype not in _FP8 or b.dtype not in _FP8 or a.dtype == b.dtype == torch.float8_e5m2:
        problems.append(f"a and b must be FP8, not both e5m2 (got {a.dtype}, {b.dtype})")
    if any(s.numel() != 1 or s.dtype != torch.float32 for s in (a_inverse_scale,
                                                                 b_inverse_scale)):
        problems.append("the scales must be fp32 scalars")
    devices = {x.device for x in (total, a, b, a_inverse_scale, b_inverse_scale)}
    if len(devices) > 1:
        problems.append(f"all must be on one device, got {sorted(map(str, devices))}")
    if problems:
        raise ValueError("accumulate_scaled_mm: " + "; ".join(problems))


def _unfit(total, a, b) -> str | None:
    """Why cuBLASLt's FP8 GEMM cannot take these operands (valid ones), or None."""
    for name, x in (("total", total), ("a", a), ("b", b)):
        if x.data_ptr() % ALIGNMENT:
            return f"{name}'s address is not a multiple of {ALIGNMENT} bytes"
        if max(x.stride()) * x.element_size() % ALIGNMENT:
            return f"{name}'s leading dimension is not a multiple of {ALIGNMENT} bytes"
    if b.shape[1] % 16:  # as torch._scaled_mm requires of the same cuBLASLt FP8 GEMMs
        return "N is not a multiple of 16"
    return None


def _product(a, b, a_inverse_scale, b_inverse_scale, fast_accum: bool) -> torch.Tensor:
    """``a @ b`` scaled, in fp32, computed by torch: ``_scaled_mm`` where it takes the operands
    (an FP8 GPU, K and N multiples of 16; misaligned ones copied), else the product of the FP8
    values in fp32 (exact products, any TF32 included), scaled after, as ``_scaled_mm`` does."""
    k, n = b.shape
    if a.is_cuda and k % 16 == 0 and n % 16 == 0 \
            and torch.cuda.get_device_capability(a.device) >= (8, 9):
        a, b = (x if x.data_ptr() % ALIGNMENT == 0 else x.clone() for x in (a, b))
        return torch._scaled_mm(a, b, a_inverse_scale, b_inverse_scale,
                                out_dtype=torch.float32, use_fast_accum=fast_accum)
    with torch.autocast(a.device.type, enabled=False):  # a backward may run under autocast
        return (a.float() @ b.float()) * (a_inverse_scale * b_inverse_scale)


@torch.library.custom_op("dtrain::accumulate_scaled_mm", mutates_args=("total",))
def accumulate_scaled_mm(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         a_inverse_scale: torch.Tensor, b_inverse_scale: torch.Tensor,
                         fast_accum: bool = False, tune: bool = False) -> None:
    """``total += (a * a_inverse_scale) @ (b * b_inverse_scale)`` in place (operands: the
    module's docstring): on the GPU one cuBLASLt GEMM, the sum in fp32 in its epilogue
    (``fast_accum``: Hopper's FP8 fast accumulation, ``_scaled_mm``'s ``use_fast_accum``;
    ``tune``: the fastest of cuBLASLt's algorithms for these shapes, timed at their first call,
    for products whose shapes repeat: ``dtrain.kernels.cublaslt_binding``).
    Where cuBLASLt does not take the operands or fails, and on the CPU (a reference: FP8 GEMMs
    are the GPU's), torch's fp32 product is added after. Raises ``ValueError`` only for
    operands that break the contract."""
    _check_operands(total, a, b, a_inverse_scale, b_inverse_scale)
    if total.numel() == 0 or a.shape[1] == 0:
        return
    why = _unfit(total, a, b)
    if why is None and total.is_cuda and works(total.device):
        try:
            matmul_into(total, a, b, (a_inverse_scale, b_inverse_scale), fast_accum, tune)
            return
        except FAILURES as error:
            why = str(error).splitlines()[0]
    if why is not None:
        with _lock:  # once per reason, also when threads meet it together
            warn_fallback(why)
    total.add_(_product(a, b, a_inverse_scale, b_inverse_scale, fast_accum))


@accumulate_scaled_mm.register_fake
def _(total, a, b, a_inverse_scale, b_inverse_scale, fast_accum=False, tune=False) -> None:
    return None


@torch.library.custom_op("dtrain::accumulate_grouped_scaled_mm", mutates_args=("total",))
def accumulate_grouped_scaled_mm(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                                 a_inverse_scale: torch.Tensor, b_inverse_scale: torch.Tensor,
                                 ends: torch.Tensor) -> None:
    """``total[e] += (a[:, rows of e] * a_inverse_scale) @ (b[:, rows of e] *
    b_inverse_scale)^T`` in place for each group e of the rows ending at ``ends`` (int32, on the
    operands' device, each a multiple of 16): ``a [m, rows]`` and ``b [n, rows]`` row-major FP8
    (the output gradient and the input, transposed: the groups are slices of their columns),
    ``total [E, m, n]`` the experts' stacked fp32 gradient. One ``accumulate_scaled_mm`` per
    non-empty group, after reading the ends on the host (a sync that waits for work queued long
    before: they were computed in the forward). Rows past ``ends[-1]`` are not read."""
    for e, rows in groups(ends):
        accumulate_scaled_mm(total[e], a[:, rows], b[:, rows].t(), a_inverse_scale,
                             b_inverse_scale)


@accumulate_grouped_scaled_mm.register_fake
def _(total, a, b, a_inverse_scale, b_inverse_scale, ends) -> None:
    return None
