"""bf16 GEMMs of one Llama 3 8B block and the output layer: torch's choice against each algorithm
cuBLASLt's heuristic offers (GPU only).

    python tools/gemm_algo_bench.py [--tokens 8192]

For each linear's forward (``x @ W^T``), input gradient (``dy @ W``) and weight gradient
(``grad += dy^T @ x`` into fp32, as the step weights' accumulation does), it times ``torch.mm`` /
``torch.addmm`` with cuBLAS, the same with torch's cuBLASLt path, cuBLASLt's first heuristic
algorithm, and the fastest of up to 32 it lists (called through ``ctypes`` on the cuBLASLt
torch loaded, as ``dtrain.kernels.cublaslt``). Each figure is the mean of 30 calls after 5.
"""

from __future__ import annotations

import argparse
import ctypes

import torch
from fused_gemm_bench import timed  # tools/ is the script's own folder

from dtrain.kernels import cublaslt

DIM, FFN, KV, VOCAB = 4096, 14336, 1024, 128256
_BF16, _FP32 = 14, 0  # cudaDataType_t


def _operand(x: torch.Tensor) -> tuple[int, int, int, int]:
    """cuBLAS's (operation, rows, columns, leading dimension) for the transpose of the
    row-major x (rows, cols), contiguous or a transposed view of a contiguous tensor."""
    rows, cols = x.shape
    if x.stride() == (cols, 1):
        return 0, cols, rows, cols
    assert x.stride() == (1, rows), x.stride()
    return 1, rows, cols, rows


def algorithms(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, beta: float,
               most: int = 32) -> list:
    """A call for each algorithm cuBLASLt lists for out (+)= a @ b (computed column-major as
    out^T = b^T a^T)."""
    lib, state = cublaslt._lib(), cublaslt._device(a.device)
    vp = ctypes.c_void_p
    desc = vp()
    cublaslt._check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), cublaslt._COMPUTE_32F,
                                                 _FP32), "MatmulDescCreate")
    op_b, *b_layout = _operand(b)
    op_a, *a_layout = _operand(a)
    cublaslt._set(lib.cublasLtMatmulDescSetAttribute, desc, cublaslt._DESC_TRANSA,
                  ctypes.c_int32(op_b))
    cublaslt._set(lib.cublasLtMatmulDescSetAttribute, desc, cublaslt._DESC_TRANSB,
                  ctypes.c_int32(op_a))
    layouts = []
    out_type = _FP32 if out.dtype == torch.float32 else _BF16
    for dtype, (rows, cols, ld) in ((_BF16, b_layout), (_BF16, a_layout),
                                    (out_type, (out.shape[1], out.shape[0], out.shape[1]))):
        layout = vp()
        cublaslt._check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols,
                                                       ld), "MatrixLayoutCreate")
        layouts.append(layout)
    preference = vp()
    cublaslt._check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(preference)),
                    "MatmulPreferenceCreate")
    cublaslt._set(lib.cublasLtMatmulPreferenceSetAttribute, preference,
                  cublaslt._PREF_MAX_WORKSPACE, ctypes.c_uint64(cublaslt._WORKSPACE_BYTES))
    results, found = (cublaslt._Heuristic * most)(), ctypes.c_int(0)
    cublaslt._check(lib.cublasLtMatmulAlgoGetHeuristic(
        state.handle, desc, layouts[0], layouts[1], layouts[2], layouts[2], preference, most,
        results, ctypes.byref(found)), "MatmulAlgoGetHeuristic")
    alpha, beta_ = ctypes.c_float(1.0), ctypes.c_float(beta)

    def call(algo):
        return lambda: cublaslt._check(lib.cublasLtMatmul(
            state.handle, desc, ctypes.byref(alpha), b.data_ptr(), layouts[0], a.data_ptr(),
            layouts[1], ctypes.byref(beta_), out.data_ptr(), layouts[2], out.data_ptr(),
            layouts[2], ctypes.byref(algo), state.workspace.data_ptr(),
            cublaslt._WORKSPACE_BYTES, torch.cuda.current_stream().cuda_stream), "Matmul")

    return [call(results[i].algo) for i in range(found.value)]


def products(tokens: int):
    """(name, flops, a, b, out, beta, torch's call) for each GEMM of a block and the output
    layer."""
    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    for name, n, k in (("q", DIM, DIM), ("k", KV, DIM), ("v", KV, DIM), ("o", DIM, DIM),
                       ("w1", FFN, DIM), ("w3", FFN, DIM), ("w2", DIM, FFN),
                       ("output", VOCAB, DIM)):  # the weight is [n, k]
        w, x, dy = rand(n, k), rand(tokens, k), rand(tokens, n)
        y, dx = rand(tokens, n), rand(tokens, k)
        grad = torch.zeros(n, k, device="cuda")
        flops = 2 * tokens * n * k
        yield (f"{name} forward", flops, x, w.t(), y, 0.0,
               lambda x=x, w=w, y=y: torch.mm(x, w.t(), out=y))
        yield (f"{name} grad input", flops, dy, w, dx, 0.0,
               lambda dy=dy, w=w, dx=dx: torch.mm(dy, w, out=dx))
        yield (f"{name} grad weight", flops, dy.t(), x, grad, 1.0,
               lambda g=grad, dy=dy, x=x: torch.addmm(g, dy.t(), x, out_dtype=torch.float32,
                                                      out=g))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    tokens = parser.parse_args().tokens
    totals = dict.fromkeys(("torch", "torch cuBLASLt", "heuristic first", "best"), 0.0)
    print(f"{'GEMM':20} {'torch ms':>8} {'torch Lt':>8} {'first':>8} {'best':>8} {'index':>5} "
          f"{'listed':>6} {'TFLOP/s torch':>13} {'best':>6}", flush=True)
    for name, flops, a, b, out, beta, reference in products(tokens):
        torch_ms = timed(reference)
        torch.backends.cuda.preferred_blas_library("cublaslt")
        torch_lt_ms = timed(reference)
        torch.backends.cuda.preferred_blas_library("cublas")
        calls = algorithms(a, b, out, beta)
        index = min(range(len(calls)), key=lambda i: timed(calls[i], 10))
        first_ms, best_ms = timed(calls[0]), timed(calls[index])
        for key, ms in zip(totals, (torch_ms, torch_lt_ms, first_ms, min(first_ms, best_ms)),
                           strict=True):
            totals[key] += ms
        print(f"{name:20} {torch_ms:8.3f} {torch_lt_ms:8.3f} {first_ms:8.3f} {best_ms:8.3f} "
              f"{index:5d} {len(calls):6d} {flops / torch_ms / 1e9:13.0f} "
              f"{flops / best_ms / 1e9:6.0f}", flush=True)
    print("total ms: " + ", ".join(f"{k} {v:.3f}" for k, v in totals.items()), flush=True)


if __name__ == "__main__":
    main()
