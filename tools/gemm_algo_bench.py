"""bf16 GEMMs of one Llama 3 8B block and the output layer: torch's choice against each algorithm
cuBLASLt's heuristic offers (GPU only).

    python tools/gemm_algo_bench.py [--tokens 8192]

For each linear's forward (``x @ W^T``), input gradient (``dy @ W``) and weight gradient
(``grad += dy^T @ x`` into fp32, as the step weights' accumulation does), it times ``torch.mm`` /
``torch.addmm`` with cuBLAS, the same with torch's cuBLASLt path, cuBLASLt's first heuristic
algorithm, and the fastest of up to 32 it lists
(``dtrain.kernels.cublaslt_binding.candidate_algorithms``, on the cuBLASLt torch loaded). Each
figure is the mean of 30 calls after 5.
"""

from __future__ import annotations

import argparse

import torch
from fused_gemm_bench import timed  # tools/ is the script's own folder

from dtrain.kernels.cublaslt_binding import candidate_algorithms

DIM, FFN, KV, VOCAB = 4096, 14336, 1024, 128256


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
        calls = candidate_algorithms(out, a, b, beta)
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
