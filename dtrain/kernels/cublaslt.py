"""An FP8 GEMM that accumulates into its fp32 output: ``total += a @ b`` (cuBLASLt, beta = 1).

``torch._scaled_mm`` writes a new output (cuBLASLt with beta = 0), so a weight gradient summed
over micro-batches costs its product written in bf16 and a second pass that reads it back with
the fp32 gradient and writes the sum (10 bytes per parameter a micro-batch). cuBLASLt itself
takes ``C`` (here the fp32 gradient) and ``beta``, and adds in the GEMM's epilogue, in fp32:
Transformer Engine's weight-gradient GEMM does this for Megatron's fp32 main gradients. torch
ships cuBLASLt and has loaded it; this module calls it through ``ctypes`` (no compiler, no
extension to build): one handle per device, the descriptors and the heuristic's algorithm cached
per shape, torch's current stream, a workspace from torch's allocator.

The operands are those of ``torch._scaled_mm``: ``a`` row-major ``[M, K]``, ``b`` column-major
``[K, N]``, FP8 (e4m3 or e5m2, not both e5m2), each with the scalar that turns its FP8 values
back into real ones (the inverse of torchao's scale). ``total`` is a row-major fp32 ``[M, N]``.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading

import torch

from dtrain.log import logger

# cudaDataType_t, cublasComputeType_t, cublasOperation_t (library_types.h, cublas_api.h).
_DATA_TYPE = {torch.float32: 0, torch.float8_e4m3fn: 28, torch.float8_e5m2: 29}
_COMPUTE_32F, _OP_N, _OP_T = 68, 0, 1
# cublasLtMatmulDescAttributes_t, cublasLtMatmulPreferenceAttributes_t (cublasLt.h, CUDA 12
# and 13 alike).
_DESC_TRANSA, _DESC_TRANSB, _DESC_A_SCALE, _DESC_B_SCALE, _DESC_FAST_ACCUM = 3, 4, 17, 18, 25
_PREF_MAX_WORKSPACE = 1
_WORKSPACE_BYTES = 32 * 1024 * 1024  # as torch gives cuBLASLt on Hopper


class CublasLtError(RuntimeError):
    pass


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _library_path() -> str:
    """The cuBLASLt torch loaded (read from this process's memory map), so that its version is
    the one torch's own GEMMs use."""
    torch.cuda.init()
    with open(f"/proc/{os.getpid()}/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "libcublasLt.so" in os.path.basename(path):
                return path
    raise CublasLtError("torch has not loaded cuBLASLt (libcublasLt.so), which the FP8 "
                        "accumulating GEMM calls")


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(_library_path())
    vp, u64, i64 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64
    signatures = {
        "cublasLtCreate": [ctypes.POINTER(vp)],
        "cublasLtMatmulDescCreate": [ctypes.POINTER(vp), ctypes.c_int, ctypes.c_int],
        "cublasLtMatmulDescSetAttribute": [vp, ctypes.c_int, vp, ctypes.c_size_t],
        "cublasLtMatrixLayoutCreate": [ctypes.POINTER(vp), ctypes.c_int, u64, u64, i64],
        "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)],
        "cublasLtMatmulPreferenceSetAttribute": [vp, ctypes.c_int, vp, ctypes.c_size_t],
        "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, ctypes.c_int,
                                           ctypes.POINTER(_Heuristic),
                                           ctypes.POINTER(ctypes.c_int)],
        "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp,
                           ctypes.POINTER(_Algo), vp, ctypes.c_size_t, vp],
    }
    for name, argtypes in signatures.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, ctypes.c_int
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasLtError(f"{what} returned cuBLAS status {status}")


def _set(setter, obj, attribute: int, value) -> None:
    _check(setter(obj, attribute, ctypes.byref(value), ctypes.sizeof(value)),
           setter.__name__)


