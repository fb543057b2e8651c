"""Blockwise FP8 for the MoE experts (``fp8.recipe = "blockwise"`` with ``fp8.experts``): the
grouped GEMMs take DeepSeek-V3's tiles and blocks per expert, and equal each expert's rows put
through the dense blockwise linear on their own, emulated and (on a Hopper GPU) in dtrain's
Triton kernels; a Mixtral-like model trains with them as it does without FP8."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import BASE, INTERPRETED, assert_like_the_emulation

from dtrain import Trainer, load_config
from dtrain.models.moe import GroupedExperts
from dtrain.parallel.fp8_blockwise import blockwise_linear
from dtrain.run import feature_lines


def experts_and_rows(counts: list[int], dim: int = 256, hidden: int = 384, seed: int = 0):
    torch.manual_seed(seed)
    module = GroupedExperts(dim, hidden, len(counts), gemm="grouped")
    for weight in (module.w1, module.w2, module.w3):
        torch.nn.init.normal_(weight, std=dim ** -0.5)
    rows = torch.randn(sum(counts) + 5, dim)  # 5 rows past the groups: no expert's
    rows[: counts[0]] *= 40  # an outlier expert: its tiles must not coarsen the next one's
    return module, rows.requires_grad_(), torch.tensor(counts)


def per_expert(module: GroupedExperts, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Each expert's rows through three dense blockwise linears on their own: the recipe's
    tiles start at the expert's first row, its weights' blocks are its own."""
    outs, start = [], 0
    for e, n in enumerate(counts):
        x = rows[start:start + n]
        if n:
            h = F.silu(blockwise_linear(x, module.w1[e])) * blockwise_linear(x, module.w3[e])
            outs.append(blockwise_linear(h, module.w2[e]))
        start += n
    return F.pad(torch.cat(outs), (0, 0, 0, rows.shape[0] - start))


@pytest.mark.parametrize(("mode", "device"), [
    ("blockwise_emulated", "cpu"),
    # the Triton grouped GEMMs: in the interpreter, and on a GPU
    pytest.param("blockwise", "cpu", marks=pytest.mark.skipif(
        not INTERPRETED, reason="needs Triton installed, for its interpreter (CI installs it)")),
    pytest.param("blockwise", "cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
        reason="needs a Hopper GPU; its output is in docs/benchmarks.md"))])
@pytest.mark.parametrize("counts", [[130, 0, 77, 256], [1, 128, 129, 3]])
def test_the_grouped_gemms_equal_each_expert_on_its_own(counts, mode, device):
    module, rows, counts_t = experts_and_rows(counts)
    module, rows = module.to(device), rows.detach().to(device).requires_grad_()
    counts_t = counts_t.to(device)
    module.fp8 = mode
    got = module(rows, counts_t)
    grad = torch.randn_like(got)
    got_grads = torch.autograd.grad(got, (rows, module.w1, module.w2, module.w3), grad)
    want = per_expert(module, rows, counts)
    want_grads = torch.autograd.grad(want, (rows, module.w1, module.w2, module.w3), grad)
    # The same casts and products; only the order of the fp32 sums differs, which now and then
    # tips an intermediate's e4m3 rounding (2^-4 relative) and moves a few values by up to
    # 3e-4 of the largest: measured 5 of 68,096 outputs emulated. A tipped element of a
    # gradient moves a whole row of the rows' gradient (256 values): in the kernels' order
    # 0.2% of them (one row of 468).
    most_off = 1e-3 if mode == "blockwise_emulated" else 5e-3
    for name, g, w in zip(("out", "rows", "w1", "w2", "w3"), (got, *got_grads),
                          (want, *want_grads), strict=True):
        assert_like_the_emulation(name, g, w, device, most_off)
    # and they are not the plain products: the casts round (in the groups' rows only; the plain
    # GEMM leaves the rows past them unwritten)
    module.fp8 = None
    grouped = sum(counts)
    plain = module(rows, counts_t)[:grouped]
    assert (plain - got[:grouped]).abs().max() > 1e-3 * plain.abs().max()
    assert torch.equal(got[grouped:], torch.zeros_like(got[grouped:]))


RUN = {**BASE, "training.device": "cpu", "training.micro_batch_size": 4}


def test_a_mixtral_like_model_trains_with_blockwise_experts_as_without_fp8(tmp_path):
    # 6 steps of a 2-block Mixtral-like model (8 experts of 256 x 256, top 2), 8 sequences of
    # 64 tokens a step, fp32, with and without blockwise FP8 (the attention's 8 linears and
    # both blocks' experts). Measured: at most 3.3e-4 relative on the loss; 2e-3 leaves 6x.
    runs = {}
    for fp8 in (False, True):
        overrides = {**RUN, "model.n_layers": 2, "fp8.enabled": fp8, "fp8.recipe": "blockwise",
                     "fp8.emulate": True, "job.output_dir": str(tmp_path / str(fp8))}
        trainer = Trainer(load_config("mixtral_debug", overrides))
        if fp8:
            (line,) = [line for line in feature_lines(trainer) if line.startswith("fp8:")]
            assert "the experts of 2 MoE layers (blockwise)" in line, line
        runs[fp8] = [r["loss"] for r in trainer.train()]
    plain, fp8_losses = runs[False], runs[True]
    assert all(math.isfinite(loss) for loss in fp8_losses)
    assert fp8_losses[-1] < fp8_losses[0] - 0.3
    assert fp8_losses == pytest.approx(plain, rel=2e-3)
    assert fp8_losses != plain
