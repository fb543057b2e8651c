"""metrics.jsonl and TensorBoard on a disk that fails them: a torn line left by a killed
writer, a run folder whose disk fills, a run folder that turns read-only. Each fault is caused for
real; the run goes on and says so once."""

import json
import os
import subprocess

import pytest
import torch
from conftest import BASE, strict_records, tmpfs

from dtrain import Trainer, load_config
from dtrain.checkpoint import checkpoint_steps
from dtrain.config import MetricsConfig
from dtrain.log import setup_logging
from dtrain.metrics import MetricsLogger, StepMetrics

# A thread's traceback is a second report of a failure, and under pytest it is not on stderr.
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")


def run_config(output_dir, steps: int, **overrides) -> dict:
    """The small debug run of these tests: one micro-batch of 4 sequences of 64 tokens a step,
    checkpoints."""
    return {**BASE, "training.global_batch_size": 4, "training.micro_batch_size": 4,
            "training.steps": steps, "checkpoint.enabled": True,
            "job.output_dir": str(output_dir), **overrides}


def warnings_about(out: str, fragment: str) -> list[str]:
    return [line for line in out.splitlines() if fragment in line]


def step_lines(out: str) -> list[int]:
    return [int(line.split()[1].split("/")[0]) for line in out.splitlines()
            if line.startswith("step ")]


# ---- a torn line -----------------------------------------------------------------------------

def test_a_torn_last_line_is_dropped_once_and_the_resume_logs_each_step_once(tmp_path, capsys):
    config = run_config(tmp_path, 6, **{"checkpoint.interval": 2})
    Trainer(load_config("debug", config)).train(until=5)  # checkpoint 4; 5 runs again
    path = tmp_path / "debug" / "metrics.jsonl"
    os.truncate(path, path.stat().st_size - 40)  # killed while writing step 5's record
    capsys.readouterr()
    history = Trainer(load_config("debug", config)).train()
    assert history[-1]["step"] == 6
    assert warnings_about(capsys.readouterr().out, "dropped") == [
        f"{path}: dropped a torn last line (the process was stopped while writing it)"]
    assert [r["step"] for r in strict_records(tmp_path / "debug")] == [1, 2, 3, 4, 5, 6]


def test_lines_that_do_not_parse_are_counted_in_the_same_one_line(tmp_path, capsys):
    config = run_config(tmp_path, 6, **{"checkpoint.interval": 2})
    Trainer(load_config("debug", config)).train(until=5)
    path = tmp_path / "debug" / "metrics.jsonl"
    lines = path.read_bytes().split(b"\n")
    lines[1] = b"\0" * 64  # a filesystem's zeros where step 2's record was
    path.write_bytes(b"\n".join(lines)[:-40])  # and a torn step 5
    capsys.readouterr()
    Trainer(load_config("debug", config)).train()
    assert warnings_about(capsys.readouterr().out, "dropped") == [
        f"{path}: dropped a torn last line (the process was stopped while writing it) and 1 "
        "earlier line that does not parse as a JSON object"]
    assert [r["step"] for r in strict_records(tmp_path / "debug")] == [1, 3, 4, 5, 6]


# ---- a run folder whose disk fills or turns read-only ----------------------------------------

# tmpfs allocates 4 KiB pages: once the disk is full, the files' last pages still take a few
# records (about 10 of metrics.jsonl's), so the run is long enough to need new ones.
STEPS = 16


@pytest.fixture
def run_disk(tmp_path):
    """A 256 KiB tmpfs mounted at the run folder (``tmp_path/out/debug``)."""
    with tmpfs(tmp_path / "out" / "debug", "size=256k") as mount:
        yield mount


def fill(disk) -> None:
    """Writes zeros to a file on ``disk`` until the disk has no room left."""
    with open(disk / "zeros", "wb", buffering=0) as file:
        with pytest.raises(OSError, match="No space left on device"):
            while True:
                file.write(bytes(65536))


def make_read_only(folder) -> None:
    """Mounts ``folder`` over itself read-only: what the run opens from now on is refused with
    EROFS (a plain ``remount,ro`` is refused while the run holds its lock file open)."""
    subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
    subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)], check=True)


def disk_run(run_disk, tensorboard: bool) -> Trainer:
    """A run whose folder is ``run_disk``, with checkpoints in a folder on another disk."""
    checkpoints = run_disk.parent.parent / "checkpoints"
    return Trainer(load_config("debug", run_config(
        run_disk.parent, STEPS, **{"checkpoint.interval": 8, "checkpoint.folder": str(checkpoints),
                                   "metrics.tensorboard": tensorboard})))