class _Plan:
    """The descriptors and algorithm of one problem (shapes, dtypes, fast accumulation)."""

    def __init__(self, handle, m: int, n: int, k: int, a_dtype, b_dtype, fast_accum: bool):
        lib = _lib()
        vp = ctypes.c_void_p
        self.desc = vp()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F,
                                            _DATA_TYPE[torch.float32]), "MatmulDescCreate")
        set_desc = lib.cublasLtMatmulDescSetAttribute
        _set(set_desc, self.desc, _DESC_TRANSA, ctypes.c_int32(_OP_T))
        _set(set_desc, self.desc, _DESC_TRANSB, ctypes.c_int32(_OP_N))
        _set(set_desc, self.desc, _DESC_FAST_ACCUM, ctypes.c_int8(int(fast_accum)))
        # Column-major, as cuBLAS sees it: total^T [N, M] = b^T [N, K] @ a^T [K, M]; b's
        # storage is a K x N column-major matrix read transposed, a's a K x M one.
        self.layouts = []
        for dtype, rows, cols, ld in ((b_dtype, k, n, k), (a_dtype, k, m, k),
                                      (torch.float32, n, m, n)):
            layout = vp()
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), _DATA_TYPE[dtype],
                                                  rows, cols, ld), "MatrixLayoutCreate")
            self.layouts.append(layout)
        preference = vp()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(preference)),
               "MatmulPreferenceCreate")
        _set(lib.cublasLtMatmulPreferenceSetAttribute, preference, _PREF_MAX_WORKSPACE,
             ctypes.c_uint64(_WORKSPACE_BYTES))
        result, found = _Heuristic(), ctypes.c_int(0)
        b_layout, a_layout, c_layout = self.layouts
        _check(lib.cublasLtMatmulAlgoGetHeuristic(
            handle, self.desc, b_layout, a_layout, c_layout, c_layout, preference, 1,
            ctypes.byref(result), ctypes.byref(found)), "MatmulAlgoGetHeuristic")
        if found.value < 1:
            raise CublasLtError(f"cuBLASLt has no FP8 GEMM for [{m}, {k}] @ [{k}, {n}] "
                                f"({a_dtype} x {b_dtype}) into fp32 with beta 1")
        self.algo = result.algo


