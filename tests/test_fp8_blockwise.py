"""Blockwise FP8 (``fp8.recipe = "blockwise"``, DeepSeek-V3's recipe), emulated on the CPU: the
quantiser against a tile-by-tile reference, the linear's three products against the same
products of the dequantised operands and against fp32, an outlier confined to its own tile,
which linears convert and what the start-up line says, training against fp32, the refusals,
and two FSDP processes against one."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    BASE,
    as_if_on_gpu,
    assert_converted_model_initialises_as_built,
    run_distributed,
)
from torch import nn

from dtrain import Trainer, load_config
from dtrain.config import ConfigError, FP8Config
from dtrain.kernels.blockwise_mm import dequantize, quantize_blocks, quantize_tiles
from dtrain.log import setup_logging
from dtrain.models import build
from dtrain.models.moe import GroupedExperts
from dtrain.parallel import fp8_blockwise as blockwise_module
from dtrain.parallel.fp8 import check_fp8, convert_to_fp8, describe_fp8, fp8_all_gather
from dtrain.parallel.fp8_blockwise import BlockwiseLinear, blockwise_linear
from dtrain.run import feature_lines

E4M3 = torch.float8_e4m3fn


def blockwise(**changes) -> FP8Config:
    return FP8Config(**{"enabled": True, "recipe": "blockwise", "emulate": True, **changes})


# ---- A reference written out group by group ------------------------------------------------


def cast_group(group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One tile or block as torchao's blockwise kernels cast it: the factor 448 / amax as a
    Python (fp64) quotient rounded to fp32, the values times it saturated to +-448 and cast to
    e4m3, and the factor's fp32 reciprocal as the scale (about amax / 448)."""
    amax = max(group.abs().max().item(), 1e-12)
    factor = torch.tensor(448.0 / amax, dtype=torch.float32)
    bits = (group.float() * factor).clamp(-448.0, 448.0).to(E4M3)
    return bits, torch.tensor(1.0, dtype=torch.float32) / factor


def reference_tiles(t: torch.Tensor) -> torch.Tensor:
    """``t`` (rows, cols) cast in 1x128 tiles along its rows and dequantised, tile by tile."""
    out = torch.empty(t.shape)
    for row in range(t.shape[0]):
        for start in range(0, t.shape[1], 128):
            bits, scale = cast_group(t[row, start:start + 128])
            out[row, start:start + 128] = bits.float() * scale
    return out


def reference_blocks(w: torch.Tensor) -> torch.Tensor:
    """``w`` cast in 128x128 blocks and dequantised, block by block."""
    out = torch.empty(w.shape)
    for r in range(0, w.shape[0], 128):
        for c in range(0, w.shape[1], 128):
            bits, scale = cast_group(w[r:r + 128, c:c + 128])
            out[r:r + 128, c:c + 128] = bits.float() * scale
    return out


def spread(rows: int, cols: int, dtype=torch.float32) -> torch.Tensor:
    """Normal values with a magnitude of its own per 64 columns (1e-4 to 1e4), one zero tile."""
    g = torch.Generator().manual_seed(rows * cols)
    t = torch.randn(rows, cols, generator=g)
    t *= 10.0 ** torch.randint(-4, 5, (rows, math.ceil(cols / 64)), generator=g).repeat_interleave(
        64, dim=1)[:, :cols]
    t[0, :128] = 0
    return t.to(dtype)


# ---- (a) the quantiser ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiles_are_the_tile_by_tile_reference_bit_for_bit(dtype):
    # 300 columns: two whole tiles and a partial one (the weight gradient's token tiles can be).
    t = spread(6, 300, dtype)
    bits, scales = quantize_tiles(t)
    assert bits.dtype == E4M3 and bits.shape == t.shape and scales.shape == (6, 3)
    for row in range(6):
        for j, start in enumerate(range(0, 300, 128)):
            want_bits, want_scale = cast_group(t[row, start:start + 128])
            got = bits[row, start:start + 128]
            assert torch.equal(got.view(torch.uint8), want_bits.view(torch.uint8)), (row, j)
            assert scales[row, j] == want_scale, (row, j)
    assert torch.equal(dequantize(bits, scales), reference_tiles(t))
    # Each non-zero tile reaches e4m3's largest value: the scale is the tile's amax / 448.
    tile_max = bits.float().abs()[:, :256].view(6, 2, 128).amax(-1)
    assert (tile_max[1:] == 448).all() and (tile_max[0, 0] == 0) and tile_max[0, 1] == 448
    amax = t.float()[:, :256].abs().view(6, 2, 128).amax(-1)[1:]
    assert torch.allclose(scales[1:, :2], amax / 448, rtol=1e-6, atol=0)
    # As torchao's kernels, not rounded to powers of two (Transformer Engine's default is).
    mantissas, _ = torch.frexp(scales[1:])
    assert (mantissas != 0.5).any()


