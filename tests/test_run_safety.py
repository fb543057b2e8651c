"""A run's work is never lost: asynchronous saves on several ranks, one run per folder, rotation
that keeps the chosen branch, explicit verification, resumes that check the data, preemption
that ends the job, Ctrl-C, full and read-only disks. Each test causes the fault for real (two
launches, killed processes, signals, a tmpfs that fills or is read-only) and checks what the user
sees and that no checkpoint or step is lost."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import (
    BASE,
    REL,
    cli_args,
    finish,
    rank_pid,
    run_cli,
    start_cli,
    strict_records,
    tmpfs,
    torchrun,
    wait_for_step,
)

from dtrain import Trainer, load_config
from dtrain.assets import resolve
from dtrain.checkpoint import checkpoint_steps
from dtrain.config import ConfigError
from dtrain.errors import (
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    EXIT_NOT_SAVED,
    EXIT_PREEMPTED,
    CheckpointNotSaved,
)

CKPT = {**BASE, "checkpoint.enabled": True, "checkpoint.interval": 2}


def trainer(tmp_path, steps: int, **overrides) -> Trainer:
    return Trainer(load_config("debug", {**CKPT, "training.steps": steps,
                                         "job.output_dir": str(tmp_path), **overrides}))


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def assert_losses(records: list[dict], reference: list[dict]) -> None:
    assert [r["step"] for r in records] == [r["step"] for r in reference]  # each step once
    for ref, got in zip(reference, records, strict=True):
        assert got["loss"] == pytest.approx(ref["loss"], rel=REL), ref["step"]


# ---- asynchronous saves on several ranks ---------------------------------------------------

def test_async_saves_on_two_gloo_ranks_complete_and_resume_like_one_process(tmp_path):
    # Each background save's collectives run on a group of their own: before, the first one
    # hung the job or made gloo report a collective mismatch. 6 steps: two saves mid-run.
    reference = trainer(tmp_path / "one", 6, **{"checkpoint.enabled": False}).train()
    args = cli_args({**CKPT, "training.steps": 6, "checkpoint.async_save": True,
                     "checkpoint.keep_last": 0, "job.output_dir": str(tmp_path)})
    first = torchrun(args)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    folder = tmp_path / "debug" / "checkpoints"
    assert checkpoint_steps(folder) == [2, 4, 6]
    assert not list(folder.glob("*.tmp"))
    assert_losses(strict_records(tmp_path / "debug"), reference)
    again = torchrun([*args, "--checkpoint.load_step", "4"])  # a mid-run save loads too
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-3000:]
    assert "resumed from step 4" in out
    assert checkpoint_steps(folder) == [2, 4, 6]
    assert_losses(strict_records(tmp_path / "debug"), reference)


# ---- one run per folder --------------------------------------------------------------------

def test_a_second_run_into_a_held_folder_is_refused_and_the_first_loses_nothing(tmp_path):
    steps = 40
    args = cli_args({**CKPT, "training.steps": steps, "checkpoint.interval": 10,
                     "job.output_dir": str(tmp_path)})
    first, lines = torchrun(args), []
    wait_for_step(first, 2, lines)
    holder = rank_pid(first.pid, 0)
    second = torchrun(args)
    out, err = second.communicate(timeout=300)
    out_first, err_first = first.communicate(timeout=300)
    assert second.returncode != 0 and "exitcode  : 2 " in err  # torchrun's report
    said = errors(err)
    assert len(said) == 2, err[-3000:]  # one line from each rank
    assert all(line.startswith(f"error: run folder {tmp_path / 'debug'} is in use by another "
                               f"run (pid {holder} on ") for line in said), said
    assert said[0].endswith("wait for it to end, or give this run another job.name")
    assert first.returncode == 0, err_first[-3000:]
    assert [r["step"] for r in strict_records(tmp_path / "debug")] == list(range(1, steps + 1))
    trainer(tmp_path, steps, **{"checkpoint.interval": 10})  # every checkpoint verifies


def test_a_lock_left_by_a_killed_run_is_taken_over_with_one_line(tmp_path, capsys):
    run = start_cli(cli_args({**CKPT, "training.steps": 1000, "job.output_dir": str(tmp_path)}))
    wait_for_step(run, 3, [])
    run.kill()  # no cleanup: the lock file still names it
    run.communicate()
    resumed = trainer(tmp_path, 1000)
    assert resumed.step >= 2
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "taken over" in line]
    assert line.startswith(f"run folder {tmp_path / 'debug'}: the lock of a run that ended "
                           f"without releasing it (pid {run.pid} on {os.uname().nodename}, "
                           "started ")
    resumed.close()


def test_a_new_run_over_a_finished_one_is_refused_unless_overwritten(tmp_path, capsys):
    config = {**BASE, "training.steps": 3, "job.output_dir": str(tmp_path)}
    Trainer(load_config("debug", config)).train()
    with pytest.raises(ConfigError) as refused:
        Trainer(load_config("debug", config))
    assert str(refused.value) == (
        f"run folder {tmp_path / 'debug'} already holds a run's metrics (metrics.jsonl, steps "
        "1-3) and this run has no checkpoint there to resume: resume that run "
        "(checkpoint.enabled with its checkpoints), give this run another job.name, or set "
        "job.overwrite = true to replace its metrics and TensorBoard files")
    Trainer(load_config("debug", {**config, "job.overwrite": True})).train()
    assert [r["step"] for r in strict_records(tmp_path / "debug")] == [1, 2, 3]
    assert "the earlier metrics.jsonl and tb/ were deleted (job.overwrite)" in \
        capsys.readouterr().out


# ---- rotation and branches -----------------------------------------------------------------

def test_resuming_an_older_step_moves_the_later_ones_aside_and_keeps_the_new_one(tmp_path,
                                                                                 capsys):
    trainer(tmp_path, 8, **{"checkpoint.keep_last": 0}).train()
    folder = tmp_path / "debug" / "checkpoints"
    assert checkpoint_steps(folder) == [2, 4, 6, 8]
    branch = trainer(tmp_path, 8, **{"checkpoint.keep_last": 2, "checkpoint.load_step": 4,
                                     "checkpoint.interval": 5})
    assert branch.step == 4
    line = next(line for line in capsys.readouterr().out.splitlines() if "moved to" in line)
    aside = folder / line.split("moved to ")[1].split(";")[0].rsplit("/", 1)[1]
    assert line.startswith("checkpoint.load_step = 4: the later checkpoints (step 6, 8) moved to")
    assert checkpoint_steps(aside) == [6, 8]  # kept, out of the way
    branch.train(until=5)
    assert checkpoint_steps(folder) == [4, 5]  # the newest is kept, the oldest rotated out
    assert trainer(tmp_path, 8, **{"checkpoint.interval": 5}).step == 5  # this branch


# ---- verification --------------------------------------------------------------------------

def test_a_checkpoint_without_its_hash_record_is_refused_unless_loaded_unverified(tmp_path,
                                                                                  capsys):
    trainer(tmp_path, 2).train()
    step = tmp_path / "debug" / "checkpoints" / "step-0000002"
    (step / "hashes-rank0.json").unlink()
    shard = step / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x01  # damaged, and nothing records what it was
    shard.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=re.escape(
            f"checkpoint {step} cannot be loaded: file {step / '.metadata'} has no recorded "
            "hash (a hashes-rank*.json file is missing")) as refused:
        trainer(tmp_path, 2)
    assert "checkpoint.load_unverified = true" in str(refused.value)
    loaded = trainer(tmp_path, 2, **{"checkpoint.load_unverified": True})
    assert loaded.step == 2
    assert "checkpoint step 2 loaded in" in capsys.readouterr().out
    loaded.close()


def test_an_unreadable_hash_record_is_refused_by_name(tmp_path):
    trainer(tmp_path, 2).train()
    record = tmp_path / "debug" / "checkpoints" / "step-0000002" / "hashes-rank0.json"
    record.write_text(record.read_text()[:20])  # cut: invalid JSON
    with pytest.raises(ConfigError, match=re.escape(
            f"its hash record {record} cannot be read (JSONDecodeError)")):
        trainer(tmp_path, 4)


# ---- the data position ---------------------------------------------------------------------

@pytest.mark.parametrize("key", ["training.seq_len", "data.path"])
def test_a_resume_with_other_data_settings_is_refused_naming_the_key(tmp_path, key):
    trainer(tmp_path, 2).train()
    corpus = tmp_path / "corpus.jsonl"  # the same documents, another file
    shutil.copy(resolve("builtin:debug/corpus.jsonl"), corpus)
    saved, value = {"training.seq_len": ("64", "32"),
                    "data.path": ("builtin:debug/corpus.jsonl", str(corpus))}[key]
    with pytest.raises(ConfigError, match=re.escape(
            f"the data settings changed since it was saved ({key} was {saved!r} and is now "
            f"{value!r}), so its saved data position would index other data: set them "
            "back, or set checkpoint.reset_data_position = true")):
        trainer(tmp_path, 4, **{key: value})


def test_reset_data_position_resumes_the_weights_and_starts_the_data_over(tmp_path, capsys):
    trainer(tmp_path, 2).train()
    resumed = trainer(tmp_path, 4, **{"training.seq_len": 32, "lr_schedule.decay_steps": 2,
                                      "checkpoint.reset_data_position": True})
    assert resumed.step == 2 and resumed.loader.state_dict()["consumed"] == 0
    assert ("checkpoint.reset_data_position: the data starts from its beginning "
            "(training.seq_len changed since the checkpoint)") in capsys.readouterr().out
    resumed.train()


# ---- the last checkpoint -------------------------------------------------------------------

def test_a_run_whose_last_checkpoint_cannot_be_written_exits_5(small_disk, tmp_path):
    result = run_cli(cli_args({**CKPT, "training.steps": 4,
                               "checkpoint.folder": str(small_disk / "ckpt"),
                               "job.output_dir": str(tmp_path / "out")}))
    assert result.returncode == EXIT_NOT_SAVED, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    (line,) = errors(result.stderr)
    assert line.startswith("error: the run reached its last step 4 but its checkpoint could "
                           f"not be saved ({small_disk / 'ckpt'} has ")
    assert "the latest checkpoint is step 2: make room in" in line and "exit code 5" in line
    assert checkpoint_steps(small_disk / "ckpt") == [2]


def test_a_full_disk_during_the_last_save_is_said_in_words(small_disk, tmp_path, monkeypatch):
    # The free-space check believes the disk has room: the write itself meets the full disk.
    monkeypatch.setattr("dtrain.checkpoint.free_bytes", lambda folder: 2**40)
    run = trainer(tmp_path / "out", 4, **{"checkpoint.folder": str(small_disk / "ckpt")})
    with pytest.raises(CheckpointNotSaved, match=r"could not be saved \(writing .*step-0000004"
                                                 r"\.tmp failed: the disk is full"):
        run.train()
    assert checkpoint_steps(small_disk / "ckpt") == [2]


@pytest.fixture
def read_only_dir(tmp_path):
    with tmpfs(tmp_path / "ro", "size=1M,ro") as mount:
        yield mount


def test_an_output_folder_on_a_read_only_file_system_is_one_line(read_only_dir):
    result = run_cli(cli_args({**BASE, "training.steps": 2, "job.output_dir": str(read_only_dir)}))
    assert result.returncode == EXIT_BAD_INPUT and "Traceback" not in result.stderr
    assert errors(result.stderr) == [
        f"error: run folder {read_only_dir / 'debug'} cannot be written (Read-only file "
        "system): set job.output_dir to a writable folder"]


# ---- preemption and Ctrl-C -----------------------------------------------------------------

def test_sigterm_to_one_worker_ends_the_job_despite_torchrun_restarts(tmp_path):
    steps = 60
    args = cli_args({**CKPT, "training.steps": steps, "checkpoint.interval": 20,
                     "checkpoint.async_save": True, "job.output_dir": str(tmp_path)})
    process = torchrun(args, launch=("--standalone", "--max-restarts", "2"),
                       stderr=subprocess.STDOUT)
    lines = []
    wait_for_step(process, 3, lines)
    os.kill(rank_pid(process.pid, 1), signal.SIGTERM)
    out, _ = process.communicate(timeout=300)
    console = "".join(lines) + out
    stopped = re.search(r"SIGTERM: stopped after step (\d+); checkpoint step \1 saved", console)
    assert stopped, console[-3000:]
    saved = int(stopped.group(1))
    # Each restart sees the preemption and exits at once: no step is trained after it.
    assert console.count("torchrun restarted it (attempt") == 2, console[-3000:]
    assert not re.search(r"^step +\d+/", console.split(stopped.group(0))[1], re.M)
    assert process.returncode != 0 and "exitcode  : 75 " in console
    assert checkpoint_steps(tmp_path / "debug" / "checkpoints")[-1] == saved
    records = strict_records(tmp_path / "debug")
    assert records[-1]["step"] == saved
    again = torchrun(args)  # a new launch resumes
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-3000:]
    assert f"resumed from step {saved} " in out
    assert [r["step"] for r in strict_records(tmp_path / "debug")] == list(range(1, steps + 1))


def ctrl_c_run(tmp_path, **overrides) -> tuple[subprocess.CompletedProcess, list[str]]:
    process = start_cli(cli_args({**CKPT, "training.steps": 1000,
                                  "job.output_dir": str(tmp_path), **overrides}))
    lines = []
    wait_for_step(process, 3, lines)
    process.send_signal(signal.SIGINT)
    out, err = finish(process, 120)
    return subprocess.CompletedProcess(process.args, process.returncode, "".join(lines) + out,
                                       err), lines


def test_ctrl_c_saves_like_sigterm_when_checkpoints_are_on(tmp_path):
    result, _ = ctrl_c_run(tmp_path)
    assert result.returncode == EXIT_PREEMPTED and "Traceback" not in result.stderr
    said = re.search(r"^SIGINT: stopped after step (\d+); checkpoint step \1 saved", result.stdout,
                     re.M)
    assert said, result.stdout[-2000:]
    assert checkpoint_steps(tmp_path / "debug" / "checkpoints")[-1] == int(said.group(1))


def test_ctrl_c_without_checkpoints_is_one_line_and_exit_130(tmp_path):
    result, _ = ctrl_c_run(tmp_path, **{"checkpoint.enabled": False})
    assert result.returncode == EXIT_INTERRUPTED and "Traceback" not in result.stderr
    assert errors(result.stderr) == [
        "error: interrupted (Ctrl-C): stopped at once; nothing was saved since the last "
        "checkpoint (exit code 130)"]


class InterruptsWhenCollected:
    """Sends this process a SIGINT from its finaliser: Python raises the KeyboardInterrupt
    inside the finaliser, prints it as ignored and goes on."""

    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # the handler runs here, in the finaliser


def test_a_ctrl_c_lost_in_a_finaliser_still_stops_at_the_step_boundary(tmp_path, monkeypatch):
    lost = []  # what Python reports as ignored ("Exception ignored in ...")
    monkeypatch.setattr(sys, "unraisablehook", lambda raised: lost.append(raised.exc_type))
    run = trainer(tmp_path, 10, **{"checkpoint.enabled": False})
    block = next(iter(run.model.layers.values()))

    def collect_at_step_3(*args):
        if run.step == 2 and not lost:  # step 3's first forward
            InterruptsWhenCollected()  # collected at once: its finaliser runs here

    handle = block.register_forward_hook(collect_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        run.train()
    handle.remove()
    assert lost == [KeyboardInterrupt]  # Python lost the Ctrl-C's own exception
    assert run.step == 3  # the step finished, the next never began


def test_a_second_ctrl_c_stops_at_once(tmp_path):
    run = trainer(tmp_path, 10)
    block = next(iter(run.model.layers.values()))

    def two_keypresses(*args):
        if run.step == 3:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1.2)  # a person pressing again: later than torchrun's forwarded copy
            os.kill(os.getpid(), signal.SIGINT)

    block.register_forward_hook(two_keypresses)
    with pytest.raises(KeyboardInterrupt):
        run.train()
    assert run.step == 3 and checkpoint_steps(tmp_path / "debug" / "checkpoints") == [2]
