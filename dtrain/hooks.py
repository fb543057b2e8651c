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

    def record(self, step: int) -> dict[str, Any]:
        """Figures of the last step for its log record (called only when the step is logged)."""
        return {}


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

    def record(self, step: int) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for hook in self.hooks:
            merged.update(hook.record(step))
        return merged