def test_blocks_are_the_block_by_block_reference_bit_for_bit():
    w = spread(384, 256)
    bits, scales = quantize_blocks(w)
    assert bits.dtype == E4M3 and bits.shape == w.shape and scales.shape == (3, 2)
    for i in range(3):
        for j in range(2):
            want_bits, want_scale = cast_group(w[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)])
            got = bits[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
            assert torch.equal(got.view(torch.uint8), want_bits.view(torch.uint8)), (i, j)
            assert scales[i, j] == want_scale, (i, j)
    assert torch.equal(dequantize(bits, scales), reference_blocks(w))


# ---- (b) the emulated linear ---------------------------------------------------------------


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def products(x, w, dy):
    """``blockwise_linear``'s output and input and weight gradients, and fp32's."""
    results = []
    for fn in (blockwise_linear, F.linear):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(xi, wi)
        out.backward(dy)
        results.append((out.detach(), xi.grad, wi.grad))
    return results


def test_the_linear_s_products_are_those_of_the_dequantised_operands():
    # 2 x 96 = 192 tokens: the weight gradient's token tiles are one whole and one partial.
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 96, 256, generator=g), 0.05 * torch.randn(384, 256, generator=g)
    dy = torch.randn(2, 96, 384, generator=g)
    (out, dx, dw), (out32, dx32, dw32) = products(x, w, dy)
    x2, dy2 = x.reshape(-1, 256), dy.reshape(-1, 384)
    # forward: x in 1x128 tiles along its features, W in 128x128 blocks
    want_out = F.linear(reference_tiles(x2), reference_blocks(w)).view(2, 96, 384)
    # input gradient: dy in 1x128 tiles along the output features, W in the same blocks
    want_dx = F.linear(reference_tiles(dy2), reference_blocks(w).t()).view(2, 96, 256)
    # weight gradient: dy and x both in tiles of 128 tokens (the product's sum)
    want_dw = F.linear(reference_tiles(dy2.t()), reference_tiles(x2.t()))
    # the same fp32 values, multiplied by another BLAS call: a few ulps apart at most
    for got, want in ((out, want_out), (dx, want_dx), (dw, want_dw)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    # e4m3 keeps 3 mantissa bits: rounding to nearest errs by at most 2^-4 relative, about
    # 2.5% RMS on normal data, and each product has two rounded operands: about 3.5% relative
    # (measured 3.7%, 3.7% and 3.6%). Above 1% shows the operands were cast at all.
    for got, want in ((out, out32), (dx, dx32), (dw, dw32)):
        assert 0.01 < rel(got, want) < 0.06


def test_under_autocast_the_output_is_the_fp32_product_rounded_once():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(4, 256, generator=g), torch.randn(128, 256, generator=g)
    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = blockwise_linear(xi, wi)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, blockwise_linear(x, w).to(torch.bfloat16))
    out.float().sum().backward()
    assert xi.grad.dtype == wi.grad.dtype == torch.float32


