"""Weights cast once per step with in-place gradient accumulation (dtrain.parallel.step_weights):
bf16 autocast on fp32 weights on the CPU trains bit for bit as autocast's own casts and autograd's
accumulation, and the step's copies are what every micro-batch uses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtrain import Trainer, load_config
from dtrain.parallel import step_weights
from dtrain.parallel.step_weights import StepWeights, add_into_grad, step_weight_linears

BF16 = {"training.device": "cpu", "training.mixed_precision": "bf16", "model.n_layers": 2,
        "training.seq_len": 64, "training.global_batch_size": 4, "training.micro_batch_size": 1,
        "training.steps": 3, "metrics.log_every": 1, "metrics.tensorboard": False}


def _hook(trainer: Trainer) -> StepWeights | None:
    return next((h for h in trainer.hooks.hooks if isinstance(h, StepWeights)), None)


def test_casting_once_per_step_trains_exactly_as_autocast_and_autograd(tmp_path, monkeypatch):
    runs = {}
    for once in (True, False):
        trainer = Trainer(load_config("debug", {
            **BF16, "model.cast_weights_once_per_step": once,
            "job.output_dir": str(tmp_path / str(once))}))
        hook = _hook(trainer)
        assert (hook is not None) is once
        grads_seen, casts = {}, []
        if once:
            # 7 linears a block and the output layer; the embedding is no linear
            assert len(hook.linears) == 2 * 7 + 1
            real = step_weights.StepCast.apply
            monkeypatch.setattr(step_weights.StepCast, "apply",
                                lambda w, d, real=real, casts=casts: casts.append(d) or real(w, d))

            def seen(module, args, grads_seen=grads_seen):  # the step's copy in each forward
                assert module._step_weight.dtype == torch.bfloat16
                grad = module.weight.grad
                grads_seen.setdefault(id(module), []).append(None if grad is None else id(grad))

            for linear in hook.linears:
                linear.register_forward_pre_hook(seen)
        history = trainer.train()
        monkeypatch.undo()
        runs[once] = history, [p.detach().clone() for p in trainer.model.parameters()]
        if once:
            # one cast per linear and step; within a step the .grad tensor is the same one
            # (added into in place): None before the first micro-batch, then one tensor
            assert casts == [torch.bfloat16] * (15 * 3)
            for ids in grads_seen.values():
                steps = [ids[i:i + 4] for i in range(0, 12, 4)]
                assert len(ids) == 12 and all(
                    s[0] is None and s[1] is not None and s[1] == s[2] == s[3] for s in steps)
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


def test_add_into_grad_copies_first_then_adds_in_place():
    param = nn.Parameter(torch.zeros(2, 3))
    first = torch.ones(3, 2, dtype=torch.bfloat16).t()  # not contiguous
    add_into_grad(param, first)
    grad = param.grad
    assert grad.dtype == torch.float32 and grad.is_contiguous() and torch.equal(grad, first.float())
    add_into_grad(param, torch.full((2, 3), 0.5, dtype=torch.bfloat16))
    assert param.grad is grad and torch.equal(grad, torch.full((2, 3), 1.5))
