"""Separate against fused projection GEMMs of one Llama 3 8B block and micro-batch (GPU only).

    python tools/fused_gemm_bench.py [--tokens 8192]

Megatron-LM keeps q, k and v in one weight (``linear_qkv``) and gate and up in another
(``linear_fc1``); dtrain's model keeps the five apart (as Hugging Face's checkpoints do). This
times, for both layouts, the forward product, the input gradient's and the weight gradient's
(added into an fp32 gradient as the step's accumulation does), in FP8 (``torch._scaled_mm`` and
``dtrain.kernels.cublaslt``, torchao's layouts and fast-accumulation settings) and in bf16
(``torch.mm`` and ``torch.addmm(..., out_dtype=torch.float32, out=grad)``). Each figure is the
mean of 30 calls after 5, measured twice; the separate and fused runs alternate.
"""

from __future__ import annotations

import argparse
import functools

import torch

from dtrain.kernels.cublaslt import accumulate_scaled_mm

DIM, FFN, KV = 4096, 14336, 1024
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def timed(fn, calls: int = 30) -> float:
    for _ in range(5):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / calls


def fp8_products(tokens: int):
    one = torch.ones((), device="cuda")

    def rand(shape, dtype):
        return (torch.randn(shape, device="cuda") * 2).to(dtype)

    def forward(n):  # x [T, D] @ W^T -> [T, n]
        x, w_t = rand((tokens, DIM), E4M3), rand((n, DIM), E4M3).t()
        return lambda: torch._scaled_mm(x, w_t, one, one, out_dtype=torch.bfloat16,
                                        use_fast_accum=True)

    def grad_input(n):  # dy [T, n] @ W [n, D] -> [T, D]
        dy, w = rand((tokens, n), E5M2), rand((DIM, n), E4M3).t()
        return lambda: torch._scaled_mm(dy, w, one, one, out_dtype=torch.bfloat16)

    def grad_weight(n):  # grad [n, D] += dy^T [n, T] @ x [T, D]
        dy_t, x = rand((n, tokens), E5M2), rand((DIM, tokens), E4M3).t()
        grad = torch.zeros(n, DIM, device="cuda")
        return lambda: accumulate_scaled_mm(grad, dy_t, x, one, one)

    return forward, grad_input, grad_weight


def bf16_products(tokens: int):
    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    def forward(n):
        x, w = rand(tokens, DIM), rand(n, DIM)
        return lambda: x @ w.t()

    def grad_input(n):
        dy, w = rand(tokens, n), rand(n, DIM)
        return lambda: dy @ w

    def grad_weight(n):
        dy, x, grad = rand(tokens, n), rand(tokens, DIM), torch.zeros(n, DIM, device="cuda")
        return lambda: torch.addmm(grad, dy.t(), x, out_dtype=torch.float32, out=grad)

    return forward, grad_input, grad_weight


def _each(products) -> None:
    for product in products:
        product()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    tokens = parser.parse_args().tokens
    groups = (("q, k, v", [DIM, KV, KV]), ("gate, up", [FFN, FFN]))
    print(f"{'':5} {'weights':9} {'product':12} {'separate ms':>12} {'fused ms':>9} {'saved':>7}")
    for precision, products in (("fp8", fp8_products), ("bf16", bf16_products)):
        for names, parts in groups:
            for kind, make in zip(("forward", "grad input", "grad weight"), products(tokens),
                                  strict=True):
                separate = functools.partial(_each, [make(n) for n in parts])
                fused = make(sum(parts))
                times = [(timed(separate), timed(fused)) for _ in range(2)]
                split, whole = times[-1]
                print(f"{precision:5} {names:9} {kind:12} {split:12.3f} {whole:9.3f} "
                      f"{split - whole:7.3f}", flush=True)


if __name__ == "__main__":
    main()
