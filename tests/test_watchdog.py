"""The hang watchdog: each phase's allowance, and the line that names the rank that stopped.

Real threads, real sleeps and a real TCPStore; ``os._exit`` is replaced by a recorder, so the
watchdog's thread ends where the process would have. A sleep that must not trip the watchdog is
1 s inside an allowance of 30 s, and twice the 0.5 s allowance it must escape: room for a loaded
machine."""

import datetime
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from dtrain import watchdog
from dtrain.config.sections import TrainingConfig
from dtrain.errors import EXIT_HANG
from dtrain.watchdog import HangWatchdog, ProgressBoard, collective_timeout_s


@pytest.fixture
def exits(monkeypatch):
    """The exit codes the watchdog asked for."""
    codes = []
    monkeypatch.setattr(watchdog.os, "_exit", codes.append)
    return codes


@pytest.fixture
def store():
    """A TCPStore served by this process, as torchrun's agent serves its workers."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))


def wait_for(exits: list[int], within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)


def steady(dog: HangWatchdog, step: int = 3) -> HangWatchdog:
    """``dog`` started at step 0 and past its start-up steps, at ``step``."""
    dog.start(0)
    for done in range(1, step + 1):
        dog.beat(done)
    return dog


def error_line(capsys) -> str:
    return next(line for line in capsys.readouterr().err.splitlines()
                if line.startswith("error:"))


# ---- allowances ----------------------------------------------------------------------------

def test_a_stall_between_steps_writes_the_stacks_and_exits_with_code_4(tmp_path, exits, capsys):
    dog = steady(HangWatchdog(0.5, tmp_path, 0, startup_timeout_s=30))
    wait_for(exits)
    dog.stop()
    assert exits == [EXIT_HANG]
    path = tmp_path / "hang-rank0.txt"
    assert re.fullmatch(r"error: rank 0 made no progress for \d+ s after step 3, in step 4 "
                        r"\(training.hang_timeout_s = 0.5\): rank 0's stacks are in "
                        rf"{re.escape(str(path))}; stopping the job \(exit code 4\)",
                        error_line(capsys))
    stacks = path.read_text()
    assert stacks.startswith("rank 0: no progress for ")
    assert "Current thread" in stacks and "\nThread 0x" in stacks  # faulthandler's every thread


def test_the_first_two_steps_after_start_have_the_startup_allowance(tmp_path, exits, capsys):
    dog = HangWatchdog(0.5, tmp_path, 0, startup_timeout_s=30)
    dog.start(0)
    time.sleep(1.0)  # step 1 compiles
    dog.beat(1)
    time.sleep(1.0)  # step 2 recompiles
    assert exits == []
    dog.beat(2)
    wait_for(exits)  # step 3 is a plain step
    dog.stop()
    assert exits == [EXIT_HANG]
    assert "after step 2, in step 3 (training.hang_timeout_s = 0.5)" in error_line(capsys)


def test_every_start_has_the_startup_allowance_again(tmp_path, exits):
    dog = steady(HangWatchdog(0.5, tmp_path, 0, startup_timeout_s=30))
    dog.stop()
    dog.start(3)  # a second train() compiles nothing new, but may load a checkpoint's state
    time.sleep(1.0)
    dog.stop()
    assert exits == []


@pytest.mark.parametrize("phase", ["validation", "checkpoint save"])
def test_a_phase_longer_than_a_step_allowance_is_not_a_hang(tmp_path, exits, phase):
    dog = steady(HangWatchdog(0.5, tmp_path, 0, startup_timeout_s=30, save_timeout_s=30))
    with dog.phase(phase):
        time.sleep(1.0)
    assert exits == []  # leaving counted as progress too
    wait_for(exits)  # and a stall after it has the step allowance again
    dog.stop()
    assert exits == [EXIT_HANG]


def test_a_phase_past_its_own_allowance_names_its_knob(tmp_path, exits, capsys):
    dog = steady(HangWatchdog(0.5, tmp_path, 0, startup_timeout_s=30, save_timeout_s=1))
    with dog.phase("checkpoint save"):
        wait_for(exits)
    dog.stop()
    assert ("after step 3, in the checkpoint save of step 3 (training.save_timeout_s = 1)"
            in error_line(capsys))


def test_an_unknown_phase_is_refused(tmp_path):
    with pytest.raises(ValueError, match="use validation or checkpoint save"):
        with HangWatchdog(1, tmp_path, 0).phase("step"):
            pass


def test_collectives_time_out_a_minute_past_the_largest_allowance():
    training = TrainingConfig(hang_timeout_s=10, startup_timeout_s=30, save_timeout_s=20)
    assert collective_timeout_s(training) == 90


# ---- naming the rank -----------------------------------------------------------------------

def test_the_line_names_the_rank_that_stopped_reporting(tmp_path, exits, capsys, store):
    # Reports every 1 s, silent after 3 s: the frozen rank's last report is about 4 s old when
    # the waiting rank's 4 s run out.
    waiting, frozen = (steady(HangWatchdog(4, tmp_path, rank,
                                           board=ProgressBoard(store.clone(), 2)))
                       for rank in (0, 1))
    time.sleep(0.5)  # a tick: its step 3 is posted
    frozen.stop()  # and its reports stop, as a SIGSTOP's would
    wait_for(exits)
    waiting.stop()
    path = tmp_path / "hang-rank0.txt"
    assert re.fullmatch(r"error: rank 1 stopped making progress after step 3 \(no report for "
                        r"\d+ s; the others reached step 3 and waited \d+ s\): rank 0's stacks "
                        rf"are in {re.escape(str(path))}; stopping the job \(exit code 4\)",
                        error_line(capsys))
    assert re.search(r"rank 1: after step 3, in step 4; .* \(silent\)", path.read_text())


def test_a_live_rank_at_a_lower_step_is_named_as_behind(tmp_path, exits, capsys, store):
    waiting = steady(HangWatchdog(2, tmp_path, 0, board=ProgressBoard(store.clone(), 2)))
    behind = steady(HangWatchdog(60, tmp_path, 1, board=ProgressBoard(store.clone(), 2)), 2)
    wait_for(exits)
    waiting.stop(), behind.stop()
    assert re.match(r"error: rank 1 stopped making progress after step 2 \(alive, in step 3 "
                    r"for \d+ s; the others reached step 3 and waited \d+ s\): ",
                    error_line(capsys))


def test_live_ranks_at_one_step_are_all_said_to_wait(tmp_path, exits, capsys, store):
    waiting = steady(HangWatchdog(2, tmp_path, 0, board=ProgressBoard(store.clone(), 2)))
    peer = steady(HangWatchdog(60, tmp_path, 1, board=ProgressBoard(store.clone(), 2)))
    wait_for(exits)
    waiting.stop(), peer.stop()
    assert re.match(r"error: no rank is behind: all 2 ranks reached step 3 and wait in step 4 "
                    r"\(a collective or the data\) for \d+ s, past training.hang_timeout_s = 2: ",
                    error_line(capsys))


def test_a_store_that_does_not_answer_leaves_the_rank_naming_itself(tmp_path, exits, capsys):
    server = subprocess.Popen(
        [sys.executable, "-c", "import datetime, sys, time, torch.distributed as d; "
         "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False); "
         "print(s.port, flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    try:
        client = dist.TCPStore("127.0.0.1", int(server.stdout.readline()), is_master=False,
                               timeout=datetime.timedelta(seconds=60))
        dog = steady(HangWatchdog(1, tmp_path, 0, board=ProgressBoard(client, 2)))
        os.kill(server.pid, signal.SIGSTOP)  # a read now waits past the store's own timeout
        wait_for(exits, within_s=20)
        dog.stop()
    finally:
        server.kill()
    assert re.match(r"error: rank 0 made no progress for \d+ s after step 3, in step 4 "
                    r"\(training.hang_timeout_s = 1\); the other ranks' progress is unknown: "
                    r"the rendezvous store did not answer within 5 s: ", error_line(capsys))


def test_a_rank_posts_once_a_tick_not_once_a_step(tmp_path, store):
    class CountingStore:
        def __init__(self):
            self.sets = 0

        def set(self, key, value):
            self.sets += 1
            store.set(key, value)

    counting = CountingStore()
    dog = HangWatchdog(10, tmp_path, 0, board=ProgressBoard(counting, 2))  # a tick is 1 s
    dog.start(0)
    for step in range(1, 101):  # 100 steps in 1 s
        time.sleep(0.01)
        dog.beat(step)
    dog.stop()
    assert counting.sets <= 3
