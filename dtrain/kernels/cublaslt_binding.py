"""cuBLASLt, called through ``ctypes``: ``total = a @ b + total`` (beta = 1) into the output it is
given, the sum in fp32 in the GEMM's epilogue. torch ships cuBLASLt and has loaded it; this module
calls that library (no compiler, no extension to build): one handle per device, the descriptors
and algorithm of each problem cached (``matmul_into``), torch's current stream, one workspace per
(device, stream) from torch's allocator.

An algorithm is the heuristic's first for the problem, or, with ``tune``, the fastest of the
first ``TUNED_CANDIDATES`` it lists, timed once per problem (its shapes, strides, dtypes and
alignments) on the GPU. The heuristic's first is a guess from the shapes: on an H200 another of
its list was 4-10% faster for three of Llama 3 8B's weight-gradient GEMMs (docs/benchmarks.md,
lease I). The timing multiplies a zero copy of the smaller operand, so the output it adds into
is left as it was (``x + 0 = x``), and the real call follows.

The FP8 GEMM built on it is ``dtrain.kernels.cublaslt``; the bf16 one,
``dtrain.kernels.accumulate``. ``candidate_algorithms`` and ``workspace`` serve benchmarks and
tests.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Callable

import torch

# cudaDataType_t, cublasComputeType_t, cublasOperation_t (library_types.h, cublas_api.h).
_DATA_TYPE = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 14, torch.float8_e4m3fn: 28,
              torch.float8_e5m2: 29}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_COMPUTE_32F, _OP_N, _OP_T = 68, 0, 1
# cublasLtMatmulDescAttributes_t, cublasLtMatmulPreferenceAttributes_t (cublasLt.h, CUDA 12
# and 13 alike).
_DESC_TRANSA, _DESC_TRANSB, _DESC_A_SCALE, _DESC_B_SCALE, _DESC_FAST_ACCUM = 3, 4, 17, 18, 25
_PREF_MAX_WORKSPACE, _PREF_MIN_ALIGNMENT = 1, (5, 6, 7, 8)  # the latter for A, B, C and D
_WORKSPACE_BYTES = 32 * 1024 * 1024  # as torch gives cuBLASLt on Hopper
# FP8 GEMMs need addresses and leading dimensions in multiples of 16 bytes; the heuristic
# assumes 256-byte aligned addresses unless told each operand's own.
ALIGNMENT, _MOST_ALIGNMENT = 16, 256
_ONE = ctypes.c_float(1.0)
# With ``tune``: how many of the heuristic's algorithms are timed, and each how many times
# (after one call that warms it up). 16 held lease I's fastest (the fourth); 16 x 6 calls of an
# 8B weight gradient (0.3-1.5 ms) is 30-150 ms, once per problem.
TUNED_CANDIDATES, _TIMED_CALLS = 16, 5


class CublasLtError(RuntimeError):
    pass


FAILURES = (CublasLtError, OSError, AttributeError, ctypes.ArgumentError)
"""What a call into cuBLASLt may raise: its own errors, a library that does not load or lacks a
function, arguments ``ctypes`` does not take."""


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


@functools.cache
def library_path() -> str:
    """The path of the cuBLASLt torch loaded (read once from this process's memory map), so
    that its version is the one torch's own GEMMs use; ``CublasLtError`` where there is none."""
    torch.cuda.init()
    with open(f"/proc/{os.getpid()}/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "libcublasLt.so" in os.path.basename(path):
                return path
    raise CublasLtError("torch has not loaded cuBLASLt (libcublasLt.so), which the FP8 "
                        "accumulating GEMM calls")


@functools.cache
def _load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    vp, u64, i64 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64
    signatures = {
        "cublasLtCreate": [ctypes.POINTER(vp)],
        "cublasLtMatmulDescCreate": [ctypes.POINTER(vp), ctypes.c_int, ctypes.c_int],
        "cublasLtMatmulDescSetAttribute": [vp, ctypes.c_int, vp, ctypes.c_size_t],
        "cublasLtMatrixLayoutCreate": [ctypes.POINTER(vp), ctypes.c_int, u64, u64, i64],
        "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)],
        "cublasLtMatmulPreferenceSetAttribute": [vp, ctypes.c_int, vp, ctypes.c_size_t],
        "cublasLtMatmulPreferenceDestroy": [vp],
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


def _lib() -> ctypes.CDLL:
    return _load(library_path())


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasLtError(f"{what} returned cuBLAS status {status}")


def _set(setter, obj, attribute: int, value) -> None:
    _check(setter(obj, attribute, ctypes.byref(value), ctypes.sizeof(value)),
           setter.__name__)


def _alignment(x: torch.Tensor) -> int:
    """The largest power of two, up to 256, that ``x``'s address is a multiple of."""
    address = x.data_ptr()
    return _MOST_ALIGNMENT if address % _MOST_ALIGNMENT == 0 else address & -address


def takes(x: torch.Tensor) -> bool:
    """Whether ``x`` is a matrix cuBLASLt takes as it is: row-major or a transposed view of a
    row-major one (either possibly a slice of a wider matrix), its address a multiple of 16
    bytes."""
    return (x.dim() == 2 and (x.stride(1) == 1 or x.stride(0) == 1)
            and x.data_ptr() % ALIGNMENT == 0)


def _layout(x: torch.Tensor) -> tuple[int, int, int, int]:
    """cuBLAS's (operation, rows, columns, leading dimension) for ``x``, a row-major matrix or a
    transposed view of one, as the column-major ``x^T`` cuBLAS computes with."""
    rows, cols = x.shape
    if x.stride(1) == 1:  # row-major: its storage is x^T, column-major
        return _OP_N, cols, rows, x.stride(0)
    return _OP_T, rows, cols, x.stride(1)


class _Plan:
    """The descriptors of one problem (shapes, strides, dtypes, alignments, fast accumulation)
    and up to ``most`` of the heuristic's algorithms for it, best first."""

    def __init__(self, handle, total, a, b, fast_accum: bool, most: int = 1):
        lib, vp = _lib(), ctypes.c_void_p
        self.desc = vp()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F,
                                            _DATA_TYPE[torch.float32]), "MatmulDescCreate")
        set_desc = lib.cublasLtMatmulDescSetAttribute
        # Column-major, as cuBLAS sees it: total^T [N, M] = b^T [N, K] @ a^T [K, M].
        (op_b, *b_layout), (op_a, *a_layout) = _layout(b), _layout(a)
        _set(set_desc, self.desc, _DESC_TRANSA, ctypes.c_int32(op_b))
        _set(set_desc, self.desc, _DESC_TRANSB, ctypes.c_int32(op_a))
        if a.dtype in _FP8:
            _set(set_desc, self.desc, _DESC_FAST_ACCUM, ctypes.c_int8(int(fast_accum)))
        self.layouts = []
        for dtype, (rows, cols, ld) in ((b.dtype, b_layout), (a.dtype, a_layout),
                                        (total.dtype, _layout(total)[1:])):
            layout = vp()
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), _DATA_TYPE[dtype],
                                                  rows, cols, ld), "MatrixLayoutCreate")
            self.layouts.append(layout)
        self.algos = self._heuristic(lib, handle, (b, a, total, total), most)
        if not self.algos:
            raise CublasLtError(f"cuBLASLt has no GEMM for {a.dtype} {list(a.shape)} @ {b.dtype} "
                                f"{list(b.shape)} into {total.dtype}")
        # The descriptor holds the scales' addresses, set before each call and read when the
        # GEMM is enqueued: without a lock a thread could enqueue another thread's scales.
        self.lock = threading.Lock()

    def _heuristic(self, lib, handle, operands, most: int) -> list[_Algo]:
        preference = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(preference)),
               "MatmulPreferenceCreate")
        set_preference = lib.cublasLtMatmulPreferenceSetAttribute
        try:
            _set(set_preference, preference, _PREF_MAX_WORKSPACE,
                 ctypes.c_uint64(_WORKSPACE_BYTES))
            for attribute, operand in zip(_PREF_MIN_ALIGNMENT, operands, strict=True):
                _set(set_preference, preference, attribute,
                     ctypes.c_uint32(_alignment(operand)))
            results, found = (_Heuristic * most)(), ctypes.c_int(0)
            b_layout, a_layout, c_layout = self.layouts
            _check(lib.cublasLtMatmulAlgoGetHeuristic(
                handle, self.desc, b_layout, a_layout, c_layout, c_layout, preference, most,
                results, ctypes.byref(found)), "MatmulAlgoGetHeuristic")
        finally:
            lib.cublasLtMatmulPreferenceDestroy(preference)
        return [results[i].algo for i in range(found.value)]

    def run(self, algo: _Algo, state: _Device, total, a, b, beta: ctypes.c_float,
            stream: torch.cuda.Stream, scales: tuple | None = None) -> None:
        """Enqueues ``total = (a * scales[0]) @ (b * scales[1]) + beta * total`` on ``stream``
        with ``algo`` and the stream's workspace."""
        lib, workspace = _lib(), state.workspace(stream)
        set_desc = lib.cublasLtMatmulDescSetAttribute
        b_layout, a_layout, c_layout = self.layouts
        with self.lock:
            if scales is not None:  # cuBLAS's A is b, its B is a
                _set(set_desc, self.desc, _DESC_A_SCALE, ctypes.c_void_p(scales[1].data_ptr()))
                _set(set_desc, self.desc, _DESC_B_SCALE, ctypes.c_void_p(scales[0].data_ptr()))
            _check(lib.cublasLtMatmul(
                state.handle, self.desc, ctypes.byref(_ONE), b.data_ptr(), b_layout,
                a.data_ptr(), a_layout, ctypes.byref(beta), total.data_ptr(), c_layout,
                total.data_ptr(), c_layout, ctypes.byref(algo), workspace.data_ptr(),
                _WORKSPACE_BYTES, stream.cuda_stream), "cublasLtMatmul")


