"""Long runs that survive: non-finite steps, preemption, hangs, full disks, damaged or mismatched
checkpoints and resumed metrics. Each test causes the fault for real and checks what the user
sees."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import (
    BASE,
    REL,
    ROOT,
    rank_pid,
    run_distributed,
    strict_records,
    torchrun,
    wait_for_step,
)
from distributed_runner import poison_gradient

from dtrain import Trainer, load_config
from dtrain.checkpoint import checkpoint_steps
from dtrain.config import ConfigError
from dtrain.errors import (
    EXIT_HANG,
    EXIT_NONFINITE,
    EXIT_PREEMPTED,
    CheckpointNotSaved,
    Preempted,
)
from dtrain.lr_schedule import lr_factor

SMALL = ["--recipe", "debug", "--model.n_layers", "2", "--training.seq_len", "64",
         "--training.global_batch_size", "4", "--training.micro_batch_size", "1",
         "--metrics.log_every", "1",
         "--metrics.tensorboard", "false"]


# ---- non-finite steps ----------------------------------------------------------------------

def test_a_non_finite_step_changes_nothing_and_is_reported(tmp_path):
    trainer = Trainer(load_config("debug", {**BASE, "training.steps": 5,
                                            "job.output_dir": str(tmp_path)}))
    trainer.train(until=2)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    poison_gradient(trainer, 3)
    trainer.run_step()  # step 3: NaN loss and gradients
    assert all(torch.equal(a, p) for a, p in zip(before, trainer.model.parameters(),
                                                   strict=True))
    trainer.train()
    # Step 3 ran outside train(): the next log line, step 4's, reports it.
    assert [(r["step"], r.get("nonfinite_steps")) for r in trainer.history] == [
        (1, None), (2, None), (4, [3]), (5, None)]
    # Four updates for five steps: AdamW's own step count skipped the poisoned one, and so did
    # the learning-rate schedule (as Megatron-LM's): step 4 ran at the rate of the third update.
    assert {int(s["step"]) for s in trainer.optimizer.state.values()} == {4}
    assert trainer.scheduler.last_epoch == 4
    cfg = trainer.config
    rates = {r["step"]: r["lr"] for r in trainer.history}
    assert rates[4] == pytest.approx(cfg.optimizer.lr * lr_factor(3, cfg.lr_schedule, 5,
                                                                  cfg.optimizer.lr))
    assert rates[5] == pytest.approx(cfg.optimizer.lr * lr_factor(4, cfg.lr_schedule, 5,
                                                                  cfg.optimizer.lr))
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert strict_records(tmp_path / "debug")[0]["step"] == 1


def test_a_huge_learning_rate_skips_steps_then_stops_with_code_3(cli, tmp_path):
    result = cli([*SMALL, "--training.steps", "12", "--optimizer.lr", "1e3",
                  "--checkpoint.enabled", "true", "--checkpoint.interval", "1",
                  "--checkpoint.keep_last", "2", "--job.output_dir", str(tmp_path)])
    assert result.returncode == EXIT_NONFINITE, result.stderr[-2000:]
    error = result.stderr.strip().splitlines()
    assert len(error) == 1 and "3 in a row, training.max_nonfinite_steps = 3" in error[0]
    records = strict_records(tmp_path / "debug")
    assert [r["grad_norm"] for r in records[1:]] == [None, None]  # NaN written as null
    assert [r["nonfinite_steps"] for r in records[1:]] == [[2], [3]]
    # Skipped steps leave the weights finite: their checkpoints are kept, and they load.
    folder = tmp_path / "debug" / "checkpoints"
    assert checkpoint_steps(folder) == [2, 3]
    resumed = Trainer(load_config("debug", {**BASE, "training.seq_len": 64,
                                            "training.global_batch_size": 4,
                                            "training.steps": 12, "checkpoint.enabled": True,
                                            "optimizer.lr": 1e3,  # the schedule it saved
                                            "lr_schedule.warmup_steps": 20,
                                            "job.output_dir": str(tmp_path)}))
    assert resumed.step == 3
    assert all(torch.isfinite(p).all() for p in resumed.model.parameters())


def test_nonfinite_stop_ends_at_the_first_one(cli, tmp_path):
    result = cli([*SMALL, "--training.steps", "6", "--optimizer.lr", "1e3",
                  "--training.nonfinite", "stop", "--job.output_dir", str(tmp_path)])
    assert result.returncode == EXIT_NONFINITE
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().startswith("error: step 2: ") and "'stop'" in result.stderr


def test_two_ranks_skip_the_step_one_rank_poisons(tmp_path):
    # Rank 1 alone sees a NaN loss at step 3; both ranks skip that update, so the run equals
    # one process skipping it.
    skip = {**BASE, "training.steps": 5}
    single = Trainer(load_config("debug", {**skip, "job.output_dir": str(tmp_path / "one")}))
    poison_gradient(single, 3)
    reference = single.train()
    (run,) = run_distributed(tmp_path / "two", 2, [{
        **skip, "job.output_dir": str(tmp_path / "two"), "_poison": {"step": 3, "rank": 1}}])
    assert [r.get("nonfinite_steps") for r in run["history"]] == [None, None, [3], None, None]
    for ref, got in zip(reference, run["history"], strict=True):
        if ref["step"] != 3:  # the poisoned step's own loss is NaN
            assert got["loss"] == pytest.approx(ref["loss"], rel=REL), ref["step"]


def test_two_ranks_stop_together_with_code_3(tmp_path):
    process = torchrun([*SMALL, "--training.steps", "6", "--optimizer.lr", "1e3",
                        "--training.nonfinite", "stop", "--job.output_dir", str(tmp_path)])
    out, err = process.communicate(timeout=300)
    assert process.returncode != 0
    assert err.count("error: step 2: the loss or the gradient norm is not finite") == 1
    assert err.count("exitcode  : 3 ") == 2 or "exitcode: 3" in err, err[-3000:]


# ---- preemption ----------------------------------------------------------------------------

def test_sigterm_to_torchrun_saves_the_current_step_and_resume_loses_none(tmp_path):
    steps = 30
    reference = Trainer(load_config("debug", {**BASE, "training.steps": steps,
                                              "job.output_dir": str(tmp_path / "ref")})).train()
    args = ["--recipe", "debug", "--model.n_layers", "2", "--training.seq_len", "64",
            "--training.global_batch_size", "8", "--training.micro_batch_size", "1",
            "--lr_schedule.warmup_steps", "2", "--training.steps", str(steps),
            "--metrics.log_every", "1", "--checkpoint.enabled", "true",
            "--checkpoint.interval", "10", "--job.output_dir", str(tmp_path / "run")]
    process, lines = torchrun(args), []
    wait_for_step(process, 3, lines)
    start = time.monotonic()
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    elapsed = time.monotonic() - start
    lines.append(out)
    said = [line for line in "".join(lines).splitlines() if line.startswith("SIGTERM:")]
    assert len(said) == 1, err[-3000:]
    saved = int(said[0].split("stopped after step ")[1].split(";")[0])
    assert f"checkpoint step {saved} saved" in said[0] and str(EXIT_PREEMPTED) in said[0]
    assert elapsed < 30  # inside torchrun's grace period
    folder = tmp_path / "run" / "debug" / "checkpoints"
    assert checkpoint_steps(folder)[-1] == saved and 3 <= saved < steps
    again = torchrun(args)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-3000:]
    records = strict_records(tmp_path / "run" / "debug")
    assert [r["step"] for r in records] == list(range(1, steps + 1))  # each step once
    for ref, got in zip(reference, records, strict=True):
        assert got["loss"] == pytest.approx(ref["loss"], rel=REL), ref["step"]


def test_sigusr1_stops_after_the_step_with_a_checkpoint(tmp_path):
    trainer = Trainer(load_config("debug", {**BASE, "training.steps": 10,
                                            "checkpoint.enabled": True,
                                            "job.output_dir": str(tmp_path)}))
    block = next(iter(trainer.model.layers.values()))
    block.register_forward_hook(  # the signal arrives during step 4
        lambda *a: os.kill(os.getpid(), signal.SIGUSR1) if trainer.step == 3 else None)
    with pytest.raises(Preempted, match="SIGUSR1: stopped after step 4; checkpoint step 4"):
        trainer.train()
    assert checkpoint_steps(tmp_path / "debug" / "checkpoints") == [4]
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # the handler is given back


# ---- hangs ---------------------------------------------------------------------------------

def test_a_stopped_rank_ends_the_job_with_the_others_stacks(tmp_path):
    timeout = 8
    process, lines = torchrun([*SMALL, "--training.steps", "100000",
                               "--training.hang_timeout_s", str(timeout),
                               "--job.output_dir", str(tmp_path)]), []
    wait_for_step(process, 3, lines)
    stopped = rank_pid(process.pid, 1)
    os.kill(stopped, signal.SIGSTOP)
    start = time.monotonic()
    try:
        out, err = process.communicate(timeout=timeout + 60)
    finally:
        os.kill(stopped, signal.SIGKILL) if os.path.exists(f"/proc/{stopped}") else None
    assert process.returncode != 0
    assert time.monotonic() - start < timeout + 45
    stacks = (tmp_path / "debug" / "hang-rank0.txt").read_text()
    assert "no progress for" in stacks and "Thread" in stacks and "File" in stacks
    assert re.search(r"rank 1: after step \d+, .* \(silent\)", stacks)
    line = next(line for line in err.splitlines() if line.startswith("error:"))
    # Rank 0 waited and ends the job; the line names rank 1, whose reports stopped.
    assert re.fullmatch(r"error: rank 1 stopped making progress after step \d+ \(no report for "
                        r"\d+ s; the others reached step \d+ and waited \d+ s\): rank 0's "
                        r"stacks are in .*hang-rank0.txt; stopping the job \(exit code 4\)", line)
    assert f"exitcode  : {EXIT_HANG} " in err or f"exitcode: {EXIT_HANG}" in err


def test_a_first_step_that_compiles_longer_than_the_hang_timeout_is_no_hang(tmp_path):
    timeout = 1  # compiling the first step takes 2.9 s or more on 2 CPU cores
    process = torchrun([*SMALL, "--training.steps", "4", "--compile.enabled", "true",
                        "--training.hang_timeout_s", str(timeout),
                        "--job.output_dir", str(tmp_path)])
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err[-3000:]
    records = strict_records(tmp_path / "debug")
    assert records[0]["step_time_s"] > timeout  # else this run proves nothing
    assert [r["step"] for r in records] == [1, 2, 3, 4]


# ---- disks and checkpoints -----------------------------------------------------------------

def disk_trainer(folder, steps: int, **overrides) -> Trainer:
    return Trainer(load_config("debug", {**BASE, "training.steps": steps,
                                         "checkpoint.enabled": True, "checkpoint.interval": 2,
                                         "checkpoint.folder": str(folder),
                                         "job.output_dir": str(folder.parent / "out"),
                                         **overrides}))


def test_too_little_free_space_skips_the_save_and_keeps_the_previous(small_disk, capsys):
    trainer = disk_trainer(small_disk / "ckpt", 4)
    with pytest.raises(CheckpointNotSaved):  # step 4 was the last: the run does not succeed
        trainer.train()
    assert checkpoint_steps(small_disk / "ckpt") == [2]
    line = next(line for line in capsys.readouterr().out.splitlines() if "not saved" in line)
    assert line.startswith(f"checkpoint step 4 not saved: {small_disk / 'ckpt'} has ")
    assert "GiB free and the checkpoint needs 0.04 GiB" in line and "step 2 stays" in line
    assert disk_trainer(small_disk / "ckpt", 4).step == 2


def test_a_write_that_fills_the_disk_removes_its_partial_files(small_disk, capsys,
                                                                monkeypatch):
    # The free-space check believes the disk has room: the write itself meets ENOSPC.
    monkeypatch.setattr("dtrain.checkpoint.free_bytes", lambda folder: 2**40)
    with pytest.raises(CheckpointNotSaved):
        disk_trainer(small_disk / "ckpt", 4).train()
    assert sorted(p.name for p in (small_disk / "ckpt").iterdir()) == ["step-0000002"]
    line = next(line for line in capsys.readouterr().out.splitlines() if "not saved" in line)
    assert "writing" in line and "failed" in line and "partial files were removed" in line
    assert "No space left on device" in line or "unexpected pos" in line
    monkeypatch.undo()
    assert disk_trainer(small_disk / "ckpt", 4).step == 2  # the previous one loads


def test_a_flipped_byte_names_the_damaged_file(tmp_path):
    folder = tmp_path / "ckpt"
    disk_trainer(folder, 2).train()
    shard = sorted((folder / "step-0000002").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=f"file {shard} is damaged"):
        disk_trainer(folder, 2)


def test_a_checkpoint_of_another_shape_is_refused_everywhere(cli, tmp_path):
    folder = tmp_path / "ckpt"
    disk_trainer(folder, 2, **{"model.n_layers": 4}).train()
    step = folder / "step-0000002"
    with pytest.raises(ConfigError, match="saved for another model shape: .* keys the model "
                                          "does not have .first model.layers.2"):
        disk_trainer(folder, 2)
    with pytest.raises(ConfigError, match="another model shape"):
        Trainer(load_config("debug", {**BASE, "checkpoint.initial_weights": str(step),
                                      "job.output_dir": str(tmp_path / "init")}))
    export = subprocess.run([sys.executable, "-m", "dtrain.convert_hf", "export", str(step),
                             str(tmp_path / "hf"), "--model", "llama3_debug", "--n-layers", "2"],
                            capture_output=True, text=True, cwd=ROOT)
    assert export.returncode == 2 and "another model shape" in export.stderr
    assert "Traceback" not in export.stderr
    (step / ".metadata").unlink()
    result = cli([*SMALL, "--model.n_layers", "4", "--checkpoint.enabled", "true",
                  "--checkpoint.folder", str(folder), "--job.output_dir", str(tmp_path)])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: checkpoint {step} cannot be loaded: {step} has no .metadata (not a "
        "checkpoint, or its save did not finish). It is damaged or was saved for another "
        "model shape or data source; point checkpoint.folder elsewhere or set "
        "checkpoint.load_step to another step"]


# ---- resumed metrics -----------------------------------------------------------------------

def test_a_resumed_run_logs_each_step_once(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = {**BASE, "training.steps": 10, "checkpoint.enabled": True,
              "checkpoint.interval": 5, "metrics.tensorboard": True,
              "job.output_dir": str(tmp_path)}
    Trainer(load_config("debug", config)).train(until=7)  # dies after step 7: 6, 7 run again
    Trainer(load_config("debug", config)).train()
    run = tmp_path / "debug"
    assert [r["step"] for r in strict_records(run)] == list(range(1, 11))
    events = EventAccumulator(str(run / "tb" / "debug"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 11))


def test_streamed_data_resumed_on_more_ranks_is_refused_by_name(tmp_path):
    hf = {**BASE, "data.source": "hf", "training.steps": 4, "checkpoint.enabled": True,
          "checkpoint.interval": 2, "job.output_dir": str(tmp_path)}
    first = Trainer(load_config("debug", hf))
    first.train(until=2)
    first.close()  # gives the run folder to the launch below
    args = [f"--{key}={value}" for key, value in hf.items()]
    process = torchrun(["--recipe", "debug", *args])
    out, err = process.communicate(timeout=300)
    assert process.returncode != 0
    # One line from each rank; the two ranks write to one pipe at the same moment, so a line
    # may follow another's text on the same line: counted, not matched at line starts.
    assert err.count("error: checkpoint ") == 2, err[-3000:]
    assert err.count("its streamed data state was saved by 1 data-parallel ranks and this run "
                     "has 2") == 2, err[-3000:]
    # The first rank out ends with 2 (torchrun's root cause); the other ends with 2 too, or is
    # stopped by torchrun (SIGTERM) when it comes second, after writing its line.
    codes = re.findall(r"exitcode  : (-?\d+)", err)
    assert "2" in codes, err[-3000:]
    assert set(codes) <= {"2", "-15"}, err[-3000:]
