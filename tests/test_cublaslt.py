"""The FP8 GEMM that adds into its fp32 output (``dtrain.kernels.cublaslt``): its arithmetic,
its checks, its use inside compiled graphs, and (on a GPU with FP8) cuBLASLt's result."""

import re

import pytest
import torch

from dtrain.kernels.cublaslt import accumulate_scaled_mm

FP8_GPU = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a GPU with FP8 (cuBLASLt's FP8 GEMM); its output is in docs/benchmarks.md")


def small_integers(shape, dtype, device, seed):
    """FP8 values that are small integers: their products and sums are exact in fp32."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=generator).float().to(dtype).to(device)


def operands(device, m=96, n=80, k=128):
    a = small_integers((m, k), torch.float8_e5m2, device, 0)  # row-major
    b = small_integers((n, k), torch.float8_e4m3fn, device, 1).t()  # column-major
    total = small_integers((m, n), torch.float32, device, 2) * 8
    scales = torch.tensor(0.5, device=device), torch.tensor(4.0, device=device)
    return total, a, b, scales


def exact(total, a, b, scales):
    return total.double().cpu() + (a.double().cpu() * scales[0].item()) @ (
        b.double().cpu() * scales[1].item())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=FP8_GPU)])
def test_the_product_is_added_into_total_in_place(device):
    total, a, b, scales = operands(device)
    expected, storage = exact(total, a, b, scales), total.data_ptr()
    accumulate_scaled_mm(total, a, b, *scales)
    assert total.data_ptr() == storage
    assert torch.equal(total.double().cpu(), expected)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=FP8_GPU)])
def test_inside_a_compiled_graph_the_add_reaches_the_input(device):
    total, a, b, scales = operands(device)
    expected = exact(total, a, b, scales)

    @torch.compile(fullgraph=True)
    def step(total, a, b, inverse_scale_a, inverse_scale_b):
        accumulate_scaled_mm(total, a, b, inverse_scale_a, inverse_scale_b)

    step(total, a, b, *scales)
    assert torch.equal(total.double().cpu(), expected)


@FP8_GPU
@pytest.mark.parametrize("fast_accum", [False, True])
def test_cublaslt_s_sum_is_scaled_mm_s_fp32_product_added(fast_accum):
    """Random operands at a weight gradient's shape: the GEMM's own add in fp32 gives what
    ``_scaled_mm``'s fp32 product added afterwards gives (measured bit for bit on an H200)."""
    torch.manual_seed(0)
    a = (torch.randn(1024, 4096, device="cuda") * 8).to(torch.float8_e5m2)
    b = torch.randn(2048, 4096, device="cuda").to(torch.float8_e4m3fn).t()
    scales = torch.tensor(0.25, device="cuda"), torch.tensor(0.5, device="cuda")
    total = torch.randn(1024, 2048, device="cuda")
    product = torch._scaled_mm(a, b, *scales, out_dtype=torch.float32, use_fast_accum=fast_accum)
    expected = total + product
    accumulate_scaled_mm(total, a, b, *scales, fast_accum=fast_accum)
    # one fp32 rounding of the same sum either way; the tolerance (about 8 ulp of fp32) leaves room
    # for cuBLASLt's heuristic choosing another tiling or split of K for the beta-1 problem
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=1e-6 * product.abs().max())


@pytest.mark.parametrize("bad,message", [
    ("a_column_major", "a must be row-major and b column-major"),
    ("total_bf16", "total must be a contiguous fp32 [96, 80]"),
    ("both_e5m2", "a and b must be FP8, not both e5m2"),
    ("k", "a is [96, 128] but b is [64, 80]"),
])
def test_wrong_operands_are_named(bad, message):
    total, a, b, scales = operands("cpu")
    if bad == "a_column_major":
        a = a.t().contiguous().t()
    elif bad == "total_bf16":
        total = total.to(torch.bfloat16)
    elif bad == "both_e5m2":
        b = b.to(torch.float32).to(torch.float8_e5m2)
    else:
        b = b[:64]
    with pytest.raises(ValueError, match=r"^accumulate_scaled_mm: .*" + re.escape(message)):
        accumulate_scaled_mm(total, a, b, *scales)


@FP8_GPU
def test_without_cublaslt_the_product_is_added_after_a_warning(monkeypatch):
    """cuBLASLt that does not load (here a path that is not there): one warning names it, and
    the sum is still right (``_scaled_mm``'s fp32 product added afterwards)."""
    from dtrain.kernels import cublaslt

    monkeypatch.setattr(cublaslt, "_library_path", lambda: "/nonexistent/libcublasLt.so.13")
    for cached in (cublaslt._lib, cublaslt._works):
        cached.cache_clear()
    monkeypatch.setattr(cublaslt, "_devices", {})
    warnings = []
    monkeypatch.setattr(cublaslt.logger, "warning",
                        lambda message, *args: warnings.append(message % args))
    try:
        total, a, b, scales = operands("cuda")
        product = exact(torch.zeros_like(total), a, b, scales)
        expected = total.double().cpu() + 2 * product
        accumulate_scaled_mm(total, a, b, *scales)
        accumulate_scaled_mm(total, a, b, *scales)  # warned once, not per call
        assert torch.equal(total.double().cpu(), expected)
        assert len(warnings) == 1
        assert "does not work on cuda" in warnings[0] and "second pass" in warnings[0]
    finally:
        for cached in (cublaslt._lib, cublaslt._works):
            cached.cache_clear()
