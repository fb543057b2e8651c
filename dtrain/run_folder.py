"""One run per run folder: a run holds a lock on ``<output_dir>/<name>`` for its lifetime.

Rank 0 takes a POSIX record lock (``fcntl.lockf``) on ``<run>/.lock`` and writes who holds it
(host, pid, start time, job). The kernel, or the NFS lock manager on a shared file system,
releases such a lock when its process dies, so a lock left by a dead run is taken over, with one
line naming it; a live holder makes a second run exit with one line and code 2. The verdict is
broadcast, so every rank of the second run refuses together.

A new run (nothing to resume) into a folder that holds an earlier run's metrics is refused too,
naming the ways on (resume, another ``job.name``, ``job.overwrite``), except when the earlier
run is this same job restarted by torchrun or requeued by SLURM before its first checkpoint: it
is the same run starting again.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path

import torch.distributed as dist

from dtrain.config import ConfigError
from dtrain.log import logger

LOCK = ".lock"


def job_identity() -> tuple[str, int]:
    """(the launcher's job id, this attempt's restart count): SLURM's job id, or torchrun's run
    id (``--rdzv-id``; a fresh one per launch with ``--standalone``), "" for a plain process."""
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID", "")
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) \
        + int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    return ("" if job == "none" else job), restarts


class RunFolder:
    """The claimed run folder (``claim``); ``release()`` gives it back at the end of the run."""

    def __init__(self, path: Path, lock_fd: int | None):
        self.path, self._fd = path, lock_fd
        self.job = job_identity()[0]

    @classmethod
    def claim(cls, path: Path, resuming: bool, overwrite: bool, rank: int,
              group: dist.ProcessGroup | None) -> RunFolder:
        """Rank 0 locks ``path`` and checks that a new run may start there; every rank raises
        the same ConfigError when it may not. ``resuming``: a checkpoint will be loaded."""
        fd, problem = None, ""
        if rank == 0:
            try:
                fd, previous = _lock(path)
                _check_new_run(path, resuming, overwrite, previous)
            except (ConfigError, OSError) as e:  # every rank hears it, or the others wait
                problem = str(e) if isinstance(e, ConfigError) else (
                    f"run folder {path} cannot be prepared ({e.strerror or e}): set "
                    "job.output_dir to a writable folder")
                if fd is not None:
                    os.close(fd)
                    fd = None
        if group is not None:
            verdict = [problem]
            dist.broadcast_object_list(verdict, src=0, group=group)
            problem = verdict[0]
        if problem:
            raise ConfigError(problem)
        return cls(path, fd)

    def release(self) -> None:
        """Marks the lock released (a later run takes the folder without a word) and unlocks."""
        if self._fd is None:
            return
        try:
            _write_record(self._fd, {"released": True, "job": self.job})
        except OSError:  # the folder became unwritable: the lock goes with the process anyway
            pass
        os.close(self._fd)  # closing the file releases the lock
        self._fd = None


def _lock(path: Path) -> tuple[int, dict]:
    """The locked file's descriptor, and the record the previous holder left."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ConfigError(f"run folder {path} cannot be written ({e.strerror}): set "
                          "job.output_dir to a writable folder") from None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = _describe(_read_record(fd))
        os.close(fd)
        raise ConfigError(f"run folder {path} is in use by another run ({holder}): wait for it "
                          "to end, or give this run another job.name") from None
    previous = _read_record(fd)
    job, restarts = job_identity()
    mine = previous.get("pid") == os.getpid() and previous.get("host") == socket.gethostname()
    if previous and not previous.get("released") and not mine:  # mine: a notebook's new trainer
        same = job and previous.get("job") == job
        logger.warning(f"run folder {path}: the lock of "
                       + ("this job's previous attempt" if same else "a run that ended without "
                          "releasing it")
                       + f" ({_describe(previous)}) was taken over")
    try:
        _write_record(fd, {"host": socket.gethostname(), "pid": os.getpid(), "job": job,
                           "attempt": restarts, "started": time.strftime("%Y-%m-%d %H:%M:%S")})
    except OSError as e:
        os.close(fd)
        raise ConfigError(f"run folder {path} cannot be written ({e.strerror}): set "
                          "job.output_dir to a writable folder") from None
    return fd, previous


def _check_new_run(path: Path, resuming: bool, overwrite: bool, previous: dict) -> None:
    """Refuses a new run into a folder holding another run's metrics (or clears them with
    ``overwrite``, or for this same job's restart before its first checkpoint)."""
    metrics, tb = path / "metrics.jsonl", path / "tb"
    if resuming or not ((metrics.is_file() and metrics.stat().st_size) or tb.is_dir()):
        return
    job, restarts = job_identity()
    restarted = bool(job) and restarts > 0 and previous.get("job") == job
    if not (overwrite or restarted):
        raise ConfigError(
            f"run folder {path} already holds a run's metrics ({_steps(metrics)}) and this run "
            "has no checkpoint there to resume: resume that run (checkpoint.enabled with its "
            "checkpoints), give this run another job.name, or set job.overwrite = true to "
            "replace its metrics and TensorBoard files")
    metrics.unlink(missing_ok=True)
    shutil.rmtree(tb, ignore_errors=True)
    logger.warning(f"run folder {path}: the earlier metrics.jsonl and tb/ were deleted ("
                   + ("job.overwrite" if overwrite else "this job restarted before its first "
                      "checkpoint: it starts again from step 0") + ")")


def _steps(metrics: Path) -> str:
    """"metrics.jsonl, steps A-B" (what a person needs to recognise the earlier run)."""
    steps = []
    for line in metrics.read_text(errors="replace").splitlines():
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            continue
    return f"metrics.jsonl, steps {min(steps)}-{max(steps)}" if steps else "metrics.jsonl"


def _describe(record: dict) -> str:
    if not record:
        return "holder unknown"
    return (f"pid {record.get('pid')} on {record.get('host')}, started {record.get('started')}"
            + (f", job {record['job']}" if record.get("job") else ""))


def _read_record(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    return _parse(os.read(fd, 4096).decode(errors="replace"))


def _parse(text: str) -> dict:
    try:
        record = json.loads(text)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _write_record(fd: int, record: dict) -> None:
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps(record).encode())
    os.fsync(fd)