class _Device:
    def __init__(self, device: torch.device):
        self.handle = ctypes.c_void_p()
        _check(_lib().cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.plans: dict[tuple, _Plan] = {}
        self.workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.one = ctypes.c_float(1.0)


_devices: dict[int, _Device] = {}
_lock = threading.Lock()


def _device(device: torch.device) -> _Device:
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        if index not in _devices:
            with torch.cuda.device(index):
                _devices[index] = _Device(torch.device("cuda", index))
        return _devices[index]


def _check_operands(total, a, b, a_inverse_scale, b_inverse_scale) -> tuple[int, int, int]:
    m, k = a.shape
    k2, n = b.shape
    problems = []
    if total.dtype != torch.float32 or tuple(total.shape) != (m, n) or not total.is_contiguous():
        problems.append(f"total must be a contiguous fp32 [{m}, {n}], got {total.dtype} "
                        f"{tuple(total.shape)}")
    if k2 != k:
        problems.append(f"a is [{m}, {k}] but b is [{k2}, {n}]")
    if a.stride() != (k, 1) or b.stride() != (1, k):
        problems.append(f"a must be row-major and b column-major (strides {a.stride()}, "
                        f"{b.stride()})")
    if a.dtype not in _DATA_TYPE or b.dtype not in _DATA_TYPE or a.element_size() != 1 \
            or b.element_size() != 1 or a.dtype == b.dtype == torch.float8_e5m2:
        problems.append(f"a and b must be FP8, not both e5m2 (got {a.dtype}, {b.dtype})")
    if any(s.numel() != 1 or s.dtype != torch.float32 for s in (a_inverse_scale,
                                                                 b_inverse_scale)):
        problems.append("the scales must be fp32 scalars")
    if problems:
        raise ValueError("accumulate_scaled_mm: " + "; ".join(problems))
    return m, n, k


def _cublaslt_accumulate(total, a, b, a_inverse_scale, b_inverse_scale, fast_accum) -> bool:
    """The GEMM with beta 1; False where cuBLASLt has none for this problem (said once)."""
    m, n, k = _check_operands(total, a, b, a_inverse_scale, b_inverse_scale)
    state = _device(total.device)
    key = (m, n, k, a.dtype, b.dtype, fast_accum)
    if key not in state.plans:
        try:
            state.plans[key] = _Plan(state.handle, m, n, k, a.dtype, b.dtype, fast_accum)
        except CublasLtError as error:
            logger.warning("%s: this product is written by torch._scaled_mm and added in a "
                           "second pass", error)
            state.plans[key] = None
    plan = state.plans[key]
    if plan is None:
        return False
    lib = _lib()
    # The scales' addresses change from call to call: set on the cached descriptor each time
    # (read when the GEMM is enqueued).
    _set(lib.cublasLtMatmulDescSetAttribute, plan.desc, _DESC_A_SCALE,
         ctypes.c_void_p(b_inverse_scale.data_ptr()))
    _set(lib.cublasLtMatmulDescSetAttribute, plan.desc, _DESC_B_SCALE,
         ctypes.c_void_p(a_inverse_scale.data_ptr()))
    b_layout, a_layout, c_layout = plan.layouts
    one = ctypes.byref(state.one)
    _check(lib.cublasLtMatmul(
        state.handle, plan.desc, one, b.data_ptr(), b_layout, a.data_ptr(), a_layout, one,
        total.data_ptr(), c_layout, total.data_ptr(), c_layout, ctypes.byref(plan.algo),
        state.workspace.data_ptr(), _WORKSPACE_BYTES,
        torch.cuda.current_stream(total.device).cuda_stream), "cublasLtMatmul")
    return True


@functools.cache
def _works(device: torch.device) -> bool:
    """Whether the cuBLASLt GEMM runs on ``device`` and gives the exact sum of a small product
    of small integers (checked once per device, with no random numbers drawn: it runs inside
    the first backward). Where it does not, a warning says so, and ``_scaled_mm``'s product is
    added in a second pass."""
    a = ((torch.arange(64 * 32, device=device) % 7 - 3).reshape(64, 32)
         .float().to(torch.float8_e5m2))
    b = ((torch.arange(48 * 32, device=device) % 5 - 2).reshape(48, 32)
         .float().to(torch.float8_e4m3fn).t())
    scale = torch.ones((), device=device)
    total = torch.ones(64, 48, device=device)
    expected = 1 + a.double().cpu() @ b.double().cpu()  # small integers: exact in fp32
    try:
        works = (_cublaslt_accumulate(total, a, b, scale, scale, False)
                 and torch.equal(total.double().cpu(), expected))
        why = "its result differs from the exact sum"
    except (CublasLtError, OSError, AttributeError) as error:
        works, why = False, str(error).splitlines()[0]
    if not works:
        logger.warning("the FP8 GEMM that adds into the weight gradient (cuBLASLt, beta 1) does "
                       "not work on %s (%s): FP8 weight gradients are added in a second pass",
                       device, why)
    return works


@torch.library.custom_op("dtrain::accumulate_scaled_mm", mutates_args=("total",))
def accumulate_scaled_mm(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         a_inverse_scale: torch.Tensor, b_inverse_scale: torch.Tensor,
                         fast_accum: bool = False) -> None:
    """``total += (a * a_inverse_scale) @ (b * b_inverse_scale)`` in place: on the GPU one
    cuBLASLt GEMM, the sum in fp32 in its epilogue (``fast_accum``: Hopper's FP8 fast
    accumulation, ``_scaled_mm``'s ``use_fast_accum``); elsewhere the same sum computed in fp32
    (a reference: FP8 GEMMs are the GPU's)."""
    if total.is_cuda:
        if not (_works(total.device) and _cublaslt_accumulate(
                total, a, b, a_inverse_scale, b_inverse_scale, fast_accum)):
            total.add_(torch._scaled_mm(a, b, a_inverse_scale, b_inverse_scale,
                                        out_dtype=torch.float32, use_fast_accum=fast_accum))
    else:
        _check_operands(total, a, b, a_inverse_scale, b_inverse_scale)
        total.add_((a.float() * a_inverse_scale) @ (b.float() * b_inverse_scale))


@accumulate_scaled_mm.register_fake
def _(total, a, b, a_inverse_scale, b_inverse_scale, fast_accum=False) -> None:
    return None
