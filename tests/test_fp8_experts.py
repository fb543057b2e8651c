"""The MoE experts' grouped GEMMs (dtrain.models.grouped_gemm): the device-side padding of each
expert's group to 16 rows, the FP8 products (emulated) against fp32 within FP8's rounding, the
FP8 SwiGLU against the bf16 one, the weights cast once per step against a cast in every
micro-batch, an emulated Mixtral run against fp32, and on an FP8 GPU the FP8 kernels against
the emulation."""

import pytest
import torch
from conftest import MIXTRAL_CPU

from dtrain import load_config
from dtrain.config import FP8Config
from dtrain.models import build
from dtrain.models.grouped_gemm import grouped_linear, pad_groups, rowwise_fp8, unpad_groups
from dtrain.models.moe import GroupedExperts, grouped_swiglu, looped_swiglu
from dtrain.parallel.fp8 import convert_to_fp8
from dtrain.step_weights.copies import step_copy
from dtrain.trainer import Trainer


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_groups_are_padded_to_16_rows_on_the_device_and_come_back_in_order():
    x = torch.arange(30 * 4, dtype=torch.float32).view(30, 4) + 1  # no zero rows
    counts = torch.tensor([5, 0, 20, 3])  # 28 rows routed, 2 past the end (dropped)
    padded, ends, dest = pad_groups(x, counts)
    assert padded.shape == (96, 4)  # 30 + 4 * 15 rows rounded up to 16, whatever the counts
    assert ends.tolist() == [16, 16, 48, 64] and ends.dtype == torch.int32
    starts = [0, 16, 16, 48]
    for e, (start, n) in enumerate(zip(starts, counts.tolist(), strict=True)):
        first = sum(counts[:e].tolist())
        assert torch.equal(padded[start:start + n], x[first:first + n])
        assert not padded[start + n:ends[e]].any()  # zeros up to the group's end
    assert not padded[64:].any()  # the two dropped rows are zeros past the last group
    back = unpad_groups(padded, dest, counts)
    assert torch.equal(back[:28], x[:28]) and not back[28:].any()


def test_rowwise_fp8_rounds_to_e4m3_with_power_of_two_row_scales():
    t = torch.randn(6, 32) * torch.logspace(-3, 3, 6).unsqueeze(1)
    bits, inverse = rowwise_fp8(t)
    assert bits.dtype == torch.float8_e4m3fn and inverse.shape == (6,)
    scale = torch.exp2(torch.floor(torch.log2(448 / t.abs().amax(-1))))
    assert torch.equal(inverse, scale.reciprocal())
    q = bits.float() * inverse.unsqueeze(1)
    assert 1e-3 < rel(q, t) < 2 ** -4


def test_fp8_grouped_linear_is_close_to_fp32_in_value_and_gradients():
    # The forward and input gradient in (emulated) FP8, the weight gradient in the input's dtype.
    torch.manual_seed(0)
    counts = torch.tensor([96, 0, 160, 64])
    a = torch.randn(320, 64, requires_grad=True)
    w = torch.randn(4, 128, 64, requires_grad=True)
    ends = torch.cumsum(counts, 0).to(torch.int32)
    upstream = torch.randn(320, 128)
    got = grouped_linear(a, w, ends, "fp8_emulated")
    want = torch._grouped_mm(a, w.transpose(-2, -1), offs=ends)
    (grad_a, grad_w), (want_a, want_w) = (torch.autograd.grad(out, (a, w), upstream)
                                          for out in (got, want))
    # e4m3 on both operands: a few percent, never exact
    assert 1e-3 < rel(got, want) < 0.1 and 1e-3 < rel(grad_a, want_a) < 0.1
    assert rel(grad_w, want_w) < 1e-5  # fp32 operands: the exact product
    assert not grad_w[1].any()  # the empty group's weight gets no gradient


@pytest.mark.parametrize("counts", [[100, 250, 0, 250], [37, 1, 500, 62]],
                         ids=["even", "unaligned"])
def test_fp8_swiglu_follows_the_bf16_one(counts):
    torch.manual_seed(0)
    counts = torch.tensor(counts)
    x = torch.randn(600, 256).bfloat16().requires_grad_()
    w1, w3 = (torch.randn(4, 512, 256) * 0.05).requires_grad_(), torch.randn(4, 512, 256) * 0.05
    w2 = (torch.randn(4, 256, 512) * 0.05).requires_grad_()
    upstream = torch.randn(600, 256).bfloat16()
    got = grouped_swiglu(x, counts, w1, w2, w3, "fp8_emulated")
    want = looped_swiglu(x, counts, *(w.bfloat16() for w in (w1, w2, w3)))
    assert got.dtype == torch.bfloat16
    assert 1e-3 < rel(got, want) < 0.1
    for g, r in zip(torch.autograd.grad(got, (x, w1, w2), upstream),
                    torch.autograd.grad(want, (x, w1, w2), upstream), strict=True):
        assert 1e-3 < rel(g, r) < 0.1


