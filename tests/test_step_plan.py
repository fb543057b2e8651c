"""Which weights ``dtrain.step_weights`` casts once per step, decided from one ``StepPlan``: each
setting of the plan turns the variants it concerns on or off, and each variant's layers keep
their step copy in the one slot ``step_copy`` reads."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dtrain.models import Transformer, model_args
from dtrain.step_weights import StepPlan, step_weight_hooks
from dtrain.step_weights.copies import step_copy

BF16 = StepPlan(compute_dtype=torch.bfloat16, micro_batches=4, autocast=True,
                whole_weights=True, pipeline=False)


def mixtral(gemm: str = "grouped") -> Transformer:
    args = dataclasses.replace(model_args("mixtral_debug", n_layers=2), moe_gemm=gemm)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights(0)
    return model


def variants(plan: StepPlan, gemm: str = "grouped") -> dict[str, int]:
    return {type(hook).__name__: len(hook.layers)
            for hook in step_weight_hooks([mixtral(gemm)], plan)}


def test_the_whole_plan_casts_linears_embedding_and_experts():
    # 2 blocks x (4 attention projections + router) + the output layer; one table; 2 MoE layers
    assert variants(BF16) == {"StepLinearWeights": 11, "StepEmbeddingGrads": 1,
                              "StepExpertWeights": 2}


@pytest.mark.parametrize(("change", "left"), [
    ({"micro_batches": 1}, {"StepExpertWeights": 2}),  # nothing to reuse in a bf16 copy
    ({"autocast": False}, {"StepExpertWeights": 2}),  # FSDP casts the weights itself
    ({"whole_weights": False}, {"StepLinearWeights": 11, "StepEmbeddingGrads": 1}),
    ({"pipeline": True}, {}),  # the schedules run the micro-batches' backwards apart
    ({"linears": False}, {"StepExpertWeights": 2}),
    ({"experts": False}, {"StepLinearWeights": 11, "StepEmbeddingGrads": 1}),
], ids=["one-micro-batch", "no-autocast", "sharded", "pipeline", "no-linears", "no-experts"])
def test_each_setting_of_the_plan_turns_its_variants_off(change, left):
    assert variants(dataclasses.replace(BF16, **change)) == left


def test_looped_experts_are_not_cast_once_per_step():
    assert "StepExpertWeights" not in variants(BF16, gemm="loop")


def test_every_variant_keeps_its_copy_in_one_slot_for_the_step_only():
    model = mixtral()
    hooks = step_weight_hooks([model], BF16)
    layers = [layer for hook in hooks for layer in hook.layers]
    assert all(step_copy(layer) is None for layer in layers)
    for hook in hooks:
        hook.before_step()
    assert all(step_copy(layer) is not None for layer in layers)
    experts = model.layers["0"].feed_forward.experts
    (w1_operands, w1_grad), *_ = step_copy(experts)
    assert w1_operands[0].dtype == torch.bfloat16 and w1_grad is experts.w1.grad
    for hook in hooks:
        hook.before_update()
    assert all(step_copy(layer) is None for layer in layers)


def test_each_variant_describes_itself_for_the_start_up_summary():
    lines = [hook.describe() for hook in step_weight_hooks([mixtral()], BF16)]
    assert lines == [
        "11 linears cast to bfloat16 once per step, their gradients added into fp32 .grad in "
        "place",
        "1 embedding table's gradients added into fp32 .grad row by row",
        "the experts of 2 MoE layers cast to bfloat16 once per step, their gradients added into "
        "fp32 .grad in place"]
