"""The MoE experts' weight gradients in FP8 (``fp8.experts_weight_gradient = "fp8"``): each
expert's product of the tensorwise-cast gradient (e5m2) and input (e4m3) added into its fp32
``.grad``, against the same casts multiplied in fp64 and against fp32; rows past the last group
left out; an emulated Mixtral run against fp32 and against the bf16 weight gradients; on an FP8
GPU, cuBLASLt's GEMMs on the column slices against the CPU's."""

import pytest
import torch
from conftest import MIXTRAL_CPU
from torch.utils.weak import WeakIdKeyDictionary

from dtrain import load_config
from dtrain.kernels import cublaslt
from dtrain.kernels.cublaslt import accumulate_scaled_mm
from dtrain.models import grouped_gemm
from dtrain.models.grouped_gemm import E4M3, E5M2, fp8_weight_gradient, pad_groups, tensorwise_fp8
from dtrain.run import feature_lines
from dtrain.trainer import Trainer


def _experts(counts: list[int], out: int, features: int, device: str = "cpu"):
    """Rows grouped by expert and padded to 16 on the device, with the rows past the last group
    made huge (the grouped GEMMs leave them unspecified; a scale that saw them would flush the
    real values to zero), and a random stacked fp32 gradient to add into."""
    torch.manual_seed(0)
    counts_t = torch.tensor(counts, device=device)
    grad, ends, _ = pad_groups(torch.randn(sum(counts), out, device=device).bfloat16(), counts_t)
    a, _, _ = pad_groups(torch.randn(sum(counts), features, device=device).bfloat16(), counts_t)
    grad[int(ends[-1]):], a[int(ends[-1]):] = 1e30, -1e30
    return torch.randn(len(counts), out, features, device=device), grad, a, ends


def _reference(total, grad, a, ends):
    """Each expert's product of the same casts (scales from the groups' rows only), in fp64."""
    rows = int(ends[-1])
    g_bits, g_inverse = tensorwise_fp8(grad[:rows].t(), E5M2)
    a_bits, a_inverse = tensorwise_fp8(a[:rows].t(), E4M3)
    g = g_bits.double() * g_inverse.double()
    x = a_bits.double() * a_inverse.double()
    expected, start = total.double().clone(), 0
    for e, end in enumerate(ends.tolist()):
        expected[e] += g[:, start:end] @ x[:, start:end].t()
        start = end
    return expected


@pytest.mark.parametrize("counts", [[7, 0, 40, 1], [0, 0, 33, 0]])
def test_each_experts_fp8_product_is_added_into_its_gradient(counts):
    total, grad, a, ends = _experts(counts, 48, 80)
    before, products, start = total.clone(), torch.zeros_like(total), 0
    for e, end in enumerate(ends.tolist()):  # the unrounded products
        products[e] = grad[start:end].float().t() @ a[start:end].float()
        start = end
    expected = _reference(total, grad, a, ends)
    fp8_weight_gradient(total, grad, a, ends)
    assert torch.isfinite(total).all()
    torch.testing.assert_close(total.double(), expected, rtol=1e-6, atol=1e-5)
    # within FP8's rounding of the products (e5m2 keeps 2 mantissa bits), and not equal to them
    error = ((total - before - products).norm() / products.norm()).item()
    assert 0 < error < 0.1


def test_a_column_slice_of_a_wider_matrix_is_an_operand():
    torch.manual_seed(0)
    wide_a = torch.randn(32, 96).to(E4M3)
    wide_b = torch.randn(48, 96).to(E4M3)
    scales = (torch.tensor(0.5), torch.tensor(0.25))
    sliced, whole = torch.zeros(32, 48), torch.zeros(32, 48)
    accumulate_scaled_mm(sliced, wide_a[:, 16:64], wide_b[:, 16:64].t(), *scales)
    accumulate_scaled_mm(whole, wide_a[:, 16:64].contiguous(),
                         wide_b[:, 16:64].contiguous().t(), *scales)
    assert torch.equal(sliced, whole) and whole.abs().sum() > 0


MIXTRAL = {**MIXTRAL_CPU, "fp8.emulate": True}


def test_mixtral_with_fp8_expert_weight_gradients_trains_like_fp32(tmp_path, monkeypatch):
    # the groups' ends given to the grouped op (weakly, by identity: a dead tensor's id may be
    # another's later), and their reads on the host
    calls, ends_seen, reads = [], WeakIdKeyDictionary(), []
    grouped = grouped_gemm.accumulate_grouped_scaled_mm
    monkeypatch.setattr(grouped_gemm, "accumulate_grouped_scaled_mm",
                        lambda *args: calls.append(1) or ends_seen.update({args[-1]: True})
                        or grouped(*args))
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: (
        reads.append(1) if self in ends_seen else None) or tolist(self))
    runs = {}
    for name, changes in (("fp8_grad", {"fp8.enabled": True,
                                        "fp8.experts_weight_gradient": "fp8"}),
                          ("bf16_grad", {"fp8.enabled": True}), ("fp32", {})):
        trainer = Trainer(load_config("debug", {**MIXTRAL, **changes,
                                                "job.output_dir": str(tmp_path / name)}))
        if name != "fp32":  # the start-up line says which weight gradients are FP8
            (line,) = [line for line in feature_lines(trainer) if line.startswith("fp8:")]
            assert ("the experts of 2 MoE layers (rowwise, weight gradients tensorwise where "
                    "added into .grad in place)" in line) is (name == "fp8_grad"), line
            assert "the experts of 2 MoE layers (rowwise" in line, line
        runs[name] = [r["loss"] for r in trainer.train()]
        if name == "fp8_grad":
            # 3 weights x 2 layers x 2 micro-batches x 4 steps, all in FP8; the three weights
            # of a layer and micro-batch read their groups' ends on the host once
            assert len(calls) == 3 * 2 * 2 * 4 and len(reads) == 2 * 2 * 4
    assert len(calls) == 48  # the bf16 weight gradients' run made none
    assert runs["fp8_grad"] == pytest.approx(runs["fp32"], rel=1e-2)
    assert runs["fp8_grad"][1:] != runs["bf16_grad"][1:]  # the first step's loss is before any


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs an sm90 GPU (cuBLASLt's FP8 GEMM); its output is in "
                           "docs/benchmarks.md")
def test_on_the_gpu_the_fp8_weight_gradients_are_cublaslt_s_on_the_slices(monkeypatch):
    fallbacks = []
    monkeypatch.setattr(cublaslt, "warn_fallback", fallbacks.append)
    total, grad, a, ends = _experts([300, 0, 1000, 52, 17], 1024, 512, "cuda")
    before = total.double().cpu()
    expected = _reference(total, grad, a, ends).cpu()
    fp8_weight_gradient(total, grad, a, ends)
    assert fallbacks == [] and cublaslt.works(total.device)
    # Hopper's FP8 tensor cores sum in a narrower accumulator between the GEMM's fp32
    # promotions: on an H100 the largest difference from the fp64 sums was 0.026 (21.9% of the
    # values past 1e-3). A wrong slice or scale would be wrong by the products' own size.
    largest = (expected - before).abs().max().item()
    error = (total.double().cpu() - expected).abs().max().item()
    assert error < 1e-3 * largest, (error, largest)
