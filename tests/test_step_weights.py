"""Weights cast once per step with in-place gradient accumulation (dtrain.step_weights):
bf16 autocast on fp32 weights on the CPU trains bit for bit as autocast's own casts and autograd's
accumulation, and the step's copies are what every micro-batch uses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtrain import Trainer, load_config
from dtrain.kernels.accumulate import (
    LOOPED_VALUES,
    accumulate_each_group,
    accumulate_grouped_matmul,
    accumulate_matmul,
    gemm_accumulates,
    host_ends,
)
from dtrain.step_weights import linears
from dtrain.step_weights.copies import step_copy
from dtrain.step_weights.fp8_cast import add_into_grad
from dtrain.step_weights.linears import (
    EmbeddingInto,
    StepEmbeddingGrads,
    StepLinearWeights,
    step_grad_embeddings,
    step_weight_linears,
)

BF16 = {"training.device": "cpu", "training.mixed_precision": "bf16", "model.n_layers": 2,
        "training.seq_len": 64, "training.global_batch_size": 4, "training.micro_batch_size": 1,
        "training.steps": 3, "metrics.log_every": 1, "metrics.tensorboard": False}


def _hook(trainer: Trainer) -> StepLinearWeights | None:
    return next((h for h in trainer.hooks.hooks if isinstance(h, StepLinearWeights)), None)


def test_casting_once_per_step_trains_exactly_as_autocast_and_autograd(tmp_path, monkeypatch):
    runs = {}
    for once in (True, False):
        trainer = Trainer(load_config("debug", {
            **BF16, "model.cast_weights_once_per_step": once,
            "job.output_dir": str(tmp_path / str(once))}))
        hook = _hook(trainer)
        assert (hook is not None) is once
        tables = next((h.layers for h in trainer.hooks.hooks
                       if isinstance(h, StepEmbeddingGrads)), [])
        assert tables == ([trainer.model.tok_embeddings] if once else [])
        grads_seen, products = {}, []
        if once:
            # 7 linears a block and the output layer; the embedding is no linear
            assert len(hook.layers) == 2 * 7 + 1
            real = linears.accumulate_matmul
            monkeypatch.setattr(linears, "accumulate_matmul",
                                lambda total, a, b, tune, real=real, products=products:
                                products.append(a.dtype) or real(total, a, b, tune))

            def seen(module, args, grads_seen=grads_seen):  # the step's copy in each forward
                weight, grad, tune = step_copy(module)
                assert tune is False  # compile.tune_gemms is off by default
                assert weight.dtype == torch.bfloat16 and grad is module.weight.grad
                grads_seen.setdefault(id(module), []).append(id(grad))

            for linear in hook.layers:
                linear.register_forward_pre_hook(seen)
        history = trainer.train()
        monkeypatch.undo()
        runs[once] = history, [p.detach().clone() for p in trainer.model.parameters()]
        if once:
            # every backward adds its bf16 product into .grad, which is one tensor a step
            assert products == [torch.bfloat16] * (15 * 4 * 3)
            for ids in grads_seen.values():
                steps = [ids[i:i + 4] for i in range(0, 12, 4)]
                assert len(ids) == 12 and all(len(set(s)) == 1 for s in steps)
    (once, w_once), (each, w_each) = runs[True], runs[False]
    assert [(r["loss"], r["grad_norm"]) for r in once] == \
        [(r["loss"], r["grad_norm"]) for r in each]
    assert all(torch.equal(a, b) for a, b in zip(w_once, w_each, strict=True))


@pytest.mark.parametrize("changes", [
    {"training.global_batch_size": 1},  # one micro-batch a step: nothing to reuse
    {"training.mixed_precision": "fp32"},  # no autocast
    {"model.cast_weights_once_per_step": False},
])
def test_step_weights_only_with_autocast_and_accumulation(tmp_path, changes):
    trainer = Trainer(load_config("debug", {**BF16, **changes, "job.output_dir": str(tmp_path)}))
    assert _hook(trainer) is None


def test_tied_and_fp8_weights_are_left_to_autograd():
    tied = nn.Linear(8, 8, bias=False)
    model = nn.ModuleDict({"a": nn.Linear(8, 8), "b": tied, "c": nn.Embedding(8, 8),
                           "d": nn.Linear(8, 8).to(torch.bfloat16)})
    model["c"].weight = tied.weight
    assert step_weight_linears([model]) == [model["a"]]


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a GPU (the CUDA embedding backward); its output is in docs/benchmarks.md"))])
def test_embedding_rows_are_added_into_grad_as_autograd_sums_them(device):
    torch.manual_seed(0)
    table = nn.Embedding(50, 16, device=device)
    batches = [torch.randint(0, 12, (2, 40), device=device) for _ in range(3)]  # repeated tokens
    batches.append(torch.randint(0, 50, (1, 3000), device=device) % 7)  # long runs of a row
    grad_outs = [torch.randn(*tokens.shape, 16, device=device) for tokens in batches]
    for tokens, grad_out in zip(batches, grad_outs, strict=True):  # autograd: dense, then added
        table(tokens).backward(grad_out)
    expected = table.weight.grad
    grad = torch.zeros_like(table.weight)
    for tokens, grad_out in zip(batches, grad_outs, strict=True):
        out = EmbeddingInto.apply(tokens, table.weight, grad)
        assert torch.equal(out, table(tokens))
        out.backward(grad_out)
    assert torch.equal(grad, expected)  # bit for bit
    assert table.weight.grad is expected  # autograd added nothing


def test_only_plain_untied_embeddings_add_their_rows_in_place():
    plain, tied, padded = nn.Embedding(8, 4), nn.Embedding(8, 4), nn.Embedding(8, 4, padding_idx=0)
    output = nn.Linear(4, 8, bias=False)
    output.weight = tied.weight
    model = nn.ModuleDict({"a": plain, "b": tied, "c": output, "d": padded,
                           "e": nn.Embedding(8, 4).to(torch.bfloat16)})
    assert step_grad_embeddings([model]) == [plain]


def test_add_into_grad_copies_first_then_adds_in_place():
    param = nn.Parameter(torch.zeros(2, 3))
    first = torch.ones(3, 2, dtype=torch.bfloat16).t()  # not contiguous
    add_into_grad(param, first)
    grad = param.grad
    assert grad.dtype == torch.float32 and grad.is_contiguous() and torch.equal(grad, first.float())
    add_into_grad(param, torch.full((2, 3), 0.5, dtype=torch.bfloat16))
    assert param.grad is grad and torch.equal(grad, torch.full((2, 3), 1.5))


def test_accumulate_matmul_adds_the_product_in_place_and_compiles():
    total = torch.randn(6, 5)
    a, b = torch.randn(6, 4, dtype=torch.bfloat16), torch.randn(4, 5, dtype=torch.bfloat16)
    expected = total + (a @ b).float()
    accumulate_matmul(total, a, b)
    assert torch.equal(total, expected)

    def step(total, a, b):
        accumulate_matmul(total, a, b)
        return total.sum()

    compiled_total = torch.zeros(6, 5)
    torch.compile(step, fullgraph=True)(compiled_total, a, b)
    assert torch.equal(compiled_total, (a @ b).float())


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a GPU (cuBLAS's accumulating GEMM); its output is in "
                           "docs/benchmarks.md")
def test_on_the_gpu_the_gemm_accumulates_into_the_fp32_gradient():
    torch.manual_seed(0)
    total = torch.randn(512, 256, device="cuda")
    a = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16)
    exact = total + a.double() @ b.double()
    rounded = total + (a @ b).float()  # the product rounded to bf16 first, as autograd sums it
    gemm_accumulates.cache_clear()
    with torch.autocast("cuda", dtype=torch.bfloat16):  # as in training: backward under autocast
        accumulate_matmul(total, a, b)
    assert gemm_accumulates(total.device)
    error, rounded_error = ((t.double() - exact).abs().max() for t in (total, rounded))
    assert error < rounded_error / 4  # summed in fp32: well under bf16's rounding of the product


def _groups(out: int, features: int, counts: list[int], device: str = "cpu"):
    """A stacked fp32 gradient, the output gradient and the rows of ``counts`` groups (with 5
    rows past the last group, which no product may read: NaN), and the groups' int32 ends."""
    rows = sum(counts)
    grad = torch.randn(rows + 5, out, device=device).to(torch.bfloat16)
    a = torch.randn(rows + 5, features, device=device).to(torch.bfloat16)
    grad[rows:], a[rows:] = float("nan"), float("nan")
    ends = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    return torch.randn(len(counts), out, features, device=device), grad, a, ends


