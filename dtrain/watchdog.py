"""Hangs: a rank without progress within its phase's allowance ends the job, naming the rank that
stopped.

The training loop reports progress: ``start(step)`` when it starts, ``beat(step)`` after each
step, and ``with phase("validation")`` / ``with phase("checkpoint save")`` around the slow parts
(entering and leaving count as progress). Each phase has its allowance (``ALLOWANCES``): start-up
and compilation (from ``start`` to the end of the ``STARTUP_STEPS`` steps after it) and validation
``training.startup_timeout_s``, a checkpoint save ``training.save_timeout_s``, every later step
``training.hang_timeout_s``. A background thread watches the time since the last progress; past
the allowance it writes every thread's Python stack to ``<run>/hang-rank<R>.txt``, prints one line
and ends the process with ``EXIT_HANG``: torchrun then stops the other ranks, instead of all of
them waiting in a collective for a peer that will never answer.

The line names the rank that stopped, not the one that waited: each rank's thread posts its step,
phase and last progress to the rendezvous store every few seconds (``ProgressBoard``), and the
rank whose allowance runs out reads them all. A frozen or dead rank has a stale report, a rank
stuck behind a lower step (``verdict``). On NCCL the flight recorder is on (``nccl_debug_env``):
its dump of the last collectives lands beside the stacks on a timeout.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch.distributed as dist

from dtrain.config.sections import TrainingConfig
from dtrain.errors import EXIT_HANG

STARTUP_STEPS = 2
"""Steps after each ``start()`` under the start-up allowance: the first compiles the graphs and
creates the communicators, the second may recompile (guards that first fail after one step)."""
ALLOWANCES = {"start-up": "startup_timeout_s", "step": "hang_timeout_s",
              "validation": "startup_timeout_s", "checkpoint save": "save_timeout_s"}
"""Each phase's allowance: a ``TrainingConfig`` field. Start-up and step follow from the step,
the others are entered by name (``phase``)."""
NAMED_PHASES = ("validation", "checkpoint save")
REPORT_EVERY_S = 5.0
"""The longest time between two reports of a rank (shorter when an allowance is under 20 s)."""
MISSED_REPORTS = 3
"""A rank this many report intervals late is silent: frozen, dead, or holding the GIL."""
STORE_ANSWER_S = 5.0
"""How long the rank that ends the job waits for the others' reports."""
WHERE = {"start-up": "step {next} (start-up)", "step": "step {next}",
         "validation": "the validation after step {step}",
         "checkpoint save": "the checkpoint save of step {step}"}


def nccl_debug_env(run_dir: Path, rank: int) -> None:
    """NCCL's flight recorder, dumped on a collective timeout into the run folder (set unless
    the user set them; read by torch when the process group starts)."""
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(run_dir / "nccl-trace-rank"))


def collective_timeout_s(training: TrainingConfig) -> float:
    """The process group's collective timeout: a minute past the largest allowance, so that the
    watchdog, which writes the stacks and names the rank, speaks first."""
    return max(getattr(training, knob) for knob in ALLOWANCES.values()) + 60


class LastProgress(NamedTuple):
    """What the training thread last reported: one attribute, replaced whole, so that the
    watchdog thread never reads a step with another step's time."""
    step: int
    phase: str | None
    """"validation" or "checkpoint save" inside ``phase()``, else None (a step)."""
    at: float
    """time.monotonic()"""


class Report(NamedTuple):
    """A rank's entry on the ``ProgressBoard`` (times are wall-clock: ranks on other hosts)."""
    step: int
    phase: str
    progress_at: float
    reported_at: float
    every_s: float
    """The poster's report interval."""

    def silent(self, now: float) -> bool:
        return now - self.reported_at > MISSED_REPORTS * self.every_s

    def where(self) -> str:
        return WHERE[self.phase].format(step=self.step, next=self.step + 1)


