"""The experts' blockwise FP8 GEMMs' Triton kernels (``dtrain.kernels.gpu_blockwise``) against
the emulated products (``dtrain.kernels.grouped_blockwise``, fp32 products of the dequantised
operands): in Triton's interpreter on a machine without CUDA (``conftest.INTERPRETED``; CI
installs Triton), and on a Hopper GPU (skipped elsewhere; its output is in docs/benchmarks.md).
Groups start at multiples of 128 rows, as ``pad_groups`` lays them out; one is empty, the
counts are not a power of two, and the rows past the last group hold values no product may
read."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import INTERPRETED, PYTHONPATH, ROOT

from dtrain.kernels.blockwise_mm import quantize_blocks, quantize_tiles
from dtrain.kernels.grouped_blockwise import (
    TOLERANCE,
    accumulate_grouped_blockwise,
    gpu_kernels_failure,
    grouped_blockwise_mm,
)
from dtrain.models.grouped_gemm import pad_groups

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(
        not INTERPRETED, reason="needs Triton installed, for its interpreter (CI installs it)")),
    pytest.param("cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
        reason="needs a Hopper GPU; its output is in docs/benchmarks.md")),
]
COUNTS = [130, 0, 5, 250, 1]  # padded to 256, 0, 128, 256, 128 rows: ends 256 ... 768


def grouped_rows(dim: int, device: str, seed: int = 0):
    """Rows grouped as ``COUNTS`` (``pad_groups``), an outlier expert first, and rows past the
    last group set to 1e30: a kernel that read them would put inf or NaN in its result."""
    generator = torch.Generator().manual_seed(seed)
    counts = torch.tensor(COUNTS)
    x = torch.randn(sum(COUNTS) + 7, dim, generator=generator)
    x[:COUNTS[0]] *= 40
    padded, ends, _ = pad_groups(x, counts, 128)
    padded[int(ends[-1]):] = 1e30
    return padded.to(device), ends.to(device), generator


def tolerance(device: str) -> float:
    """Of the largest value. The same FP8 products summed in another order: in the interpreter
    in fp32 (6e-7 seen; 1e-5 is 100 ulps at the outlier expert's size); on the GPU the tensor
    cores keep fewer bits within each 128-wide slice (``grouped_blockwise.TOLERANCE``)."""
    return 1e-5 if device == "cpu" else TOLERANCE


def triton_kernels():
    from dtrain.kernels import gpu_blockwise  # imports Triton

    return gpu_blockwise


@pytest.mark.parametrize("device", DEVICES)
def test_the_grouped_kernel_equals_the_emulated_product(device):
    rows, ends, generator = grouped_rows(256, device)
    weight = torch.randn(len(COUNTS), 384, 256, generator=generator).to(device)
    a, w = quantize_tiles(rows), quantize_blocks(weight)
    got = triton_kernels().grouped_mm(*a, *w, ends, torch.float32)
    want = grouped_blockwise_mm(*a, *w, ends, torch.float32, True)
    last = int(ends[-1])
    scale = want[:last].abs().max()
    assert (got[:last] - want[:last]).abs().max() <= tolerance(device) * scale
    assert torch.equal(got[last:], torch.zeros_like(got[last:]))  # past the groups: zeros
    # and the operand casts rounded: not the fp32 product
    exact = torch.cat([rows[:256] @ weight[0].t(), rows[256:384] @ weight[2].t()])
    assert (got[:384] - exact).abs().max() > 1e-3 * scale


@pytest.mark.parametrize("device", DEVICES)
def test_the_weight_gradient_kernel_adds_the_emulated_product_into_the_gradient(device):
    rows, ends, generator = grouped_rows(256, device)
    grad = torch.randn(rows.shape[0], 384, generator=generator).to(device)
    grad[int(ends[-1]):] = float("nan")  # unspecified there: never read
    g_t, a_t = quantize_tiles(grad.t().contiguous()), quantize_tiles(rows.t().contiguous())
    before = torch.randn(len(COUNTS), 384, 256, generator=generator).to(device)
    got, want = before.clone(), before.clone()
    triton_kernels().accumulate_weight_gradient(got, *g_t, *a_t, ends)
    accumulate_grouped_blockwise(want, *g_t, *a_t, ends, True)
    assert torch.isfinite(got).all()
    added = want - before
    assert (got - want).abs().max() <= tolerance(device) * added.abs().max()
    # the empty expert's gradient is untouched
    assert torch.equal(got[1], before[1])
    # a gradient it cannot add into in place is refused, untouched
    strided = before.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match="contiguous"):
        accumulate_grouped_blockwise(strided, *g_t, *a_t, ends, False)
    assert torch.equal(strided, before)


def test_the_ops_fake_tensors_and_compiled_graphs_agree_with_them():
    # torch's opcheck without its schema test, whose mutation check cannot compare float8
    # tensors on the CPU ("mul_cpu_reduced_float" not implemented); the weight-gradient tests
    # above show that the op adds into ``total`` and leaves its other inputs.
    rows, ends, generator = grouped_rows(256, "cpu")
    rows[int(ends[-1]):] = 0
    a = quantize_tiles(rows)
    w = quantize_blocks(torch.randn(len(COUNTS), 128, 256, generator=generator))
    checks = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(grouped_blockwise_mm, (*a, *w, ends, torch.float32, True),
                          test_utils=checks)
    grad = torch.randn(rows.shape[0], 128, generator=generator)
    g_t, a_t = quantize_tiles(grad.t().contiguous()), quantize_tiles(rows.t().contiguous())
    torch.library.opcheck(accumulate_grouped_blockwise,
                          (torch.zeros(len(COUNTS), 128, 256), *g_t, *a_t, ends, True),
                          test_utils=checks)


@pytest.mark.parametrize("device", DEVICES)
def test_the_kernels_pass_their_check_on_the_device(device):
    assert gpu_kernels_failure(torch.device(device)) is None


# ---- Compiled for Hopper without a GPU -----------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available() or not INTERPRETED,
                    reason="a machine without a GPU and with Triton (CI): on a GPU the kernels "
                           "compile at their first launch")
def test_the_kernels_compile_for_hopper_pipelined_on_tensor_cores_without_spilling():
    # What a launch on an H100 or H200 compiles, here without one (tools/hopper_compile.py:
    # Triton's sm90 code generation and ptxas, in a process without the interpreter). A kernel
    # that reads a Python global, say, runs in the interpreter and fails to compile.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "hopper_compile.py")],
                          env={**env, "PYTHONPATH": PYTHONPATH}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    kernels = {k["kernel"]: k for k in map(json.loads, done.stdout.splitlines())}
    assert set(kernels) == {"blockwise grouped product", "blockwise weight gradient"}
    for kernel in kernels.values():
        assert kernel["wgmma"] and kernel["pipelined"], kernel  # FP8 tensor cores, loads ahead
        assert kernel["stack"] == 0 and kernel["local"] == 0, kernel  # no register spills
