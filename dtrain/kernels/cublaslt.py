"""An FP8 GEMM that accumulates into its fp32 output: ``total += a @ b`` (cuBLASLt, beta = 1).

``torch._scaled_mm`` writes a new output (cuBLASLt with beta = 0), so a weight gradient summed
over micro-batches costs its product written in bf16 and a second pass that reads it back with
the fp32 gradient and writes the sum (10 bytes per parameter a micro-batch). cuBLASLt itself
takes ``C`` (here the fp32 gradient) and ``beta``, and adds in the GEMM's epilogue, in fp32:
Transformer Engine's weight-gradient GEMM does this for Megatron's fp32 main gradients. torch
ships cuBLASLt and has loaded it; this module calls it through ``ctypes`` (no compiler, no
extension to build): one handle per device, the descriptors and the heuristic's algorithm cached
per problem, torch's current stream, one workspace per (device, stream) from torch's allocator.

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
(``warn_fallback``); a backward never fails here. ``candidate_algorithms`` and ``workspace``
serve benchmarks and tests. ``accumulate_grouped_scaled_mm`` loops it over the MoE experts'
groups of rows, for their weight gradients.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Callable

import torch

from dtrain.kernels.accumulate import groups
from dtrain.log import logger

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
_ALIGNMENT, _MOST_ALIGNMENT = 16, 256
_ONE = ctypes.c_float(1.0)


class CublasLtError(RuntimeError):
    pass


_FAILURES = (CublasLtError, OSError, AttributeError, ctypes.ArgumentError)


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

    def plan(self, total, a, b, fast_accum: bool) -> _Plan:
        key = tuple((x.shape, x.stride(), x.dtype, _alignment(x)) for x in (total, a, b))
        key += (fast_accum,)
        with _lock:
            if key not in self.plans:
                try:
                    self.plans[key] = _Plan(self.handle, total, a, b, fast_accum)
                except CublasLtError as error:
                    self.plans[key] = str(error)
            plan = self.plans[key]
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
_lock = threading.Lock()  # the dictionaries above and in _Device, and the warnings said


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


def _gemm(total, a, b, a_inverse_scale, b_inverse_scale, fast_accum: bool) -> None:
    """cuBLASLt's ``total += a @ b`` (beta 1) on the current stream; raises where it fails."""
    state = _device(total.device)
    plan = state.plan(total, a, b, fast_accum)
    with torch.cuda.device(total.device):  # cuBLASLt launches on the current device
        plan.run(plan.algos[0], state, total, a, b, _ONE,
                 torch.cuda.current_stream(total.device), (a_inverse_scale, b_inverse_scale))


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
        _gemm(total, a, b, scale, scale, False)
        exact = torch.equal(total.double().cpu(), expected)
        why = "its result differs from the exact sum"
    except _FAILURES as error:
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
        if x.data_ptr() % _ALIGNMENT:
            return f"{name}'s address is not a multiple of {_ALIGNMENT} bytes"
        if max(x.stride()) * x.element_size() % _ALIGNMENT:
            return f"{name}'s leading dimension is not a multiple of {_ALIGNMENT} bytes"
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
        a, b = (x if x.data_ptr() % _ALIGNMENT == 0 else x.clone() for x in (a, b))
        return torch._scaled_mm(a, b, a_inverse_scale, b_inverse_scale,
                                out_dtype=torch.float32, use_fast_accum=fast_accum)
    with torch.autocast(a.device.type, enabled=False):  # a backward may run under autocast
        return (a.float() @ b.float()) * (a_inverse_scale * b_inverse_scale)


@torch.library.custom_op("dtrain::accumulate_scaled_mm", mutates_args=("total",))
def accumulate_scaled_mm(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         a_inverse_scale: torch.Tensor, b_inverse_scale: torch.Tensor,
                         fast_accum: bool = False) -> None:
    """``total += (a * a_inverse_scale) @ (b * b_inverse_scale)`` in place (operands: the
    module's docstring): on the GPU one cuBLASLt GEMM, the sum in fp32 in its epilogue
    (``fast_accum``: Hopper's FP8 fast accumulation, ``_scaled_mm``'s ``use_fast_accum``).
    Where cuBLASLt does not take the operands or fails, and on the CPU (a reference: FP8 GEMMs
    are the GPU's), torch's fp32 product is added after. Raises ``ValueError`` only for
    operands that break the contract."""
    _check_operands(total, a, b, a_inverse_scale, b_inverse_scale)
    if total.numel() == 0 or a.shape[1] == 0:
        return
    why = _unfit(total, a, b)
    if why is None and total.is_cuda and works(total.device):
        try:
            _gemm(total, a, b, a_inverse_scale, b_inverse_scale, fast_accum)
            return
        except _FAILURES as error:
            why = str(error).splitlines()[0]
    if why is not None:
        with _lock:  # once per reason, also when threads meet it together
            warn_fallback(why)
    total.add_(_product(a, b, a_inverse_scale, b_inverse_scale, fast_accum))


@accumulate_scaled_mm.register_fake
def _(total, a, b, a_inverse_scale, b_inverse_scale, fast_accum=False) -> None:
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
