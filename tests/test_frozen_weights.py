"""Weights frozen between ``train()`` calls (``requires_grad_(False)``) stay as they are under the
step hooks that add gradients into ``.grad`` in place (bf16 step weights, the embedding's rows,
the experts' casts, the FP8 step casts): read at each step, a frozen weight gets no ``.grad``,
so AdamW skips it and the clipping norm leaves it out, as autograd does without those hooks;
unfrozen, it trains again."""

from __future__ import annotations

import pytest
import torch

from dtrain import Trainer, load_config
from dtrain.hooks import StepHook
from dtrain.step_weights.experts import StepExpertWeights
from dtrain.step_weights.fp8_cast import StepWeightCast
from dtrain.step_weights.linears import StepEmbeddingGrads, StepLinearWeights

# Several micro-batches a step (4 of 1 sequence), so the in-place accumulation applies.
TINY = {"training.device": "cpu", "training.mixed_precision": "bf16", "model.n_layers": 1,
        "training.seq_len": 32, "training.global_batch_size": 4, "training.micro_batch_size": 1,
        "training.steps": 5, "metrics.log_every": 1, "metrics.tensorboard": False}
MIXTRAL = {**TINY, "model.name": "mixtral_debug", "model.moe_gemm": "grouped"}
FP8 = {**TINY, "fp8.enabled": True, "fp8.emulate": True}
AUTOGRAD = {"model.cast_weights_once_per_step": False,
            "model.moe_cast_weights_once_per_step": False, "fp8.cast_weights_once_per_step": False}


class GradAtUpdate(StepHook):
    """Whether ``param`` has a ``.grad`` when the step's gradients are final (after the backward
    and the clipping, before the update), one entry a step; and that it has none after the
    step."""

    def __init__(self, param: torch.nn.Parameter):
        self.param, self.seen = param, []

    def before_update(self) -> None:
        self.seen.append(self.param.grad is not None)

    def after_step(self, step: int) -> None:
        assert self.param.grad is None, f"a .grad left after step {step}"


def train_with_a_frozen_interval(overrides: dict, name: str, hook_type: type | None, output_dir
                                 ) -> tuple[list[tuple[float, float]], list[bool]]:
    """Steps 1-2 train ``name``, 3-4 with it frozen (it must not change), 5 unfrozen again (it
    must change): the (loss, grad norm) of every step and whether ``name`` had a gradient."""
    trainer = Trainer(load_config("debug", {**overrides, "job.output_dir": str(output_dir)}))
    hooks = trainer.hooks.hooks
    assert hook_type is None or any(isinstance(h, hook_type) for h in hooks)
    param = dict(trainer.model.named_parameters())[name]
    grads = GradAtUpdate(param)
    hooks.append(grads)
    records = trainer.train(until=2)
    param.requires_grad_(False)
    before = param.detach().clone()
    records += trainer.train(until=4)
    assert torch.equal(param, before), f"{name} changed while frozen"
    param.requires_grad_(True)
    records += trainer.train()
    assert not torch.equal(param, before), f"{name} did not train once unfrozen"
    return [(r["loss"], r["grad_norm"]) for r in records], grads.seen


@pytest.mark.parametrize(("overrides", "name", "hook_type"), [
    (TINY, "layers.0.attention.wq.weight", StepLinearWeights),
    (TINY, "tok_embeddings.weight", StepEmbeddingGrads),
    (MIXTRAL, "layers.0.feed_forward.experts.w1", StepExpertWeights),
    (FP8, "layers.0.attention.wq.weight", StepWeightCast),
], ids=["linear", "embedding", "expert", "fp8_linear"])
def test_a_weight_frozen_between_steps_gets_no_gradient_and_trains_again_unfrozen(
        tmp_path, overrides, name, hook_type):
    # rtol 1e-6: the in-place sums are autograd's on the CPU (equal in practice); a frozen
    # weight's gradient in the norm or an update of it would move the figures far more.
    in_place, grads = train_with_a_frozen_interval(overrides, name, hook_type, tmp_path / "once")
    assert grads == [True, True, False, False, True]
    reference, reference_grads = train_with_a_frozen_interval(
        {**overrides, **AUTOGRAD}, name, None, tmp_path / "autograd")
    assert reference_grads == grads
    assert in_place == pytest.approx(reference, rel=1e-6)