class ProgressBoard:
    """Every rank's last ``Report``, one key per rank in a store: a rank sets its key when its
    step or phase changed (at most once a watchdog tick) and every report interval; the rank
    whose allowance ran out reads them all, once."""

    def __init__(self, store: dist.Store, world_size: int):
        self.store, self.world_size = store, world_size

    @classmethod
    def of_default_group(cls) -> ProgressBoard | None:
        """The board on the default process group's store (torchrun's), through a connection of
        its own: a store call of the training thread may hold the shared one. None in one
        process."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        return cls(dist.distributed_c10d._get_default_store().clone(), dist.get_world_size())

    def post(self, rank: int, report: Report) -> None:
        self.store.set(f"watchdog/rank{rank}", json.dumps(report._asdict()))

    def read(self) -> list[Report | None] | None:
        """Every rank's last report (None for a rank without one); None when the store does not
        answer within ``STORE_ANSWER_S`` (a read from a frozen store outlasts its timeout)."""
        answer = []
        reader = threading.Thread(target=lambda: answer.append(self._read_all()), daemon=True,
                                  name="dtrain-watchdog-read")
        reader.start()
        reader.join(STORE_ANSWER_S)
        return answer[0] if answer else None

    def _read_all(self) -> list[Report | None] | None:
        keys = [f"watchdog/rank{rank}" for rank in range(self.world_size)]
        try:
            if self.store.check(keys):
                values = self.store.multi_get(keys)
            else:
                values = [self.store.get(key) if self.store.check([key]) else None
                          for key in keys]
        except (RuntimeError, OSError):  # the store is gone: the line says so
            return None
        return [Report(**json.loads(value)) if value is not None else None for value in values]


class HangWatchdog:
    """``start(step)``, ``beat(step)``, ``with phase(name)``, ``stop()``: see the module
    docstring. ``board``: where the ranks post their progress; by default the default process
    group's store, found at the first ``start()`` (none in one process)."""

    def __init__(self, hang_timeout_s: float, run_dir: Path, rank: int, *,
                 startup_timeout_s: float = TrainingConfig.startup_timeout_s,
                 save_timeout_s: float = TrainingConfig.save_timeout_s,
                 board: ProgressBoard | None = None):
        self.run_dir, self.rank, self.board = run_dir, rank, board
        seconds = {"hang_timeout_s": hang_timeout_s, "startup_timeout_s": startup_timeout_s,
                   "save_timeout_s": save_timeout_s}
        self.allowance_s = {phase: seconds[knob] for phase, knob in ALLOWANCES.items()}
        shortest = min(seconds.values())
        # A frozen rank's report goes stale (MISSED_REPORTS intervals) before any allowance ends.
        self.report_every_s = min(REPORT_EVERY_S, shortest / (MISSED_REPORTS + 1))
        self._tick_s = min(1.0, shortest / 10)
        self.progress = LastProgress(0, None, time.monotonic())
        self._steady_from = STARTUP_STEPS
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_training(cls, training: TrainingConfig, run_dir: Path, rank: int) -> HangWatchdog:
        """The watchdog of a run with the allowances of its ``[training]`` section."""
        return cls(training.hang_timeout_s, run_dir, rank,
                   startup_timeout_s=training.startup_timeout_s,
                   save_timeout_s=training.save_timeout_s)

    def start(self, step: int) -> None:
        """Training starts (again) at ``step``: the next ``STARTUP_STEPS`` steps are start-up."""
        self._steady_from = step + STARTUP_STEPS
        self.beat(step)
        if self._thread is None:
            if self.board is None:
                self.board = ProgressBoard.of_default_group()
            self._stopped.clear()
            self._thread = threading.Thread(target=self._watch, daemon=True,
                                            name="dtrain-watchdog")
            self._thread.start()

    def beat(self, step: int) -> None:
        """Progress: ``step`` is done."""
        self.progress = LastProgress(step, self.progress.phase, time.monotonic())

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Inside, progress has ``name``'s allowance ("validation" or "checkpoint save");
        entering and leaving count as progress."""
        if name not in NAMED_PHASES:
            raise ValueError(f"no hang allowance for the phase {name!r}: use "
                             f"{' or '.join(NAMED_PHASES)}")
        outer = self.progress.phase
        self.progress = LastProgress(self.progress.step, name, time.monotonic())
        try:
            yield
        finally:
            self.progress = LastProgress(self.progress.step, outer, time.monotonic())

    def stop(self) -> None:
        if self._thread is not None:
            self._stopped.set()
            self._thread.join()
            self._thread = None

    def _phase_of(self, progress: LastProgress) -> str:
        if progress.phase is not None:
            return progress.phase
        return "start-up" if progress.step < self._steady_from else "step"

    def _report(self, progress: LastProgress) -> Report:
        now = time.time()
        return Report(progress.step, self._phase_of(progress),
                      now - (time.monotonic() - progress.at), now, self.report_every_s)

    def _watch(self) -> None:
        if (stalled := self._wait_for_a_stall()) is not None:
            self._end(stalled)

    def _wait_for_a_stall(self) -> LastProgress | None:
        """Posts this rank's report when its step or phase changed (at most once a tick) and
        every ``report_every_s``, until ``stop()`` (None) or until the last progress outlives
        its phase's allowance (that progress)."""
        posted, next_report = None, 0.0
        while True:
            progress = self.progress
            phase = self._phase_of(progress)
            now = time.monotonic()
            if now - progress.at > self.allowance_s[phase]:
                return progress
            if self.board is not None and (now >= next_report or posted != (progress.step, phase)):
                with contextlib.suppress(RuntimeError, OSError):  # no store: still watch
                    self.board.post(self.rank, self._report(progress))
                posted, next_report = (progress.step, phase), now + self.report_every_s
            if self._stopped.wait(self._tick_s):
                return None

    def _end(self, stalled: LastProgress) -> None:
        mine = self._report(stalled)
        knob = ALLOWANCES[mine.phase]
        allowance = f"training.{knob} = {self.allowance_s[mine.phase]:g}"
        stall = (f"no progress for {mine.reported_at - mine.progress_at:.0f} s after step "
                 f"{mine.step}, in {mine.where()} ({allowance})")
        reports = self.board.read() if self.board is not None else [mine]
        now = time.time()
        if reports is None:
            cause = (f"rank {self.rank} made {stall}; the other ranks' progress is unknown: the "
                     f"rendezvous store did not answer within {STORE_ANSWER_S:g} s")
        else:
            reports[self.rank] = mine
            cause = verdict(reports, now, allowance) if len(reports) > 1 else \
                f"rank {self.rank} made {stall}"
        path = self.run_dir / f"hang-rank{self.rank}.txt"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            f.write(f"rank {self.rank}: {stall}\n")
            f.write(report_table(reports, now))
            f.flush()  # faulthandler writes to the descriptor, past Python's buffer
            faulthandler.dump_traceback(file=f, all_threads=True)
        print(f"error: {cause}: rank {self.rank}'s stacks are in {path}; stopping the job "
              f"(exit code {EXIT_HANG})", file=sys.stderr, flush=True)
        os._exit(EXIT_HANG)


