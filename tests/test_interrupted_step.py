"""A step interrupted between micro-batches (Ctrl-C in a notebook, a caught out-of-memory error)
is abandoned: it leaves no gradient and no step copy behind, and the next step is the step an
uninterrupted trainer at the same weights takes on the same batches."""

from __future__ import annotations

import pytest
import torch

from dtrain import Trainer, load_config
from dtrain.step_weights.copies import StepCopies, step_copy

TINY = {"model.n_layers": 1, "training.seq_len": 32, "training.global_batch_size": 4,
        "training.micro_batch_size": 1, "metrics.tensorboard": False}  # 4 micro-batches a step


def interrupt_in_forward(module: torch.nn.Module, at_call: int,
                         interrupt: BaseException) -> torch.utils.hooks.RemovableHandle:
    """``module``'s ``at_call``-th forward raises ``interrupt`` once it has run."""
    calls = []

    def raise_once(module, args, output):
        calls.append(None)
        if len(calls) == at_call:
            raise interrupt

    return module.register_forward_hook(raise_once)


@pytest.mark.parametrize("changes", [
    {"training.mixed_precision": "fp32"},
    {"training.mixed_precision": "bf16", "model.cast_weights_once_per_step": True},
    {"training.mixed_precision": "bf16", "model.cast_weights_once_per_step": False},
], ids=["fp32", "bf16-cast-once", "bf16-autocast"])
def test_an_interrupted_step_leaves_nothing_behind_for_the_next(tmp_path, changes):
    def trainer(name: str) -> Trainer:
        return Trainer(load_config("debug", {**TINY, **changes,
                                             "job.output_dir": str(tmp_path / name)}))

    interrupted, reference = trainer("interrupted"), trainer("reference")
    copies = [h for h in interrupted.hooks.hooks if isinstance(h, StepCopies)]
    assert bool(copies) == changes.get("model.cast_weights_once_per_step", False)
    interrupt = KeyboardInterrupt()
    handle = interrupt_in_forward(interrupted.model.layers["0"], 2, interrupt)
    with pytest.raises(KeyboardInterrupt) as raised:
        interrupted.train_step()  # after micro-batch 1's backward, in micro-batch 2's forward
    handle.remove()
    assert raised.value is interrupt  # re-raised unchanged
    assert interrupted.step == 0
    assert [name for name, p in interrupted.model.named_parameters() if p.grad is not None] == []
    assert [(type(hook).__name__, layer) for hook in copies for layer in hook.layers
            if step_copy(layer) is not None] == []

    # The interrupted step took micro-batches 1 and 2; the next step takes the next four.
    reference.batches.next()
    reference.batches.next()
    loss, grad_norm, _ = interrupted.train_step()
    expected_loss, expected_norm, _ = reference.train_step()
    # The same arithmetic on the same weights and batches in one CPU process: 1e-6 is room for
    # nothing but summation order.
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad_norm, expected_norm, rtol=1e-6, atol=0)
    for trained in (interrupted, reference):
        trained.close()
