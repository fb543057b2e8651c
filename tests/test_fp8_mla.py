"""FP8 on DeepSeek-V3's layers: the torchao recipes put multi-head latent attention's
projections, the shared expert and the routed experts in FP8, keep in bf16 the router's gate and
every layer whose widths FP8 cannot take, the start-up line names those, and an emulated FP8 run
(the CPU) trains as bf16 does."""

import dataclasses

import pytest
import torch
from torchao.float8.float8_linear import Float8Linear

from dtrain import Trainer, load_config
from dtrain.config import FP8Config
from dtrain.model_shape import model_args_of
from dtrain.models import Transformer
from dtrain.models.moe import GroupedExperts
from dtrain.parallel.fp8 import convert_to_fp8, describe_fp8
from dtrain.run import feature_lines

# DeepSeek-V3's layout in small (on the debug preset: 256 wide, 8 heads): a compressed query,
# latent keys and values, the first block dense, then 16 sigmoid-routed experts in 4 groups
# with a shared expert. Every width is a multiple of 16 but wkv_a's output, kv_lora_rank +
# qk_rope_head_dim = 32 + 8 = 40, which FP8 cannot take (DeepSeek-V3's own is 512 + 64 = 576).
SHAPE = {"model.n_layers": 2, "model.attention": "mla", "model.q_lora_rank": 32,
         "model.kv_lora_rank": 32, "model.qk_nope_head_dim": 16, "model.qk_rope_head_dim": 8,
         "model.v_head_dim": 16, "model.n_experts": 16, "model.moe_top_k": 2,
         "model.moe_hidden_size": 64, "model.moe_shared_hidden": 64,
         "model.moe_router": "sigmoid", "model.moe_n_group": 4, "model.moe_topk_group": 2,
         "model.moe_routed_scale": 2.5, "model.moe_first_dense_layers": 1}
ATTENTION = ["wq_a", "wq_b", "wkv_b", "wo"]
CONVERTED = ([f"layers.0.attention.{n}" for n in ATTENTION]
             + [f"layers.0.feed_forward.{n}" for n in ("w1", "w2", "w3")]
             + [f"layers.1.attention.{n}" for n in ATTENTION]
             + [f"layers.1.feed_forward.shared_expert.{n}" for n in ("w1", "w2", "w3")])
KEPT = ["layers.0.attention.wkv_a", "layers.1.attention.wkv_a",
        "layers.1.feed_forward.router.gate", "output"]
KEPT_LINE = ("kept in bf16: layers.*.attention.wkv_a x2 (widths not multiples of 16, or a "
             "shared weight), layers.*.feed_forward.router.gate x1 (MoE router), output "
             "(fp8.filter_fqns)")


def meta_model(**changes) -> Transformer:
    args = model_args_of(load_config("debug", SHAPE).model)
    with torch.device("meta"):
        return Transformer(dataclasses.replace(args, **changes))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_latent_attention_and_the_experts_convert_and_the_odd_width_and_router_stay(recipe):
    model = meta_model()
    cfg = FP8Config(enabled=True, emulate=True, recipe=recipe)
    converted, kept, experts = convert_to_fp8(model, cfg, fsdp=False)
    assert converted == CONVERTED and kept == KEPT
    assert experts == ["layers.1.feed_forward.experts"]
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            assert isinstance(module, Float8Linear) == (name in CONVERTED), name
    assert model.layers["1"].feed_forward.experts.fp8 == "fp8_emulated"
    assert describe_fp8(cfg, (converted, kept, experts), all_gather=False) == (
        f"fp8: torchao {recipe} | 14 linear layers in FP8, the experts of 1 MoE layers "
        f"(rowwise) | {KEPT_LINE}")


def test_experts_of_widths_fp8_cannot_take_stay_in_bf16_and_are_named():
    # 40-wide experts: the grouped GEMMs' FP8 operands need multiples of 16. The shared expert
    # of the same width stays too; the query's latent of 24 keeps wq_a and wq_b.
    model = meta_model(moe_hidden_size=40, moe_shared_hidden=40, q_lora_rank=24)
    cfg = FP8Config(enabled=True, emulate=True)
    layers = convert_to_fp8(model, cfg, fsdp=False)
    converted, kept, experts = layers
    assert experts == [] and model.layers["1"].feed_forward.experts.fp8 is None
    assert kept[-1] == "layers.1.feed_forward.experts"
    assert {"layers.1.attention.wq_a", "layers.1.attention.wq_b",
            "layers.1.feed_forward.shared_expert.w2"} <= set(kept)
    line = describe_fp8(cfg, layers, all_gather=False)
    assert "the experts of" not in line
    assert line.endswith(", layers.*.feed_forward.experts x1 (widths not multiples of 16)")
    assert "layers.*.attention.wq_a x2" in line
    assert "layers.*.feed_forward.shared_expert.w1 x1" in line


RUN = {**SHAPE, "training.steps": 6, "training.seq_len": 64, "training.global_batch_size": 4,
       "training.micro_batch_size": 2, "lr_schedule.warmup_steps": 2, "metrics.log_every": 1,
       "metrics.tensorboard": False, "training.mixed_precision": "bf16"}


@pytest.fixture(scope="module")
def bf16_losses(tmp_path_factory) -> list[float]:
    out = tmp_path_factory.mktemp("bf16")
    return [r["loss"] for r in Trainer(load_config("debug", {
        **RUN, "job.output_dir": str(out)})).train()]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_emulated_fp8_trains_as_bf16_does(tmp_path, monkeypatch, bf16_losses, recipe):
    # The same 6 steps in bf16 with and without FP8 (both on bf16 autocast). e4m3 keeps 3
    # mantissa bits (2^-4 relative rounding per operand, about 5% per matmul output), but the
    # errors of the 256 tokens' losses average out: measured at most 5e-4 (tensorwise) and
    # 1.1e-3 (rowwise) relative, where bf16 and fp32 differ by 1.3e-4. 5e-3 leaves room for
    # rounding that tips a routing choice; a layer left out of FP8 would not move the losses,
    # which the inequality and the count of the experts' FP8 products catch.
    from dtrain.models import grouped_gemm

    products = []
    fp8_product = grouped_gemm.fp8_product
    monkeypatch.setattr(grouped_gemm, "fp8_product",
                        lambda *args: products.append(1) or fp8_product(*args))
    trainer = Trainer(load_config("debug", {**RUN, "fp8.enabled": True, "fp8.emulate": True,
                                            "fp8.recipe": recipe,
                                            "job.output_dir": str(tmp_path)}))
    (line,) = [line for line in feature_lines(trainer) if line.startswith("fp8:")]
    assert line.endswith(KEPT_LINE)
    model = trainer.model
    assert all(isinstance(model.get_submodule(name), Float8Linear) for name in CONVERTED)
    assert [m.fp8 for m in model.modules() if isinstance(m, GroupedExperts)] == ["fp8_emulated"]
    losses = [r["loss"] for r in trainer.train()]
    # 3 forward and 3 input-gradient products x 1 MoE layer x 2 micro-batches x 6 steps
    assert len(products) == 6 * 2 * 6
    assert all(0 < loss < 10 for loss in losses) and losses[-1] < losses[0] - 0.3
    assert losses == pytest.approx(bf16_losses, rel=5e-3)
    assert losses != bf16_losses