def test_an_outlier_coarsens_its_own_tile_only():
    # The point of blockwise over tensorwise scaling: a value 1e5 times the others' scale
    # sets its group's scale, 1e5 / 448. Blockwise, that group is one 1x128 tile: every other
    # tile is cast exactly as without the outlier (about 2.5% error, measured at most 3.0%).
    # Tensorwise (one scale for the whole tensor, as torchao's tensorwise recipe), every value
    # is rounded to e4m3's subnormal step 2^-9, 0.44 in the data's units: about 13% error on
    # unit normal values (0.44 / sqrt(12); measured 10.7% to 14.7% per tile), as in the
    # outlier's own tile under blockwise scaling.
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 512, generator=g)
    spiked = x.clone()
    spiked[3, 200] = 1e5  # row 3, tile 1

    def tile_errors(cast: torch.Tensor, of: torch.Tensor) -> torch.Tensor:
        return ((cast - of).view(8, 4, 128).norm(dim=-1) / of.view(8, 4, 128).norm(dim=-1))

    clean = dequantize(*quantize_tiles(x))
    blockwise_cast = dequantize(*quantize_tiles(spiked))
    tensorwise_cast = reference_whole_tensor(spiked)
    others = torch.ones(8, 4, dtype=torch.bool)
    others[3, 1] = False
    outside = others.repeat_interleave(128, dim=1)
    assert torch.equal(blockwise_cast[outside], clean[outside])
    blockwise_errors = tile_errors(blockwise_cast, spiked)
    assert blockwise_errors[others].max() < 0.04
    spiked_tile = spiked[3, 128:256].clone()
    cast_tile = blockwise_cast[3, 128:256].clone()
    spiked_tile[72] = cast_tile[72] = 0  # the rest of the outlier's own tile: coarse
    assert rel(cast_tile, spiked_tile) > 0.08
    assert tile_errors(tensorwise_cast, spiked)[others].min() > 0.08
    # In the linear: the output rows of the other tokens are those without the outlier.
    w = torch.randn(128, 512, generator=g)
    rows = torch.arange(8) != 3
    assert torch.equal(blockwise_linear(spiked, w)[rows], blockwise_linear(x, w)[rows])


def reference_whole_tensor(t: torch.Tensor) -> torch.Tensor:
    bits, scale = cast_group(t)
    return bits.float() * scale


# ---- (c) conversion ------------------------------------------------------------------------

ATTENTION = ("wq", "wk", "wv", "wo")
FEED_FORWARD = ("w1", "w2", "w3")
KEPT_LINE = ("kept in bf16: " + ", ".join(
    f"layers.*.feed_forward.{n} x4 (widths not multiples of 128, a bias, or a shared weight)"
    for n in FEED_FORWARD) + ", output (fp8.filter_fqns)")


def test_the_debug_model_converts_its_attention_and_keeps_the_704_wide_feed_forward():
    # dim 256: q, k, v and o are 256 or 128 wide, whole 128x128 blocks; the feed-forward's
    # hidden width, 704 (a multiple of 64, not of 128), keeps w1, w2 and w3 in bf16.
    model = build("llama3_debug", device="meta")
    cfg = blockwise()
    layers = convert_to_fp8(model, cfg, fsdp=False)
    converted, kept, experts = layers
    assert converted == [f"layers.{i}.attention.{n}" for i in range(4) for n in ATTENTION]
    assert kept == [f"layers.{i}.feed_forward.{n}" for i in range(4)
                    for n in FEED_FORWARD] + ["output"]
    assert experts == []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            assert type(module) is (BlockwiseLinear if name in converted else nn.Linear), name
            assert module.weight.device.type == "meta"
    assert describe_fp8(cfg, layers, all_gather=False) == (
        "fp8: torchao blockwise (e4m3, 1x128 activation and gradient tiles, 128x128 weight "
        f"blocks, emulated) | 16 linear layers in FP8 | {KEPT_LINE}")


def test_the_output_layer_converts_when_no_filter_keeps_it():
    model = build("llama3_debug", device="meta", n_layers=1)
    converted, kept, _ = convert_to_fp8(model, blockwise(filter_fqns=[]), fsdp=False)
    assert "output" in converted and type(model.output) is BlockwiseLinear
    assert kept == [f"layers.0.feed_forward.{n}" for n in FEED_FORWARD]


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(256, 128)
        self.whole = nn.Linear(128, 256, bias=False)
        self.sixteens = nn.Linear(128, 144, bias=False)  # FP8 for the other recipes
        self.biased = nn.Linear(128, 128)                # torchao's blockwise layer has none
        self.tied = nn.Linear(128, 256, bias=False)
        self.tied.weight = self.embed.weight