def verdict(reports: list[Report | None], now: float, allowance: str) -> str:
    """Why the job ends, from every rank's report (at least two; the caller's own is fresh):
    the ranks that stopped reporting, else those at a lower step than the rest, else where they
    all wait. ``allowance`` names the caller's phase's knob and value."""
    silent = [r for r, report in enumerate(reports) if report is None or report.silent(now)]
    alive = {r: report for r, report in enumerate(reports) if r not in silent}
    top = max(report.step for report in alive.values())
    named = silent or [r for r, report in alive.items() if report.step < top]
    others = [report for r, report in alive.items() if r not in named]
    waited = min(now - report.progress_at for report in others)
    if not named:
        places: dict[str, list[int]] = {}
        for r, report in alive.items():
            places.setdefault(report.where(), []).append(r)
        where = places.popitem()[0] if len(places) == 1 else " and ".join(
            f"{place} ({ranks_phrase(ranks)})" for place, ranks in places.items())
        return (f"no rank is behind: all {len(reports)} ranks reached step {top} and wait in "
                f"{where} (a collective or the data) for {waited:.0f} s, past {allowance}")
    known = [reports[r] for r in named if reports[r] is not None]
    after = f"after {steps_phrase(r.step for r in known)}" if known else "before any report"
    if not silent:
        state = f"alive, in {known[0].where()} for {now - known[0].progress_at:.0f} s"
    elif known:
        state = f"no report for {min(now - report.reported_at for report in known):.0f} s"
    else:
        state = "no report at all"
    return (f"{ranks_phrase(named)} stopped making progress {after} ({state}; the others "
            f"reached {steps_phrase(report.step for report in others)} and waited "
            f"{waited:.0f} s)")


def report_table(reports: list[Report | None] | None, now: float) -> str:
    """Every rank's last report, a line each, for the stacks file."""
    if reports is None:
        return "the other ranks' reports: the rendezvous store did not answer\n"
    lines = ["the ranks' last reports:"]
    for rank, report in enumerate(reports):
        if report is None:
            lines.append(f"  rank {rank}: no report")
            continue
        lines.append(f"  rank {rank}: after step {report.step}, in {report.where()}; progress "
                     f"{now - report.progress_at:.0f} s ago, report {now - report.reported_at:.0f}"
                     f" s ago{' (silent)' if report.silent(now) else ''}")
    return "\n".join(lines) + "\n"


def ranks_phrase(ranks: list[int], shown: int = 8) -> str:
    """"rank 1", "ranks 1, 5", "ranks 0, 1, ... and 12 more"."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    more = f" and {len(ranks) - shown} more" if len(ranks) > shown else ""
    return f"ranks {', '.join(map(str, ranks[:shown]))}{more}"


def steps_phrase(steps: Iterable[int]) -> str:
    """"step 3", or "steps 3-4" for ranks at different steps."""
    steps = sorted(steps)
    return f"step {steps[0]}" if steps[0] == steps[-1] else f"steps {steps[0]}-{steps[-1]}"
