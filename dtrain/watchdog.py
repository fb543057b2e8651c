"""Hangs: a rank that makes no progress for ``training.hang_timeout_s`` ends the job.

A background thread watches the time since the training loop last reported progress (every
step, save and evaluation). Past the limit it writes every thread's Python stack to
``<run>/hang-rank<R>.txt``, prints one line naming the rank, the last step and the file, and
ends the process with ``EXIT_HANG``: torchrun then stops the other ranks, instead of all of them
waiting in a collective for a peer that will never answer. On NCCL the flight recorder is on
(``nccl_debug_env``): its dump of the last collectives lands beside the stacks on a timeout.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from pathlib import Path

from dtrain.errors import EXIT_HANG


def nccl_debug_env(run_dir: Path, rank: int) -> None:
    """NCCL's flight recorder, dumped on a collective timeout into the run folder (set unless
    the user set them; read by torch when the process group starts)."""
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(run_dir / "nccl-trace-rank"))


class HangWatchdog:
    """``start()`` ... ``beat(step)`` ... ``stop()``: see the module docstring."""

    def __init__(self, timeout_s: float, run_dir: Path, rank: int):
        self.timeout_s, self.run_dir, self.rank = timeout_s, run_dir, rank
        self.step, self.last = 0, time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, step: int) -> None:
        self.beat(step)
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._watch, daemon=True,
                                            name="dtrain-watchdog")
            self._thread.start()

    def beat(self, step: int) -> None:
        self.step, self.last = step, time.monotonic()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 10)):
            idle = time.monotonic() - self.last
            if idle > self.timeout_s:
                self._report(idle)

    def _report(self, idle: float) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / f"hang-rank{self.rank}.txt"
        with open(path, "w") as f:
            f.write(f"rank {self.rank}: no progress for {idle:.0f} s after step {self.step}\n")
            faulthandler.dump_traceback(file=f, all_threads=True)
        print(f"error: rank {self.rank} made no progress for {idle:.0f} s after step "
              f"{self.step} (training.hang_timeout_s = {self.timeout_s:g}): every thread's "
              f"stack is in {path}; stopping the job (exit code {EXIT_HANG})",
              file=sys.stderr, flush=True)
        os._exit(EXIT_HANG)