def _each_expert(total, grad, a, counts):
    """The reference: each expert's rows, its bf16 product, added in fp32."""
    expected, start = total.clone(), 0
    for e, count in enumerate(counts):
        rows = slice(start, start + count)
        expected[e] += (grad[rows].t() @ a[rows]).float()
        start += count
    return expected


@pytest.mark.parametrize("counts", [[7, 0, 12, 1], [0, 0, 20, 0]])
def test_grouped_weight_gradients_add_each_experts_rows_into_its_gradient(counts):
    torch.manual_seed(0)
    total, grad, a, ends = _groups(24, 40, counts)
    expected = _each_expert(total, grad, a, counts)
    grouped, looped = total.clone(), total.clone()
    accumulate_grouped_matmul(grouped, grad.t(), a, ends)
    accumulate_each_group(looped, grad.t(), a, ends)
    for got in (grouped, looped):  # the rows past the last group (NaN) were not read
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a GPU (cuBLAS's accumulating GEMM); its output is in "
                           "docs/benchmarks.md")
@pytest.mark.parametrize("large", [True, False])
def test_on_the_gpu_large_experts_accumulate_in_their_own_gemms(large):
    torch.manual_seed(0)
    out = LOOPED_VALUES // 1024 if large else 256
    counts = [300, 0, 1000, 52]
    total, grad, a, ends = _groups(out, 1024, counts, "cuda")
    exact = total.double().clone()
    start = 0
    for e, count in enumerate(counts):
        exact[e] += grad[start:start + count].double().t() @ a[start:start + count].double()
        start += count
    rounded = _each_expert(total, grad, a, counts)  # the product rounded to bf16, then added
    gemm_accumulates.cache_clear()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        accumulate_grouped_matmul(total, grad.t(), a, ends)
    error, rounded_error = ((t.double() - exact).abs().max() for t in (total, rounded))
    if large:  # summed in fp32 in each GEMM: well under bf16's rounding of the product
        assert error < rounded_error / 4
    else:  # the grouped GEMM's bf16 product, added
        assert error < 2 * rounded_error


def test_the_groups_ends_are_read_once_per_tensor_and_again_after_a_change():
    ends = torch.tensor([3, 3, 7], dtype=torch.int32)
    first = host_ends(ends)
    assert first == [3, 3, 7] and host_ends(ends) is first  # one read serves the three weights
    ends[1] = 5  # changed in place: read again
    assert host_ends(ends) == [3, 5, 7]
    other = ends.clone()
    assert host_ends(other) == [3, 5, 7] and host_ends(other) is not host_ends(ends)