def test_partial_blocks_biases_and_shared_weights_stay_and_weights_are_kept():
    model = Toy()
    weight = model.whole.weight
    converted, kept, _ = convert_to_fp8(model, blockwise(filter_fqns=[]), fsdp=False)
    assert converted == ["whole"] and kept == ["sixteens", "biased", "tied"]
    assert model.whole.weight is weight and model.tied.weight is model.embed.weight
    assert list(model.whole.state_dict()) == ["weight"]


def test_the_blockwise_model_initialises_to_the_same_weights():
    assert_converted_model_initialises_as_built(
        lambda model: convert_to_fp8(model, blockwise(), fsdp=False))


# ---- (d) training --------------------------------------------------------------------------

RUN = {**BASE, "training.device": "cpu", "training.micro_batch_size": 4, "training.steps": 6}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_emulated_blockwise_trains_as_the_same_run_without_fp8(tmp_path, precision):
    # 6 steps of the 2-block debug model, each step 8 sequences of 64 tokens, in fp32 and on
    # bf16 autocast, with and without blockwise FP8 (the attention's 8 linears; the 704-wide
    # feed-forward stays). Each FP8 product errs by about 3.6% (test above), but the 512
    # tokens' errors average out in the loss: measured at most 4.9e-4 (fp32) and 5.3e-4 (bf16)
    # relative, where bf16 and fp32 differ by 1.4e-4; 2e-3 leaves four times that.
    runs = {}
    for fp8 in (False, True):
        overrides = {**RUN, "training.mixed_precision": precision, "fp8.enabled": fp8,
                     "fp8.recipe": "blockwise", "fp8.emulate": True,
                     "job.output_dir": str(tmp_path / str(fp8))}
        trainer = Trainer(load_config("debug", overrides))
        forwards = []
        for module in trainer.model.modules():
            if isinstance(module, BlockwiseLinear):
                module.register_forward_hook(lambda *args, seen=forwards: seen.append(1))
        if fp8:
            (line,) = [line for line in feature_lines(trainer) if line.startswith("fp8:")]
            assert line.startswith("fp8: torchao blockwise (e4m3, 1x128") and "8 linear" in line
        runs[fp8] = [r["loss"] for r in trainer.train()], len(forwards)
    (plain, none), (fp8_losses, forwards) = runs[False], runs[True]
    assert none == 0 and forwards == 8 * 2 * 6  # 8 linears, 2 micro-batches, 6 steps
    assert all(math.isfinite(loss) for loss in fp8_losses)
    assert fp8_losses[-1] < fp8_losses[0] - 0.5
    assert fp8_losses == pytest.approx(plain, rel=2e-3)
    assert fp8_losses != plain



# ---- (e) refusals --------------------------------------------------------------------------


def test_transformer_engine_has_no_blockwise_recipe_here():
    with pytest.raises(ConfigError, match=(
            r"^fp8.recipe = 'blockwise' is torchao's \(Transformer Engine's Float8BlockScaling "
            r"is not wired in\): set fp8.backend = 'torchao', or use one of delayed, current$")):
        load_config(overrides=["--fp8.backend=te", "--fp8.recipe=blockwise"])
    assert load_config(overrides=["--fp8.recipe=blockwise"]).fp8.recipe == "blockwise"


def test_tensor_parallel_is_refused():
    message = (r"^fp8.recipe = 'blockwise' runs without tensor parallel \(its linears are not "
               r"DTensor-aware\): set parallel.tp = 1, or use fp8.recipe = 'rowwise'$")
    with pytest.raises(ConfigError, match=message):
        check_fp8(blockwise(), torch.device("cpu"), tp=2)
    check_fp8(blockwise(), torch.device("cpu"), tp=1)


def test_gpus_older_than_hopper_are_refused_and_hopper_passes(monkeypatch):
    as_if_on_gpu(monkeypatch, "NVIDIA L40S", (8, 9))
    with pytest.raises(ConfigError, match=(
            r"^fp8.recipe = 'blockwise' needs GPUs of compute capability 9.0 or newer "
            r"\(its blockwise GEMMs\) but NVIDIA L40S has 8.9: use fp8.recipe = 'rowwise'$")):
        check_fp8(blockwise(emulate=False), torch.device("cuda", 0), tp=1)
    check_fp8(blockwise(emulate=False, recipe="rowwise"), torch.device("cuda", 0), tp=1)
    check_fp8(blockwise(), torch.device("cuda", 0), tp=1)  # emulated: any GPU
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8(blockwise(emulate=False), torch.device("cuda", 0), tp=1, tokens=8192)
    monkeypatch.setattr(blockwise_module, "blockwise_gemm_works", lambda device: True)
    check_fp8(blockwise(emulate=False, blockwise_gemm="cublaslt"), torch.device("cuda", 0),
              tp=1, tokens=8192)


