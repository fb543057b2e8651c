"""Non-finite steps: a step whose loss or gradient norm is infinite or NaN changes nothing.

Each step's flag is computed on the device from the loss and the global gradient norm (the
ranks agree with one small all-reduce, on the device), and the update is told to skip
(``dtrain.optim.skip_update_if``): torch's fused AdamW reads the flag inside its kernel, so the
weights and the optimizer state stay as they were without the host waiting for the device. The
host reads each flag one step later, through a copy that is long finished by then, to count the
skipped steps (reported on the next log line; the learning-rate schedule takes each back from
its count, ``LRSchedule.uncount_step``) and to stop the run after
``training.max_nonfinite_steps`` in a row, or at the first with ``training.nonfinite = "stop"``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtrain.errors import NonFiniteStop
from dtrain.hooks import StepHook


class NonFiniteSteps(StepHook):
    """See the module docstring. ``group``: the ranks whose losses differ (None: one)."""

    def __init__(self, policy: str, max_in_a_row: int, group: dist.ProcessGroup | None):
        self.policy, self.max_in_a_row, self.group = policy, max_in_a_row, group
        self._unread: list[tuple[int, torch.Tensor, torch.cuda.Event | None]] = []
        self.skipped: list[int] = []  # since the last log line
        self.in_a_row = 0
        self.on_skip = None  # called for each skipped step read (the LR schedule's uncount)

    def flag(self, loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """1.0 where the step's loss on any rank or its gradient norm is not finite, else 0.0,
        as a device tensor of one element (the same on every rank)."""
        bad = (~torch.isfinite(loss_sum) | ~torch.isfinite(grad_norm)).float().reshape(())
        if self.group is not None:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)
        return bad

    def note(self, step: int, flag: torch.Tensor) -> None:
        """Keeps step ``step``'s flag for the host to read once the device is past it."""
        event = None
        if flag.is_cuda:
            host = torch.empty((), pin_memory=True)
            host.copy_(flag, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            flag = host
        self._unread.append((step, flag, event))

    def after_step(self, step: int) -> None:
        # The flags of the steps before this one (on CPU: this one too, the device being done).
        while self._unread and (self._unread[0][2] is None or self._unread[0][0] < step):
            self._read(*self._unread.pop(0))

    def settle(self) -> None:
        """Reads every flag noted so far (at a log line, a save, the end of ``train()``)."""
        while self._unread:
            self._read(*self._unread.pop(0))

    def _read(self, step: int, flag: torch.Tensor, event) -> None:
        if event is not None:
            event.synchronize()
        if not flag.item():
            self.in_a_row = 0
            return
        self.skipped.append(step)
        self.in_a_row += 1
        if self.on_skip is not None:
            self.on_skip()
        if self.policy == "stop" or self.in_a_row >= self.max_in_a_row:
            rule = ("training.nonfinite = 'stop'" if self.policy == "stop" else
                    f"{self.in_a_row} in a row, training.max_nonfinite_steps = "
                    f"{self.max_in_a_row}")
            raise NonFiniteStop(
                f"step {step}: the loss or the gradient norm is not finite and its update was "
                f"skipped ({rule}); the run stops with the weights of step "
                f"{step - self.in_a_row}: lower optimizer.lr, raise lr_schedule.warmup_steps or "
                "check the data of those steps")

    def record(self, step: int) -> dict:
        self.settle()
        skipped, self.skipped = self.skipped, []
        return {"nonfinite_steps": skipped, "nonfinite_skipped": len(skipped)} if skipped else {}