def assert_the_run_went_on(trainer: Trainer, history: list[dict], out: str, cause: str,
                           first_step: int) -> int:
    """Every step trained and checkpointed, one warning line about the failed write, the
    console's step lines before and after it, and the records before the failed one whole in
    metrics.jsonl; returns the step of the failed write."""
    assert history[-1]["step"] == STEPS
    assert checkpoint_steps(trainer.checkpointer.folder)[-1] == STEPS
    (warning,) = warnings_about(out, "failed")
    assert warning.startswith(f"metrics: writing {trainer.run_dir}/")
    assert f"[Errno {cause}" in warning
    failed_at = int(warning.split("console only from step ")[1].split()[0])
    assert warning.endswith(f"console only from step {failed_at} on; training goes on")
    assert step_lines(out) == list(range(first_step, STEPS + 1))
    assert failed_at < STEPS  # step lines came after the warning
    assert out.splitlines()[-1].startswith("done: ")
    # A write cut short by a full disk leaves a torn last line (the next run to open the file
    # drops it): the lines before it are whole, through the failed step when TensorBoard's
    # write of it failed after metrics.jsonl's.
    lines = (trainer.run_dir / "metrics.jsonl").read_text().split("\n")[:-1]
    steps = [json.loads(line)["step"] for line in lines]
    assert steps in (list(range(1, failed_at)), list(range(1, failed_at + 1)))
    return failed_at


@pytest.mark.parametrize("tensorboard", [False, True], ids=["jsonl", "tensorboard"])
def test_a_full_run_folder_leaves_the_console_and_the_checkpoints(run_disk, capsys, tensorboard):
    trainer = disk_run(run_disk, tensorboard)
    block = next(iter(trainer.model.layers.values()))
    block.register_forward_hook(  # the disk fills during step 4, the files open
        lambda *a: fill(run_disk) if trainer.step == 3 and not (run_disk / "zeros").exists()
        else None)
    history = trainer.train()
    out, err = capsys.readouterr()
    failed_at = assert_the_run_went_on(trainer, history, out, "28] No space left on device", 1)
    assert failed_at > 4  # the files' last pages had room for a few records
    assert err == ""  # no traceback (tensorboard's writer thread's: pytestmark)


@pytest.mark.parametrize("tensorboard", [False, True], ids=["jsonl", "tensorboard"])
def test_a_read_only_run_folder_leaves_the_console_and_the_checkpoints(run_disk, capsys,
                                                                       tensorboard):
    trainer = disk_run(run_disk, tensorboard)
    trainer.train(until=3)
    make_read_only(run_disk)
    capsys.readouterr()
    history = trainer.train()
    out, err = capsys.readouterr()
    failed_at = assert_the_run_went_on(trainer, history, out, "30] Read-only file system", 4)
    assert failed_at == 4  # the files open again at step 4: refused
    assert err == ""


# A logged step's figures (those the console line shows).
RECORD = {"loss": 2.5, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_second_per_device": 1000.0,
          "tflops_per_device": 1.0, "step_time_s": 0.5, "data_wait_percent": 1.0,
          "peak_memory_gib": 2.0, "eta_s": 65.0}


def test_a_rewrite_that_meets_a_full_disk_leaves_the_file_as_it_was(run_disk, capsys):
    setup_logging(rank=0)
    path = run_disk / "metrics.jsonl"
    before = b"".join(json.dumps({"step": s, "loss": 8.0}).encode() + b"\n" for s in (1, 2, 3))
    path.write_bytes(before + b'{"step": 4, "lo')  # a torn step 4: the file is rewritten
    fill(run_disk)
    metrics = MetricsLogger(MetricsConfig(tensorboard=False), run_disk, enabled=True,
                            resume_step=3)
    metrics.log(4, 10, RECORD)
    metrics.close()
    assert path.read_bytes() == before + b'{"step": 4, "lo'
    assert sorted(p.name for p in run_disk.iterdir()) == ["metrics.jsonl", "zeros"]
    out = capsys.readouterr().out
    assert out.splitlines() == [
        f"metrics: writing {path} failed (OSError: [Errno 28] No space left on device); this "
        "run's metrics go to the console only from step 4 on; training goes on",
        MetricsLogger.format_line(4, 10, {"step": 4, **RECORD})]


def test_the_done_line_says_when_the_run_folder_cannot_be_listed(tmp_path):
    metrics = StepMetrics(MetricsConfig(), MetricsLogger(MetricsConfig(), tmp_path, False),
                          torch.device("cpu"), 256, 1, 1000, 10, None)
    metrics.start(0, 10)
    line = metrics.done_line(10, [], tmp_path / "gone")
    assert line.endswith(f"outputs in {tmp_path / 'gone'} (not listed: No such file or "
                         "directory)")