def test_a_gpu_whose_cublaslt_lacks_blockwise_gemms_is_refused_for_that_choice(monkeypatch):
    as_if_on_gpu(monkeypatch)
    monkeypatch.setattr(blockwise_module, "blockwise_gemm_works", lambda device: False)
    with pytest.raises(ConfigError, match=(
            r"^fp8.blockwise_gemm = 'cublaslt' needs cuBLASLt's blockwise-scaled FP8 GEMM .* "
            r"which does not run on NVIDIA H200 with torch .*: use fp8.blockwise_gemm = "
            r"'triton'$")):
        check_fp8(blockwise(emulate=False, blockwise_gemm="cublaslt"), torch.device("cuda", 0),
                  tp=1)
    check_fp8(blockwise(emulate=False), torch.device("cuda", 0), tp=1)  # torchao's GEMMs


def test_tokens_per_micro_batch_the_gpu_gemms_cannot_sum_over_are_refused(monkeypatch):
    as_if_on_gpu(monkeypatch)
    monkeypatch.setattr(blockwise_module, "blockwise_gemm_works", lambda device: True)
    cuda = torch.device("cuda", 0)
    with pytest.raises(ConfigError, match=(
            r"^fp8.recipe = 'blockwise' needs the tokens of a micro-batch \(training.micro_"
            r"batch_size x training.seq_len / parallel.cp = 1000\) to be a multiple of 128 on "
            r"the GPU \(the weight gradient's FP8 GEMM sums over them in 128-token tiles\)")):
        check_fp8(blockwise(emulate=False), cuda, tp=1, tokens=1000)
    with pytest.raises(ConfigError, match=r"= 1000\) to be a multiple of 16 on the GPU"):
        check_fp8(blockwise(emulate=False, blockwise_gemm="cublaslt"), cuda, tp=1, tokens=1000)
    check_fp8(blockwise(emulate=False, blockwise_gemm="cublaslt"), cuda, tp=1, tokens=1008)
    check_fp8(blockwise(), cuda, tp=1, tokens=1000)  # emulated: any count


def test_the_cpu_without_emulation_is_refused_as_for_every_recipe():
    with pytest.raises(ConfigError, match=r"^fp8.enabled = true needs CUDA GPUs .* this run is "
                                          r"on the CPU: set fp8.enabled = false$"):
        check_fp8(blockwise(emulate=False), torch.device("cpu"), tp=1)


def test_under_fsdp_the_weights_are_gathered_in_high_precision():
    # FP8 all-gather is tensorwise's (as for rowwise): its default does not apply here.
    model = build("llama3_debug", device="meta")
    converted, _, _ = convert_to_fp8(model, blockwise(), fsdp=True)
    assert len(converted) == 16
    assert not fp8_all_gather(blockwise(), fsdp=True)


