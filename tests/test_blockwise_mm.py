"""``dtrain.kernels.blockwise_mm``: the blockwise-scaled FP8 product. On the CPU its contract and
its emulated product; on a Hopper GPU cuBLASLt's GEMM against the emulated one, for each of the
blockwise linear's three products, and the linear compiled against the emulated linear."""

from __future__ import annotations

import pytest
import torch

from dtrain.kernels.blockwise_mm import blockwise_gemm_works, blockwise_mm, dequantize
from dtrain.parallel.fp8_blockwise import BlockwiseLinear, quantize_blocks, quantize_tiles

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Hopper)")


def products(device: str, tokens: int = 256, width: int = 384, out: int = 512):
    """The three products of a linear (forward, input gradient, weight gradient) as
    ``blockwise_mm``'s operands, from random x (tokens, width), W (out, width), dy (tokens,
    out)."""
    generator = torch.Generator(device=device).manual_seed(0)
    x, w, dy = (torch.randn(*shape, device=device, generator=generator)
                for shape in ((tokens, width), (out, width), (tokens, out)))
    w_bits, w_scales = quantize_blocks(w)
    return {"forward": (*quantize_tiles(x), w_bits, w_scales),
            "input gradient": (*quantize_tiles(dy), *quantize_blocks(w.t())),
            "weight gradient": (*quantize_tiles(dy.t()), *quantize_tiles(x.t()))}


def test_the_emulated_product_is_the_dequantised_operands_product():
    for name, (a, a_scales, b, b_scales) in products("cpu").items():
        got = blockwise_mm(a, a_scales, b, b_scales, torch.float32, True)
        want = dequantize(a, a_scales).double() @ dequantize(b, b_scales).double().t()
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4, msg=name)


def test_operands_that_break_the_contract_raise_value_error():
    a, a_scales, b, b_scales = products("cpu")["forward"]
    with pytest.raises(ValueError, match=r"multiplies e4m3 \(M, K\) by e4m3 \(N, K\)"):
        blockwise_mm(a.float(), a_scales, b, b_scales, torch.float32, True)
    with pytest.raises(ValueError, match=r"scales do not match its operands"):
        blockwise_mm(a, a_scales[:, :1], b, b_scales, torch.float32, True)
    assert not blockwise_gemm_works(torch.device("cpu"))


@GPU
def test_cublaslt_runs_every_product_as_the_emulation_does():
    assert blockwise_gemm_works(torch.device("cuda")), "cuBLASLt's blockwise GEMM does not run"
    for name, operands in products("cuda").items():
        got = blockwise_mm(*operands, torch.float32, False)
        want = blockwise_mm(*operands, torch.float32, True)
        # The same products of the same e4m3 values; only the order of the fp32 sums differs.
        assert (got - want).abs().max() <= 1e-3 * want.abs().max(), name


@GPU
def test_the_linear_compiled_on_the_gpu_matches_the_emulated_linear():
    torch.manual_seed(0)
    plain = torch.nn.Linear(512, 1024, bias=False, device="cuda")
    fast, slow = BlockwiseLinear.from_linear(plain, emulate=False), BlockwiseLinear.from_linear(
        plain, emulate=True)
    x = torch.randn(2, 1024, 512, device="cuda", requires_grad=True)
    results = []
    for layer in (torch.compile(fast), slow):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        (y.float() ** 2).mean().backward()
        results.append((y.float(), x.grad.clone(), plain.weight.grad.clone()))
        x.grad = plain.weight.grad = None
    for got, want, name in zip(results[0], results[1], ("output", "input grad", "weight grad"),
                               strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-3, msg=name)