def test_conversion_puts_every_mixtral_experts_module_in_fp8():
    model = build("mixtral_debug", device="meta")
    converted, kept, experts = convert_to_fp8(model, FP8Config(enabled=True, emulate=True),
                                              fsdp=False)
    assert experts == [f"layers.{i}.feed_forward.experts" for i in range(4)]
    assert all(m.fp8 == "fp8_emulated" for m in model.modules() if isinstance(m, GroupedExperts))
    _, _, none = convert_to_fp8(build("mixtral_debug", device="meta"),
                                FP8Config(enabled=True, emulate=True, experts=False), fsdp=False)
    assert none == []


MIXTRAL = MIXTRAL_CPU


def test_mixtral_with_fp8_experts_trains_like_fp32(tmp_path, monkeypatch):
    # Emulated FP8 everywhere (attention linears and experts) against fp32: losses within 1%
    # over 4 steps, not equal, and the experts' FP8 products were the ones computed.
    from dtrain.models import grouped_gemm

    products = []
    fp8_product = grouped_gemm.fp8_product
    monkeypatch.setattr(grouped_gemm, "fp8_product",
                        lambda *args: products.append(1) or fp8_product(*args))
    runs = {}
    for name, changes in (("fp8", {"fp8.enabled": True, "fp8.emulate": True}), ("fp32", {})):
        trainer = Trainer(load_config("debug", {**MIXTRAL, **changes,
                                                "job.output_dir": str(tmp_path / name)}))
        runs[name] = [r["loss"] for r in trainer.train()]
    # 3 forward and 3 input-gradient products x 2 layers x 2 micro-batches x 4 steps
    assert len(products) == 6 * 2 * 2 * 4
    assert runs["fp8"] == pytest.approx(runs["fp32"], rel=1e-2)
    assert runs["fp8"] != runs["fp32"]


@pytest.mark.parametrize("changes", [{"model.moe_gemm": "grouped"},
                                     {"fp8.enabled": True, "fp8.emulate": True}],
                         ids=["grouped", "fp8"])
def test_expert_weights_cast_once_per_step_train_exactly_as_casting_in_each_forward(
        tmp_path, changes):
    # The step's cast weights are the same values as each forward's cast: the same losses,
    # gradient norms and weights, bit for bit. With the step cast every training forward of the
    # experts finds the step's weights; without it none does.
    runs = {}
    for once in (True, False):
        trainer = Trainer(load_config("debug", {
            **MIXTRAL, **changes, "model.moe_cast_weights_once_per_step": once,
            "job.output_dir": str(tmp_path / str(once))}))
        seen = []
        for m in trainer.model.modules():
            if isinstance(m, GroupedExperts):
                m.register_forward_pre_hook(
                    lambda module, args, seen=seen: seen.append(step_copy(module) is not None))
        records = trainer.train()
        weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        runs[once] = ([(r["loss"], r["grad_norm"]) for r in records], weights, seen)
    (step_records, step_weights, step_seen), (records, weights, seen) = runs[True], runs[False]
    assert len(step_seen) == 2 * 2 * 4 and all(step_seen) and not any(seen)
    assert step_records == records
    assert all(torch.equal(step_weights[k], weights[k]) for k in weights)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs an sm90 GPU (the FP8 grouped GEMM); its output is in "
                           "docs/benchmarks.md")
def test_fp8_grouped_swiglu_on_the_gpu_matches_the_emulation():
    torch.manual_seed(0)
    counts = torch.tensor([300, 0, 1000, 746, 1, 15, 1, 0]).cuda()  # 2 of 2065 rows dropped
    x = torch.randn(2065, 512, device="cuda").bfloat16().requires_grad_()
    ws = [(torch.randn(8, 1024, 512, device="cuda") * 0.05).requires_grad_(),
          (torch.randn(8, 512, 1024, device="cuda") * 0.05).requires_grad_(),
          (torch.randn(8, 1024, 512, device="cuda") * 0.05).requires_grad_()]
    upstream = torch.randn(2065, 512, device="cuda").bfloat16()
    got = grouped_swiglu(x, counts, *ws, "fp8")
    got_grads = torch.autograd.grad(got, (x, *ws), upstream)
    cpu = [t.detach().cpu().requires_grad_() for t in (x, *ws)]
    want = grouped_swiglu(cpu[0], counts.cpu(), *cpu[1:], "fp8_emulated")
    want_grads = torch.autograd.grad(want, cpu, upstream.cpu())
    assert got.dtype == torch.bfloat16 and not got[-2:].any()
    assert rel(got.cpu(), want) < 0.02
    for g, w in zip(got_grads, want_grads, strict=True):
        assert rel(g.cpu(), w) < 0.02