def test_the_experts_take_the_recipe_or_stay_in_bf16_and_are_named(monkeypatch):
    model = build("mixtral_debug", device="meta", n_layers=2)  # experts 256 x 256: whole blocks
    cfg = blockwise()
    layers = convert_to_fp8(model, cfg, fsdp=False)
    converted, kept, experts = layers
    assert converted == [f"layers.{i}.attention.{n}" for i in range(2) for n in ATTENTION]
    assert experts == ["layers.0.feed_forward.experts", "layers.1.feed_forward.experts"]
    assert all(m.fp8 == "blockwise_emulated" for m in model.modules()
               if isinstance(m, GroupedExperts))
    assert kept == ["layers.0.feed_forward.router.gate", "layers.1.feed_forward.router.gate",
                    "output"]
    assert describe_fp8(cfg, layers, all_gather=False).startswith(
        "fp8: torchao blockwise (e4m3, 1x128 activation and gradient tiles, 128x128 weight "
        "blocks, emulated) | 8 linear layers in FP8, the experts of 2 MoE layers (blockwise) |")
    # Not emulated (a GPU, as far as the conversion can tell) where the kernels pass their
    # check: the Triton grouped GEMMs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(blockwise_module, "gpu_kernels_failure", lambda device: None)
    model = build("mixtral_debug", device="meta", n_layers=2)
    convert_to_fp8(model, blockwise(emulate=False, blockwise_gemm="cublaslt"), fsdp=False)
    assert [m.fp8 for m in model.modules() if isinstance(m, GroupedExperts)] == ["blockwise"] * 2
    monkeypatch.undo()
    # fp8.experts = false keeps them, as do widths that are not whole blocks (192 here)
    for model, cfg in ((build("mixtral_debug", device="meta", n_layers=2),
                        blockwise(experts=False)),
                       (build("mixtral_debug", device="meta", n_layers=2, moe_hidden_size=192),
                        blockwise())):
        layers = convert_to_fp8(model, cfg, fsdp=False)
        assert layers[2] == [] and all(m.fp8 is None for m in model.modules()
                                       if isinstance(m, GroupedExperts))
        assert describe_fp8(cfg, layers, all_gather=False).endswith(
            "layers.*.feed_forward.experts x2 (widths not multiples of 128, fp8.experts off, or "
            "the GPU kernels' check failed)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernels pass their check on a GPU: "
                    "the failure is caused for real where there is none")
def test_experts_whose_gpu_kernels_fail_their_check_stay_in_bf16_and_a_warning_says_why(
        monkeypatch, capsys):
    # A "GPU" the kernels cannot run on (this machine has none: the check's products fail for
    # real); the linears go to cuBLASLt's blockwise GEMMs, converted on the meta device.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    setup_logging(0)
    model = build("mixtral_debug", device="meta", n_layers=2)
    layers = convert_to_fp8(model, blockwise(emulate=False, blockwise_gemm="cublaslt"),
                            fsdp=False)
    assert layers[2] == [] and all(m.fp8 is None for m in model.modules()
                                   if isinstance(m, GroupedExperts))
    assert layers[1][-2:] == ["layers.0.feed_forward.experts", "layers.1.feed_forward.experts"]
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("fp8: the experts stay in bf16: dtrain's blockwise grouped GEMMs "
                           "failed their check on this GPU (") and "fp8.experts = false" in line


# ---- (f) FSDP ------------------------------------------------------------------------------

FSDP_RUN = {**BASE, "fp8.enabled": True, "fp8.recipe": "blockwise", "fp8.emulate": True}


def test_two_fsdp_processes_train_as_one(tmp_path):
    # BASE: micro-batches of one 64-token sequence, 8 a step in one process, 4 a rank in two.
    # Every FP8 group lies within one micro-batch: the 1x128 tiles of x and dy within a token,
    # the weight gradient's token tiles within the micro-batch's 64 tokens, the weights' blocks
    # cast from the whole gathered weight. The micro-batches' loss scales (1/8, or 1/4 then
    # FSDP's mean over 2) differ by powers of two, which the casts carry exactly. So the first
    # step, from the same weights, differs only in the order of fp32 sums (measured: the same
    # loss and gradient norm). After it, the weights differ in their last bits, which tips a
    # few e4m3 roundings (2^-4 relative each): measured 1.2e-5 relative on the loss and 1.8e-4
    # on the gradient norm by step 6, where FP8 and fp32 differ by 5e-4 on the loss; in fp32
    # the two layouts differ by 1e-7.
    (run,) = run_distributed(tmp_path / "fsdp", 2, [{**FSDP_RUN,
                                                     "job.output_dir": str(tmp_path / "fsdp")}])
    one = Trainer(load_config("debug", {**FSDP_RUN, "job.output_dir": str(tmp_path / "one")}))
    reference = one.train()
    assert run["init_ok"]
    first, want = run["history"][0], reference[0]
    assert first["loss"] == pytest.approx(want["loss"], rel=1e-6)
    assert first["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-6)
    for got, want in zip(run["history"], reference, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4), want["step"]
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-3), want["step"]
