"""Blockwise FP8 linears on dtrain's Triton kernels (``fp8.blockwise_gemm = "kernels"``): the
experts' grouped GEMMs with one group of all the tokens give the emulated linear's output and
gradients (in Triton's interpreter on the CPU, and on a Hopper GPU), the linears convert to
them where asked, and a GPU on which the kernels fail their check is refused for this choice
with the failure named."""

from __future__ import annotations

import pytest
import torch
from conftest import INTERPRETED, as_if_on_gpu, assert_like_the_emulation

from dtrain.config import ConfigError, FP8Config
from dtrain.models import build
from dtrain.parallel import fp8_blockwise as blockwise_module
from dtrain.parallel.fp8 import check_fp8, convert_to_fp8, describe_fp8
from dtrain.parallel.fp8_blockwise import BlockwiseLinear, blockwise_linear


def kernels(**changes) -> FP8Config:
    return FP8Config(**{"enabled": True, "recipe": "blockwise", "emulate": False,
                        "blockwise_gemm": "kernels", **changes})


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(
        not INTERPRETED, reason="needs Triton installed, for its interpreter (CI installs it)")),
    pytest.param("cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
        reason="needs a Hopper GPU; its output is in docs/benchmarks.md"))])
def test_the_kernels_give_the_emulated_linear_s_output_and_gradients(device):
    torch.manual_seed(0)
    x = torch.randn(2, 192, 256, device=device)  # 384 tokens: three 128-token tiles
    x[0, :3] *= 40  # outlier tokens: their tiles' scales are their own
    weight = torch.randn(384, 256, device=device) / 16
    grad = torch.randn(2, 192, 384, device=device)
    results = []
    for on_kernels in (False, True):
        xi, w = x.clone().requires_grad_(), weight.clone().requires_grad_()
        out = blockwise_linear(xi, w, emulate=not on_kernels, kernels=on_kernels)
        out.backward(grad)
        results.append((out, xi.grad, w.grad))
    for name, want, got in zip(("out", "x.grad", "w.grad"), *results, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert_like_the_emulation(name, got, want, device)
    plain = x @ weight.t()  # and they are FP8 products: the casts round
    assert (plain - results[1][0]).abs().max() > 1e-3 * plain.abs().max()


def test_the_linears_convert_to_the_kernels_where_asked_and_are_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU, as far as it can tell
    model = build("llama3_debug", device="meta", n_layers=2)
    layers = convert_to_fp8(model, kernels(), fsdp=False)
    linears = [m for m in model.modules() if isinstance(m, BlockwiseLinear)]
    assert len(linears) == len(layers[0]) == 8
    assert all(m.kernels and not m.emulate for m in linears)
    assert describe_fp8(kernels(), layers, all_gather=False).startswith(
        "fp8: torchao blockwise (e4m3, 1x128 activation and gradient tiles, 128x128 weight "
        "blocks, dtrain's Triton GEMMs) | 8 linear layers in FP8")
    model = build("llama3_debug", device="meta", n_layers=2)  # emulated: the fp32 products
    convert_to_fp8(model, kernels(emulate=True), fsdp=False)
    assert all(m.emulate and not m.kernels for m in model.modules()
               if isinstance(m, BlockwiseLinear))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernels pass their check on a GPU: "
                    "the failure is caused for real where there is none")
def test_a_gpu_on_which_the_kernels_fail_their_check_is_refused_for_them(monkeypatch):
    as_if_on_gpu(monkeypatch)
    # This machine has no GPU: the check's products fail for real.
    with pytest.raises(ConfigError, match=(
            r"^fp8.blockwise_gemm = 'kernels' needs dtrain's Triton kernels, which failed their "
            r"check on NVIDIA H200 \(.+\): use fp8.blockwise_gemm = 'triton'$")):
        check_fp8(kernels(), torch.device("cuda", 0), tp=1, tokens=8192)
    check_fp8(kernels(blockwise_gemm="triton"), torch.device("cuda", 0), tp=1, tokens=8192)
    monkeypatch.setattr(blockwise_module, "gpu_kernels_failure", lambda device: None)
    check_fp8(kernels(), torch.device("cuda", 0), tp=1, tokens=8192)
    with pytest.raises(ConfigError, match="multiple of 128"):
        check_fp8(kernels(), torch.device("cuda", 0), tp=1, tokens=8000)
