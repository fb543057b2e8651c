"""Grouped GEMM against the loop over experts: forward + backward of one MoE layer's experts.

    python tools/bench_moe.py                                   # Mixtral 8x7B expert shapes
    python tools/bench_moe.py --experts 4 --tokens 32768        # the 4 local experts under EP 2
    python tools/bench_moe.py --dim 6144 --hidden 16384         # Mixtral 8x22B
    python tools/bench_moe.py --variants grouped fp8 blockwise  # FP8 grouped GEMMs (Hopper)

Variants: ``grouped`` (bf16 ``torch._grouped_mm``), ``loop`` (one matmul per expert), ``fp8``
(rowwise FP8 grouped GEMMs) and ``blockwise`` (DeepSeek-V3's tiles and blocks, dtrain's Triton
grouped GEMMs); the FP8 ones cast the weights in each forward, as without the step's cast.

Tokens (the routed copies a rank's experts receive, ``tokens`` = micro-batch tokens x top_k) are
spread over the experts with a seeded random imbalance (``--skew``; 0 is uniform). Each variant
is timed over ``--iters`` iterations after warm-up; prints ms per iteration, TFLOP/s (3 matmuls
of 2 x tokens x dim x hidden FLOPs, three times that with the backward) and each variant's
speedup over the first, as a JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dtrain.models.moe import grouped_swiglu, looped_swiglu  # noqa: E402


def token_counts(tokens: int, experts: int, skew: float, seed: int) -> torch.Tensor:
    """Tokens per expert summing to ``tokens``; ``skew`` scales a random log-normal imbalance."""
    g = torch.Generator().manual_seed(seed)
    share = torch.exp(skew * torch.randn(experts, generator=g))
    counts = (share / share.sum() * tokens).floor().long()
    counts[0] += tokens - counts.sum()
    return counts


VARIANTS = {
    "grouped": grouped_swiglu,
    "loop": looped_swiglu,
    "fp8": lambda x, counts, *weights: grouped_swiglu(x, counts, *weights, mode="fp8"),
    "blockwise": lambda x, counts, *weights: grouped_swiglu(x, counts, *weights,
                                                            mode="blockwise"),
}


def time_variant(fn, x, counts, weights, iters: int, device: torch.device) -> float:
    """Seconds per forward + backward."""
    upstream = torch.randn(x.shape[0], weights[1].shape[1], device=device, dtype=x.dtype)

    def step():
        out = fn(x, counts, *weights)
        torch.autograd.grad(out, (x, *weights), upstream)

    for _ in range(3):
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    sync()
    return (time.perf_counter() - start) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384, help="routed token copies")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=14336)
    parser.add_argument("--skew", type=float, default=0.3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", nargs="+", default=["grouped", "loop"],
                        choices=list(VARIANTS))
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(args.seed)
    counts = token_counts(args.tokens, args.experts, args.skew, args.seed).to(device)
    x = torch.randn(args.tokens, args.dim, device=device, dtype=dtype, requires_grad=True)
    weights = [(0.02 * torch.randn(args.experts, *shape, device=device, dtype=dtype))
               .requires_grad_()
               for shape in ((args.hidden, args.dim), (args.dim, args.hidden),
                             (args.hidden, args.dim))]
    with torch.no_grad():
        diff = (grouped_swiglu(x, counts, *weights) - looped_swiglu(x, counts, *weights)).abs()
    flops = 3 * 3 * 2 * args.tokens * args.dim * args.hidden  # 3 matmuls, forward + 2 backward
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": args.dtype, "tokens": args.tokens,
              "experts": args.experts, "dim": args.dim, "hidden": args.hidden,
              "tokens_per_expert": counts.tolist(), "max_abs_diff": diff.max().item()}
    for name in args.variants:
        seconds = time_variant(VARIANTS[name], x, counts, weights, args.iters, device)
        result[f"{name}_ms"] = round(1e3 * seconds, 3)
        result[f"{name}_tflops"] = round(flops / seconds / 1e12, 1)
        result[f"{name}_speedup"] = round(result[f"{args.variants[0]}_ms"] / (1e3 * seconds), 2)
    print("BENCH_MOE " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
