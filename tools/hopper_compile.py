"""dtrain's Triton GEMM kernels compiled for Hopper (sm90) without a GPU: Triton's code generation
and ptxas, as a launch on an H100 or H200 compiles them, and what came out.

    python tools/hopper_compile.py            # one JSON line a kernel

For each kernel, specialised as a launch on CUDA tensors specialises it (pointers and sizes
divisible by 16, the experts' count not): its shared memory, whether its products run on the
tensor cores' warp-group MMA (wgmma), whether its loads are pipelined ahead of the products
(asynchronous copies), and its registers, stack and local memory a thread (cuobjdump of the
binary; a stack or local memory means spilled registers). Needs Triton with its NVIDIA backend
(the wheel on PyPI has it) and no TRITON_INTERPRET.
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dtrain.kernels import gpu_blockwise

OPERANDS = {"a_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "w_ptr": "*fp8e4nv",
            "w_scale_ptr": "*fp32", "ends_ptr": "*i32", "out_ptr": "*bf16",
            "M": "i32", "N": "i32", "K": "i32", "E": "i32"}
GRADIENT = {"g_ptr": "*fp8e4nv", "g_scale_ptr": "*fp32", "a_ptr": "*fp8e4nv",
            "a_scale_ptr": "*fp32", "ends_ptr": "*i32", "total_ptr": "*fp32",
            "M": "i32", "N": "i32", "K": "i32"}
# name: (kernel, its arguments' types, its launch as gpu_blockwise makes it)
KERNELS = {
    "blockwise grouped product": (gpu_blockwise.grouped_kernel, OPERANDS,
                                  {"E_POW2": 8, **gpu_blockwise.PRODUCT}),
    "blockwise weight gradient": (gpu_blockwise.weight_gradient_kernel, GRADIENT,
                                  gpu_blockwise.WEIGHT_GRADIENT),
}
OPTIONS = ("num_warps", "num_stages")


def compile_for_hopper(kernel, signature: dict, launch: dict) -> dict:
    constexprs = {k: v for k, v in launch.items() if k not in OPTIONS}
    options = {k: v for k, v in launch.items() if k in OPTIONS}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature)
               if name != "E"}
    source = ASTSource(fn=kernel, signature={**signature, **dict.fromkeys(constexprs,
                                                                          "constexpr")},
                       constexprs=constexprs, attrs=aligned)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
    resources = {key.lower(): int(value)
                 for key, value in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", usage)}
    ttgir = compiled.asm["ttgir"]
    return {"shared_bytes": compiled.metadata.shared,
            "wgmma": "ttng.warp_group_dot" in ttgir,
            "pipelined": "ttg.async_copy_global_to_local" in ttgir, **resources}


def main() -> None:
    for name, (kernel, signature, launch) in KERNELS.items():
        print(json.dumps({"kernel": name, **launch,
                          **compile_for_hopper(kernel, signature, launch)}), flush=True)


if __name__ == "__main__":
    main()
