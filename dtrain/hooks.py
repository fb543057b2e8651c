"""Features that act around an optimizer step attach to the training loop as hooks.

The loop (``dtrain.trainer``) calls each registered hook at fixed points of every step and names
none of them; a component that needs such a point (the checkpointer's asynchronous staging, the
FP8 weight scales, the MoE statistics and expert bias, the ``auto`` FSDP reshard fitting)
subclasses ``StepHook`` next to the code it belongs to and is registered by the run's assembly
(``dtrain.run``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class StepHook:
    """The points of one optimizer step; each does nothing unless overridden."""

    def before_step(self) -> None:
        """Before the step's first forward."""

    def before_update(self) -> None:
        """After the backward and gradient clipping, before the weights change."""

    def after_update(self) -> None:
        """After the optimizer step was issued (with the overlapped step it may still run)."""

    def after_step(self, step: int) -> None:
        """After step ``step`` (1-based, counted over resumes) is complete on the host."""

    def abandon_step(self) -> None:
        """The step raised before its update (an interrupt between micro-batches, a caught
        out-of-memory error): whatever the hook holds for the step is dropped, as after an
        update, so that the next step starts as any step does. It may come at any point
        before the update: before, inside or after this hook's ``before_step`` or
        ``before_update``."""

    def record(self, step: int) -> dict[str, Any]:
        """Figures of the last step for its log record (called only when the step is logged)."""
        return {}

    def describe(self) -> str | None:
        """What this hook does to the run, in one line of its start-up summary (None: nothing
        worth a line)."""
        return None


class Hooks(StepHook):
    """Several hooks called in the order given."""

    def __init__(self, hooks: Iterable[StepHook | None]):
        self.hooks = [hook for hook in hooks if hook is not None]

    def before_step(self) -> None:
        for hook in self.hooks:
            hook.before_step()

    def before_update(self) -> None:
        for hook in self.hooks:
            hook.before_update()

    def after_update(self) -> None:
        for hook in self.hooks:
            hook.after_update()

    def after_step(self, step: int) -> None:
        for hook in self.hooks:
            hook.after_step(step)

    def abandon_step(self) -> None:
        for hook in self.hooks:
            hook.abandon_step()

    def describe_each(self) -> list[str]:
        """Each hook's start-up line, where it has one."""
        return [line for hook in self.hooks if (line := hook.describe())]

    def record(self, step: int) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for hook in self.hooks:
            merged.update(hook.record(step))
        return merged


def step_grad(weight: torch.Tensor) -> torch.Tensor | None:
    """The ``.grad`` into which a step hook's backwards add ``weight``'s gradient in place (made
    zero where there is none), or None where ``weight`` is frozen (``requires_grad`` False, read
    at every step, so a weight frozen or unfrozen between steps is seen): a frozen weight then
    gets no gradient, so the optimizer skips it and the clipping norm leaves it out, as with
    autograd's own accumulation."""
    if not weight.requires_grad:
        return None
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    return weight.grad
