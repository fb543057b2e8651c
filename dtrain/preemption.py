"""Preemption: SIGTERM or SIGUSR1 (what SLURM, Kubernetes and torchrun send before they kill a
job), and Ctrl-C (SIGINT) when checkpoints are on, end the run at the next step boundary with a
checkpoint.

The handler only notes the signal. After each step the ranks agree whether any of them got one
(one all-reduce of a CPU tensor over a gloo group: no device synchronisation), so that all stop
after the same step; the trainer then saves, logs one line and raises ``Preempted`` (exit code
75). A second Ctrl-C stops at once (``KeyboardInterrupt``).

A preempted job must end, not train on: torchrun's ``--max-restarts`` restarts workers that
exit non-zero, whatever the code. So rank 0 leaves ``<run>/preempted.json`` (the job, the
attempt, the step), and a worker that torchrun restarts after it finds the note and exits 75 at
once (``restart_after_preemption``); a new launch of the job removes the note
(``forget_preemption``) and resumes.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dtrain.errors import EXIT_PREEMPTED, Preempted
from dtrain.log import logger

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
NOTE = "preempted.json"
# torchrun passes the Ctrl-C it receives on to its workers, which the terminal has already
# signalled: a second SIGINT this soon after the first is the same keypress.
SAME_KEYPRESS_S = 1.0


class Preemption:
    """Notes SIGTERM and SIGUSR1, and SIGINT with ``interrupt``, while ``armed`` (the previous
    handlers are restored by ``disarm``); ``requested()`` is the agreed signal's name, or None.
    ``group``: a CPU (gloo) process group of every rank, None for one process.

    A Ctrl-C that stops at once (without ``interrupt``, or the second one) raises
    ``KeyboardInterrupt`` wherever the main thread is. Raised inside a finaliser that the
    garbage collector runs, or a weakref callback, Python prints it as ignored and goes on, and
    the run would train on: the handler also notes it, and ``stop_if_interrupted`` at the step
    boundary raises it again."""

    def __init__(self, group: dist.ProcessGroup | None, interrupt: bool = False):
        self.group = group
        self.signals = SIGNALS + ((signal.SIGINT,) if interrupt else ())
        self.received = 0
        self.interrupted = False  # a Ctrl-C that stops at once came
        self._interrupted_at = 0.0
        self._previous: dict[int, object] = {}

    def arm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._note)
        if signal.SIGINT not in self.signals:
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._stop_at_once)

    def _stop_at_once(self, signum, frame) -> None:
        self.interrupted = True
        raise KeyboardInterrupt

    def stop_if_interrupted(self) -> None:
        """Raises ``KeyboardInterrupt`` if a Ctrl-C that stops at once came (its own exception
        may have been lost: see the class docstring)."""
        if self.interrupted:
            raise KeyboardInterrupt

    def disarm(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _note(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self._interrupted_at and now - self._interrupted_at > SAME_KEYPRESS_S:
                self._stop_at_once(signum, frame)  # the second Ctrl-C
            self._interrupted_at = self._interrupted_at or now
        self.received = self.received or signum

    def requested(self) -> str | None:
        """The signal any rank received, agreed by all (the same answer on every rank)."""
        received = self.received
        if self.group is not None:
            flag = torch.tensor([received], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            received = int(flag.item())
        return signal.Signals(received).name if received else None


def torchrun_attempt() -> tuple[str, int]:
    """(torchrun's run id, its restart count for this worker); ("", 0) outside torchrun. A
    requeued SLURM job starts a new torchrun: attempt 0 again."""
    return (os.environ.get("TORCHELASTIC_RUN_ID", ""),
            int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0))


def note_preemption(run_dir: Path, step: int, signal_name: str) -> None:
    """Rank 0 leaves the note that this job was preempted after ``step`` (best effort: an
    unwritable folder only means a torchrun restart trains again from the checkpoint)."""
    job, attempt = torchrun_attempt()
    try:
        (run_dir / NOTE).write_text(json.dumps({"job": job, "attempt": attempt, "step": step,
                                                "signal": signal_name}))
    except OSError:
        pass


def restart_after_preemption(run_dir: Path) -> str | None:
    """The line to exit with when this process is torchrun's restart of a job that was
    preempted (its note is from an earlier attempt of the same job); None otherwise."""
    job, attempt = torchrun_attempt()
    if attempt == 0:
        return None
    try:
        note = json.loads((run_dir / NOTE).read_text())
    except (OSError, ValueError):
        return None
    if note.get("job") != job or note.get("attempt", attempt) >= attempt:
        return None
    return (f"{note.get('signal')}: this job was preempted after step {note.get('step')}; "
            f"torchrun restarted it (attempt {attempt}), which stops at once with exit code "
            f"{EXIT_PREEMPTED}: launch the job again to resume from its checkpoint")


def stop_if_restarted_after_preemption(run_dir: Path) -> None:
    """Raises ``Preempted`` with ``restart_after_preemption``'s line (logged) where there is
    one: the first thing a run does."""
    if message := restart_after_preemption(run_dir):
        logger.info(message)
        raise Preempted(message)


def forget_preemption(run_dir: Path) -> None:
    """A new launch (torchrun's first attempt) resumes: the note of an earlier preemption goes.
    Called by rank 0 once the run holds its folder."""
    if torchrun_attempt()[1] == 0:
        (run_dir / NOTE).unlink(missing_ok=True)
