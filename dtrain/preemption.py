"""Preemption: SIGTERM or SIGUSR1 (what SLURM, Kubernetes and torchrun send before they kill a
job) ends the run at the next step boundary with a checkpoint.

The handler only notes the signal. After each step the ranks agree whether any of them got one
(one all-reduce of a CPU tensor over a gloo group: no device synchronisation), so that all stop
after the same step; the trainer then saves, logs one line and raises ``Preempted``.
"""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    """Notes SIGTERM and SIGUSR1 while ``armed`` (the previous handlers are restored by
    ``disarm``); ``requested()`` is the agreed signal's name, or None. ``group``: a CPU (gloo)
    process group of every rank, None for one process."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.received = 0
        self._previous: dict[int, object] = {}

    def arm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._note)

    def disarm(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _note(self, signum, frame) -> None:
        self.received = self.received or signum

    def requested(self) -> str | None:
        """The signal any rank received, agreed by all (the same answer on every rank)."""
        received = self.received
        if self.group is not None:
            flag = torch.tensor([received], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            received = int(flag.item())
        return signal.Signals(received).name if received else None