class _Device:
    """One device's cuBLASLt handle, its plans (one per problem) and workspaces (one per
    stream)."""

    def __init__(self, index: int):
        self.index = index
        self.handle = ctypes.c_void_p()
        with torch.cuda.device(index):
            _check(_lib().cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.plans: dict[tuple, _Plan | str] = {}  # a str: why cuBLASLt has no plan
        self.workspaces: dict[int, torch.Tensor] = {}

    def plan(self, total, a, b, fast_accum: bool, tune: bool, scales) -> _Plan:
        key = tuple((x.shape, x.stride(), x.dtype, _alignment(x)) for x in (total, a, b))
        key += (fast_accum, tune)
        with _lock:
            plan = self.plans.get(key)
        if plan is None:  # made outside the lock: the timing takes it (the workspace)
            try:
                plan = _Plan(self.handle, total, a, b, fast_accum,
                             TUNED_CANDIDATES if tune else 1)
                if len(plan.algos) > 1:
                    plan.algos = [_fastest(plan, self, total, a, b, scales)]
            except CublasLtError as error:
                plan = str(error)
            with _lock:  # the first made is kept where two threads made one
                plan = self.plans.setdefault(key, plan)
        if isinstance(plan, str):
            raise CublasLtError(plan)
        return plan

    def workspace(self, stream: torch.cuda.Stream) -> torch.Tensor:
        with _lock:
            if stream.cuda_stream not in self.workspaces:
                device = torch.device("cuda", self.index)
                with torch.cuda.stream(stream):  # the allocator ties the block to the stream
                    self.workspaces[stream.cuda_stream] = torch.empty(
                        _WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            return self.workspaces[stream.cuda_stream]


_devices: dict[int, _Device] = {}
_lock = threading.Lock()  # the dictionaries above and in _Device


def _device(device: torch.device) -> _Device:
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        if index not in _devices:
            _devices[index] = _Device(index)
        return _devices[index]


def workspace(device: torch.device, stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """The 32 MiB workspace of the GEMMs this module enqueues on ``stream`` of ``device`` (by
    default the device's current stream): allocated by torch's allocator on that stream when
    first asked for, then kept. Each stream has its own: GEMMs running at once on two streams
    never share one."""
    device = torch.device(device)
    return _device(device).workspace(
        torch.cuda.current_stream(device) if stream is None else stream)


def candidate_algorithms(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         beta: float = 1.0, most: int = 32) -> list[Callable[[], None]]:
    """Each algorithm (up to ``most``, the heuristic's best first) cuBLASLt lists for
    ``total = a @ b + beta * total``, as a call that enqueues it on the current stream with that
    stream's workspace. ``a`` and ``b`` are CUDA matrices (fp16, bf16 or FP8 with scales of 1),
    each row-major or a transposed view of a row-major one; ``total`` is row-major (fp32, bf16
    or fp16). ``CublasLtError`` where cuBLASLt has none."""
    state = _device(total.device)
    plan = _Plan(state.handle, total, a, b, fast_accum=False, most=most)
    beta_ = ctypes.c_float(beta)

    def call(algo: _Algo) -> Callable[[], None]:
        return lambda: plan.run(algo, state, total, a, b, beta_,
                                torch.cuda.current_stream(total.device))

    return [call(algo) for algo in plan.algos]


def _fastest(plan: _Plan, state: _Device, total, a, b, scales) -> _Algo:
    """The fastest of ``plan``'s algorithms for ``total += a @ b``, each timed on the current
    stream with the smaller of ``a`` and ``b`` replaced by zeros (``total`` unchanged; where
    the other holds an infinity or NaN, ``total`` takes a NaN, as the real product would give
    it a non-finite value). Waits for the GPU once. An algorithm that fails is left out; the
    heuristic's first where none runs or there is no memory for the zeros."""
    zeros_in_a = a.numel() <= b.numel()
    small = a if zeros_in_a else b
    try:
        zeros = torch.empty_strided(small.size(), small.stride(), dtype=small.dtype,
                                    device=small.device).zero_()
    except torch.OutOfMemoryError:
        return plan.algos[0]
    a, b = (zeros, b) if zeros_in_a else (a, zeros)
    stream = torch.cuda.current_stream(total.device)
    timings = []
    with torch.cuda.device(total.device):
        for algo in plan.algos:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            try:
                plan.run(algo, state, total, a, b, _ONE, stream, scales)
                start.record(stream)
                for _ in range(_TIMED_CALLS):
                    plan.run(algo, state, total, a, b, _ONE, stream, scales)
                end.record(stream)
            except CublasLtError:
                continue
            timings.append((start, end, algo))
    if not timings:
        return plan.algos[0]
    timings[-1][1].synchronize()
    return min(timings, key=lambda timing: timing[0].elapsed_time(timing[1]))[2]


def matmul_into(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                fast_accum: bool = False, tune: bool = False) -> None:
    """``total += (a * scales[0]) @ (b * scales[1])`` by one cuBLASLt GEMM with beta 1 (the
    sum in fp32 in its epilogue) on the current stream: ``a`` and ``b`` CUDA matrices (bf16,
    fp16, or FP8 with ``scales``, the fp32 scalars that turn their values back into real ones),
    each row-major or a transposed view of one, or a slice of a wider matrix's columns;
    ``total`` a row-major fp32 matrix. ``fast_accum``: Hopper's FP8 fast accumulation.
    ``tune``: the fastest of the heuristic's algorithms (the module's docstring), else its
    first. Raises one of ``FAILURES`` where cuBLASLt fails; checks nothing else (the callers'
    contracts do; ``takes`` says which matrices it takes)."""
    state = _device(total.device)
    plan = state.plan(total, a, b, fast_accum, tune, scales)
    with torch.cuda.device(total.device):  # cuBLASLt launches on the current device
        plan.run(plan.algos[0], state, total, a, b, _ONE,
                 torch.cuda.current_stream(total.device), scales)
