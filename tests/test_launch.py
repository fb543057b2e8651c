"""Launching as a cluster job does: two torchrun launchers meeting as two nodes (static and c10d
rendezvous), torchrun's elastic restarts after a rank dies, and a real one-machine SLURM cluster
running tools/slurm/dtrain.sbatch, preempted and requeued. Each run's losses equal the
single-process run's."""

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import BASE, REL, ROOT, cli_args, rank_pid, strict_records, torchrun

from dtrain import Trainer, load_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_losses(records: list[dict], reference: list[dict]) -> None:
    assert [r["step"] for r in records] == [r["step"] for r in reference]  # each step once
    for ref, got in zip(reference, records, strict=True):
        assert got["loss"] == pytest.approx(ref["loss"], rel=REL), ref["step"]
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=REL), ref["step"]


# ---- two launchers as two nodes ------------------------------------------------------------

@pytest.mark.parametrize("rendezvous, nproc", [("static", 2), ("c10d", 1)])
def test_two_launchers_as_two_nodes_train_hsdp_like_one_process(reference, tmp_path, rendezvous,
                                                                nproc):
    # HSDP: the replicas are the nodes (dp_replicate 2), FSDP inside a node (dp_shard nproc).
    port = free_port()
    args = cli_args({**BASE, "parallel.dp_replicate": 2, "parallel.dp_shard": nproc,
                     "job.output_dir": str(tmp_path)})
    launchers = []
    for node in range(2):
        if rendezvous == "static":
            launch = ("--nnodes", "2", "--node_rank", str(node), "--master_addr", "127.0.0.1",
                      "--master_port", str(port))
        else:
            launch = ("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                      f"127.0.0.1:{port}", "--rdzv-id", "two-nodes")
        launchers.append(torchrun(args, nproc=nproc, launch=launch))
    outputs = [launcher.communicate(timeout=300) for launcher in launchers]
    for launcher, (_, err) in zip(launchers, outputs, strict=True):
        assert launcher.returncode == 0, err[-3000:]
    console = outputs[0][0] + outputs[1][0]  # rank 0 is on one of them
    mesh = f"dp_replicate 2 x dp_shard {nproc}" if nproc > 1 else "dp_replicate 2"
    assert f"world {2 * nproc} (cpu): {mesh}" in console
    assert_losses(strict_records(tmp_path / "debug"), reference)


# ---- elastic restarts ----------------------------------------------------------------------

def test_torchrun_restarts_after_a_rank_dies_and_the_run_resumes_by_itself(tmp_path):
    steps, kills = 30, 3
    overrides = {**BASE, "training.steps": steps, "checkpoint.enabled": True,
                 "checkpoint.interval": 3, "job.output_dir": str(tmp_path / "run")}
    process = torchrun(cli_args(overrides), nproc=2, launch=(
        "--standalone", "--max-restarts", str(kills)), stderr=subprocess.STDOUT)
    lines, resumed, killed = [], [], 0
    for line in process.stdout:
        lines.append(line)
        if match := re.search(r"resumed from step (\d+)", line):
            resumed.append(int(match.group(1)))
        step = re.match(r"step +(\d+)/", line)
        # Each attempt trains past a checkpoint of its own (every 3 steps), then rank 1 dies:
        # SIGKILL, no cleanup, maybe in the middle of a save.
        start = resumed[-1] if resumed else 0
        if step and killed < kills and len(resumed) == killed and int(step.group(1)) >= start + 4:
            os.kill(rank_pid(process.pid, 1), signal.SIGKILL)
            killed += 1
    process.wait(timeout=60)
    console = "".join(lines)
    assert process.returncode == 0, console[-4000:]
    assert killed == kills and len(resumed) == kills, console[-4000:]
    assert "connectFullMesh" not in console
    assert re.search(r"^done: steps \d+-30 in ", console, re.M)
    reference = Trainer(load_config("debug", {**BASE, "training.steps": steps,
                                              "job.output_dir": str(tmp_path / "ref")})).train()
    assert_losses(strict_records(tmp_path / "run" / "debug"), reference)


# ---- SLURM ---------------------------------------------------------------------------------

SBATCH = ROOT / "tools" / "slurm" / "dtrain.sbatch"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A one-machine SLURM cluster (tools/slurm/local_cluster.sh); the environment to submit
    with. Skipped where slurm-wlm is not installed, except in CI, which installs it."""
    if shutil.which("slurmctld") is None or os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("CI installs slurm-wlm and runs as root: .ci/run")
        pytest.skip("needs Debian's slurm-wlm and munge, and root")
    folder = tmp_path_factory.mktemp("slurm")
    subprocess.run([ROOT / "tools" / "slurm" / "local_cluster.sh", folder], check=True,
                   timeout=120)
    yield {**os.environ, "SLURM_CONF": str(folder / "slurm.conf"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT), "DTRAIN_NPROC_PER_NODE": "2",
           "DTRAIN_RDZV_PORT": str(free_port())}
    subprocess.run([ROOT / "tools" / "slurm" / "local_cluster.sh", folder, "stop"])


def job_state(job: str, env: dict) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True,
                         env=env, check=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_for_job(job: str, env: dict, output: Path, timeout: float = 300) -> dict[str, str]:
    """Polls until the job has ended (a requeued job starts again after about 10 s on the
    local cluster: its old credential's lifetime)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = job_state(job, env)
        if state["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            return state
        time.sleep(1)
    raise AssertionError(f"job {job} did not end in {timeout} s:\n"
                         f"{output.read_text()[-3000:] if output.exists() else ''}")


def sbatch(env: dict, folder: Path, overrides: dict) -> tuple[str, Path]:
    job = subprocess.run(["sbatch", "--parsable", f"--chdir={folder}", SBATCH,
                          *cli_args(overrides)], capture_output=True, text=True, env=env,
                         check=True).stdout.strip()
    return job, folder / f"dtrain-{job}.out"


def test_sbatch_trains_like_one_process_then_a_preempted_job_requeues_and_resumes(
        slurm, reference, tmp_path):
    job, output = sbatch(slurm, tmp_path, {**BASE, "job.output_dir": str(tmp_path / "first")})
    state = wait_for_job(job, slurm, output)
    log = output.read_text()
    assert state["JobState"] == "COMPLETED", log[-3000:]
    assert "on 1 node(s) x 2 rank(s)" in log and "world 2 (cpu): dp_shard 2" in log
    assert_losses(strict_records(tmp_path / "first" / "debug"), reference)

    # The second job gets the time-limit warning (USR1 to the batch script) at step 4 or after.
    steps = 30
    overrides = {**BASE, "training.steps": steps, "checkpoint.enabled": True,
                 "checkpoint.interval": 10, "job.output_dir": str(tmp_path / "second")}
    job, output = sbatch(slurm, tmp_path, overrides)
    deadline = time.monotonic() + 120
    while not (output.exists() and re.search(r"^step +4/", output.read_text(), re.M)):
        assert time.monotonic() < deadline, output.read_text()[-3000:] if output.exists() else ""
        time.sleep(0.2)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm, check=True)
    state = wait_for_job(job, slurm, output)
    log = output.read_text()
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", log[-3000:]
    stopped = re.search(r"SIGTERM: stopped after step (\d+); checkpoint step \1 saved", log)
    assert stopped, log[-3000:]
    saved = int(stopped.group(1))
    assert 4 <= saved < steps
    assert "(restart 1)" in log and f"resumed from step {saved} " in log
    assert re.search(rf"^done: steps {saved + 1}-{steps} in ", log, re.M), log[-3000:]
    whole = Trainer(load_config("debug", {**BASE, "training.steps": steps,
                                          "job.output_dir": str(tmp_path / "ref")})).train()
    assert_losses(strict_records(tmp_path / "second" / "debug"), whole)
